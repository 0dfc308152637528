"""Two "nodes" on this machine for the cluster tests, with the real parts: Debian's sshd on the loopback interface
with generated keys, reached by pdsh and ssh through an ssh config that pdsh takes from PDSH_SSH_ARGS_APPEND. A
node can also be an sshd started in a mount namespace of its own, where a folder of the project is another one
(another checkout, a node-local disk), as a second machine at the same path would see it."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.environment import free_port

SSHD = "/usr/sbin/sshd"


def missing() -> str | None:
    """Why these tests cannot run here (None: they can): `make test` installs openssh-server and pdsh as root."""
    if not (Path(SSHD).is_file() and shutil.which("pdsh") and shutil.which("ssh")):
        return "openssh-server, ssh and pdsh are not installed (make nodes installs them as root)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    return "no mount namespaces here (unshare --mount failed)" if probe.returncode else None


DEFAULTS = "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n" \
    "  BatchMode yes\n  ConnectTimeout 5\n"  # fmt: skip


@dataclass
class Nodes:
    folder: Path
    config: Path  # the ssh config: Host entries for every node, then the defaults
    servers: list[subprocess.Popen]
    ports: dict[str, int]

    @property
    def env(self) -> dict[str, str]:
        """What a process that starts ranks over ssh needs: pdsh's ssh options."""
        return {"PDSH_SSH_ARGS_APPEND": f"-F {self.config}"}

    def add(self, host: str, *, mounts: dict[Path, Path] | None = None) -> None:
        """`host` (a name or loopback address) served by an sshd of its own; with `mounts`, in a mount namespace
        where each key folder shows the value's contents."""
        port = free_port()
        config = self.folder / f"sshd_{port}"
        config.write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {self.folder / 'hostkey'}\n"
            f"AuthorizedKeysFile {self.folder / 'key.pub'}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
            "PidFile none\n"
        )
        command = [SSHD, "-D", "-e", "-f", str(config)]
        if mounts:
            binds = " && ".join(f"mount --bind {src} {dst}" for dst, src in mounts.items())
            inside = f"{binds} && exec {' '.join(command)}"
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", inside]
        self.servers.append(subprocess.Popen(command, stderr=subprocess.DEVNULL))
        self.ports[host] = port
        blocks = "".join(f"Host {h}\n  HostName 127.0.0.1\n  Port {p}\n" for h, p in self.ports.items())
        self.config.write_text(f"{blocks}Host *\n  IdentityFile {self.folder / 'key'}\n{DEFAULTS}")
        deadline = time.time() + 10
        while subprocess.run(["ssh", "-F", str(self.config), host, "true"], capture_output=True).returncode:
            if time.time() > deadline:
                raise RuntimeError(f"sshd for {host} did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        for server in self.servers:
            server.terminate()
            server.wait()


def start(folder: Path) -> Nodes:
    """The keys and an ssh config with no host yet (`Nodes.add` serves one)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("key", "hostkey"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    return Nodes(folder=folder, config=folder / "ssh_config", servers=[], ports={})
