"""distlab's supported range (Python 3.11+, torch 2.10+, which Kaggle's image meets): below it, importing
distlab, or running one of its commands, says so in one line and exits non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distlab import OLDEST_PYTHON, OLDEST_TORCH, unsupported

SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_range_includes_kaggle_and_this_machine():
    import torch

    assert OLDEST_PYTHON <= (3, 12) and OLDEST_TORCH <= (2, 10)
    assert unsupported((3, 12, 1), "2.10.0+cu128") is None
    assert unsupported(sys.version_info, torch.__version__) is None
    assert "Python 3.11 or newer, this is Python 3.10.13" in unsupported((3, 10, 13), "2.10.0")
    assert "torch 2.10 or newer, this is torch 2.9.1+cpu" in unsupported((3, 12, 0), "2.9.1+cpu")
    assert "torch is not installed" in unsupported((3, 12, 0), None)


@pytest.mark.parametrize("command", [["-c", "import distlab"], ["-m", "distlab.train", "--help"]])
def test_an_old_torch_is_refused_in_one_line(tmp_path: Path, command: list[str]):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('__version__ = "2.4.1+cu121"\n')
    (tmp_path / "torch-2.4.1+cu121.dist-info").mkdir()
    (tmp_path / "torch-2.4.1+cu121.dist-info" / "METADATA").write_text("Name: torch\nVersion: 2.4.1+cu121\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{SRC}"}
    job = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=60)
    assert job.returncode != 0 and job.stdout == ""
    assert (
        job.stderr == "distlab: error: distlab needs torch 2.10 or newer, this is torch 2.4.1+cu121: "
        "pip install 'torch>=2.10'\n"
    )
