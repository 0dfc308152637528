"""The environment a subprocess gets (pipeline/core/environment.py): this interpreter's bin folder first on PATH,
once, however often it is asked for; a rendezvous port no outgoing connection can take. And the set-up's DVC reads
YAML in C."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from pipeline.core.environment import PORTS_FROM, ephemeral_ports, free_port, port_free, with_venv_path

REPO = Path(__file__).resolve().parents[3]


def test_the_venv_bin_folder_is_first_on_path_once():
    venv_bin = str(Path(sys.executable).parent)
    bare = {"PATH": os.pathsep.join(["/usr/bin", "/bin"])}
    once = with_venv_path(bare)
    assert once["PATH"] == os.pathsep.join([venv_bin, "/usr/bin", "/bin"]) and bare["PATH"] == "/usr/bin:/bin"
    assert with_venv_path(once) == once
    later = {"PATH": os.pathsep.join(["/usr/bin", venv_bin])}  # elsewhere on PATH: put first, the rest kept
    assert with_venv_path(later)["PATH"] == os.pathsep.join([venv_bin, "/usr/bin", venv_bin])
    assert with_venv_path({})["PATH"] == venv_bin  # no empty entry: that would be the working folder


def test_dvc_reads_dvc_yaml_and_dvc_lock_with_ruamel_s_c_parser():
    """ruamel.yaml 0.19 made its C parser an extra: without ruamel.yaml.clib (requirements.txt) every dvc command
    parses dvc.yaml and dvc.lock in pure Python, 5x slower. DVC's parse_yaml builds YAML(typ="safe")."""
    from dvc.utils.serialize import parse_yaml
    from ruamel.yaml import YAML
    from ruamel.yaml.main import CParser

    assert CParser is not None and YAML(typ="safe").Parser is CParser, "ruamel.yaml.clib is not installed"
    text = (REPO / "dvc.yaml").read_text(encoding="utf-8")
    assert parse_yaml(text, "dvc.yaml") == YAML(typ="safe", pure=True).load(text), "the C parser reads what Python does"


def test_a_rendezvous_port_is_one_no_outgoing_connection_can_take():
    """Ports of the kernel's ephemeral range go to outgoing connections' local ends; a rendezvous port is drawn below
    it (and free), so that nothing but its rank 0 takes it between the draw and the listen."""
    low, high = ephemeral_ports()
    assert PORTS_FROM + 1024 <= low < high
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        assert low <= client.getsockname()[1] <= high, "a connection's local port comes from the range"
    ports = [free_port() for _ in range(32)]
    assert all(PORTS_FROM <= port < low and port_free(port) for port in ports), ports
    assert len(set(ports)) > 16, "drawn at random: two launches at once do not pick the same port"
