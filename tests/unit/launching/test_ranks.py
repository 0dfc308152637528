"""Child-process plumbing: stale DeepSpeed shared-memory files are removed, live ones kept; ranks started ahead of
their launch run only once released, and end when the stage cancels them or dies first, or one of them dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pipeline.core.environment import free_port
from pipeline.launching.ops import SHM, remove_stale_shm_buffers
from pipeline.launching.ranks import Ranks
from tests.conftest import REPO


def test_only_the_buffers_of_finished_launches_are_removed():
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        live_port, done_port = live.getsockname()[1], free_port()
        names = [f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0" for port in (live_port, done_port)]
        for name in names:
            (SHM / name).write_bytes(b"x")
        try:
            removed = remove_stale_shm_buffers()
            assert SHM / names[1] in removed and not (SHM / names[1]).exists()
            assert (SHM / names[0]).exists(), "a launch still running keeps its buffers"
        finally:
            for name in names:
                (SHM / name).unlink(missing_ok=True)


# A rank: says it waits, then reports what `released` gave it (a rank the stage gives up on exits inside it).
RANK = """
import json, os, sys
from pathlib import Path
from pipeline.launching.ranks import released
out = Path(sys.argv[1]) / os.environ["RANK"]
out.with_suffix(".waiting").touch()
message = released()
out.with_suffix(".json").write_text(json.dumps({"message": message, "argv": sys.argv[2:],
    **{k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}}))
"""

# A stage that starts two ranks, waits until they wait, and dies without a word (SIGKILL: no finally, no cancel).
STAGE = """
import os, signal, sys, time
from pathlib import Path
from pipeline.core.environment import free_port
from pipeline.launching.ranks import Ranks
folder = Path(sys.argv[1])
ranks = Ranks([sys.executable, "-c", sys.argv[2], str(folder)], ranks=2, env=dict(os.environ),
              master_addr="127.0.0.1", master_port=free_port())
(folder / "pids").write_text(" ".join(str(child.pid) for child in ranks.children))
while len(list(folder.glob("*.waiting"))) < 2:
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _rank_environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_released_ranks_get_the_message_and_launcher_environment(tmp_path):
    ranks = Ranks([sys.executable, "-c", RANK, str(tmp_path)], ranks=2, env=_rank_environment(),
                  master_addr="127.0.0.1", master_port=29577)  # fmt: skip
    ranks.release({"resume_universal": "/some/checkpoint"})
    assert ranks.wait() == 0
    for rank in ("0", "1"):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen == {"message": {"resume_universal": "/some/checkpoint"}, "argv": [f"--local_rank={rank}"],
                        "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "MASTER_PORT": "29577"}  # fmt: skip


def test_cancelled_ranks_end_without_running(tmp_path):
    ranks = Ranks([sys.executable, "-c", RANK, str(tmp_path)], ranks=2, env=_rank_environment(),
                  master_addr="127.0.0.1", master_port=free_port())  # fmt: skip
    _wait_until_waiting(tmp_path)  # as when the stage's checks fail: the ranks have imported and wait
    ranks.cancel()
    assert all(child.returncode is not None for child in ranks.children)
    assert not list(tmp_path.glob("*.json"))


def test_ranks_of_a_stage_that_dies_before_releasing_them_exit_without_running(tmp_path):
    stage = subprocess.run(
        [sys.executable, "-c", STAGE, str(tmp_path), RANK],
        env=_rank_environment(),
        timeout=120,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # the ranks would hold a pipe open
    assert stage.returncode == -signal.SIGKILL
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids), "ranks left waiting by a dead stage"
    assert len(list(tmp_path.glob("*.waiting"))) == 2 and not list(tmp_path.glob("*.json"))


def _wait_until_waiting(folder: Path) -> None:
    deadline = time.monotonic() + 60
    while len(list(folder.glob("*.waiting"))) < 2:
        assert time.monotonic() < deadline, "the ranks never reached released()"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopts it, maybe never here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_rank_that_died_before_its_release_ends_the_launch_with_its_exit_code(tmp_path):
    """A rank killed while it imports (out of memory, say): releasing the others does not fail on its closed pipe,
    the launch ends with its exit code, and the rank that was released is ended, not left waiting for it."""
    ranks = Ranks([sys.executable, "-c", RANK + "\nimport time; time.sleep(600)", str(tmp_path)], ranks=2,
                  env=_rank_environment(), master_addr="127.0.0.1", master_port=free_port())  # fmt: skip
    _wait_until_waiting(tmp_path)
    os.kill(ranks.children[1].pid, signal.SIGKILL)
    ranks.children[1].wait()
    ranks.release({})
    assert ranks.wait() == -signal.SIGKILL
    assert ranks.children[0].returncode == -signal.SIGTERM
