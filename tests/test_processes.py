"""Child-process plumbing: stale DeepSpeed shared-memory files are removed, live ones kept."""

from __future__ import annotations

import os
import socket

from pipeline.processes import SHM, free_port, remove_stale_shm_buffers


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
