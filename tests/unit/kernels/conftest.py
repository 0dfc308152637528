"""The C++ kernels on every code path this CPU can run (pipeline/kernels/cpp.py): the native build, and the paths other
CPUs take forced here (16 and 8 lanes, one at a time), each summing and rounding in its own order."""

from __future__ import annotations

import pytest

from pipeline.kernels import cpp


@pytest.fixture(scope="session", params=cpp.runnable())
def compiled(request):
    """The kernels compiled for one path (each built once per environment, into a folder of its own)."""
    kernels = cpp.load(request.param)
    assert kernels is not None, f"pipeline/kernels/csrc/kernels.cpp must build for the {request.param} path with gcc"
    return kernels
