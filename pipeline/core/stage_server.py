"""Stages forked from an interpreter that has already imported what the model stages import (torch, safetensors,
transformers' LLaMA, PEFT: about 4-5 s of CPU a stage), for pipelines run again and again on one machine: the test
suite's. Off unless `PIPELINE_STAGE_SERVERS` names a folder (tests/conftest.py sets it); the servers themselves:
`forking.py`.

`python -m stages.NAME ARGS` of a served stage (stages/__init__.py names them) hands itself over before NAME is
imported: its arguments, environment, folder, process group and standard streams go to the server of its key (the
interpreter, the environment but for what the imports never read, the session, the contents of `pipeline/` and
`stages/`), which forks a process that runs the stage as `python -m` would, from the request's folder (nothing of
ours stays imported from the server's); this process waits, passes on the signals it gets, and exits as the stage
did. The server imports as a stage that needs no bitsandbytes or scipy does (`imports.without_unused`): a stage that
needs them finds them hidden and starts itself fresh again (`start_fresh`), before it has done anything."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

from pipeline.core import forking

FOLDER = "PIPELINE_STAGE_SERVERS"  # where servers listen (one socket per key); unset: every stage starts fresh
SERVE = "PIPELINE_STAGE_SERVE"  # in a server's environment: the socket it listens on
REQUESTER = "PIPELINE_STAGE_REQUESTER"  # in a forked stage's: the pid of the process DVC started, whose ancestors
# are the stage's (tracking/execution.py finds the pipeline execution among them)
SOURCES = ("pipeline", "stages")  # what a served stage imports from its project's folder
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def key_inputs(env: dict[str, str]) -> dict:
    """What the server's imports depend on."""
    folder = Path.cwd()
    return {"command": [sys.executable, "-m", __name__], "env": forking.key_environment(env, skip=(FOLDER, REQUESTER)),
            "session": os.getsid(0), "python": sys.executable,
            "sources": forking.sources_digest(*(folder / s for s in SOURCES))}  # fmt: skip


def hand_over(served: tuple[str, ...]) -> None:
    """In `python -m MODULE ...` with MODULE one of `served` and a folder of servers named: run MODULE in a process
    forked by its key's server and exit as it does. Returns where it is not served (then the module runs here; the
    second such start of a key also starts its server)."""
    folder, argv = os.environ.get(FOLDER), sys.orig_argv
    if not folder or argv[1:2] != ["-m"] or argv[2:3] == [] or argv[2] not in served:
        return
    inputs = key_inputs(dict(os.environ))
    path = forking.socket_path(folder, inputs)
    env = {**os.environ, REQUESTER: str(os.getpid())}
    message = {"argv": argv[1:], "env": env, "pgid": os.getpgrp(), "cwd": os.getcwd()}
    try:
        forked = forking.request(path, message, [0, 1, 2])
    except (OSError, RuntimeError) as failed:  # a server that stopped answering: nothing of it runs on
        print(f"stage server {path}: {failed}; the stage starts fresh", file=sys.stderr)
        return
    if forked is None:
        with contextlib.suppress(OSError):  # a full disk: fresh, as without servers
            forking.start_server(path, command=inputs["command"], env={**inputs["env"], SERVE: str(path)},
                                 inputs=inputs, cwd=Path.cwd())  # fmt: skip
        return
    for signum in RELAYED:
        signal.signal(signum, lambda received, _frame: forked.send_signal(received))
    code = forked.wait()
    if code < 0:  # ended by a signal: so is this process
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set (nor needs to be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # as a shell reports it, where the signal did not end this process
    os._exit(code)


def start_fresh() -> None:
    """In a forked stage whose run needs what the server's imports hid: this process again as a fresh interpreter
    (the same pid, arguments, environment and streams; a forked stage's names no server)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def serve() -> None:
    """The server: a stage's imports, then a forked process for each request, which runs the requested module."""
    import runpy

    from pipeline.core import imports

    imports.without_unused()
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (what `import transformers` defers)
    from transformers.models.llama import modeling_llama  # noqa: F401

    server = os.getcwd()
    request, streams = forking.serve(os.environ[SERVE])
    forking.become(request, streams)
    del os.environ[FOLDER]  # this stage runs here; what it starts, fresh
    sys.path[:] = [request["cwd"] if entry == server else entry for entry in sys.path]
    for name in [n for n in sys.modules if n.split(".")[0] in SOURCES]:
        del sys.modules[name]  # imported again from the request's folder, as a fresh stage imports them
    sys.orig_argv[:] = [sys.executable, *request["argv"]]
    if sys.stdout.isatty():
        sys.stdout.reconfigure(line_buffering=True)
    module, *arguments = request["argv"][1:]
    sys.argv = [sys.argv[0], *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    serve()
