"""The environment a subprocess gets (pipeline/core/environment.py): this interpreter's bin folder first on PATH,
once, however often it is asked for (a rank server's key is the environment: one launch, one key)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.core.environment import with_venv_path


def test_the_venv_bin_folder_is_first_on_path_once():
    venv_bin = str(Path(sys.executable).parent)
    bare = {"PATH": os.pathsep.join(["/usr/bin", "/bin"])}
    once = with_venv_path(bare)
    assert once["PATH"] == os.pathsep.join([venv_bin, "/usr/bin", "/bin"]) and bare["PATH"] == "/usr/bin:/bin"
    assert with_venv_path(once) == once
    later = {"PATH": os.pathsep.join(["/usr/bin", venv_bin])}  # elsewhere on PATH: put first, the rest kept
    assert with_venv_path(later)["PATH"] == os.pathsep.join([venv_bin, "/usr/bin", venv_bin])
    assert with_venv_path({})["PATH"] == venv_bin  # no empty entry: that would be the working folder
