"""CI reads a page's program's run from the book build that has just executed it (tests/support.py): only a build
of the same program is read, and what it printed is every stream output of the cell that launched it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import support

ROOT = Path(__file__).resolve().parents[1]


def _executed_page(folder: Path, program: str, printed: list[str]) -> None:
    cells = [
        {"cell_type": "markdown", "source": ["# a page"]},
        {"cell_type": "code", "source": [f"%%writefile ddp_minimal.py\n{program}"], "outputs": []},
        {"cell_type": "code", "source": ['launch.torchrun("ddp_minimal.py", nproc=2, launcher=("--tee", "3"));'],
         "outputs": [{"output_type": "stream", "name": "stdout", "text": [line]} for line in printed]},
    ]  # fmt: skip
    (folder / "0123abcd").mkdir(parents=True)
    (folder / "0123abcd" / "base.ipynb").write_text(json.dumps({"cells": cells}))


def test_the_build_run_of_the_same_program_is_read_and_another_program_is_run_here(tmp_path, monkeypatch):
    program = re.search(r"%%writefile ddp_minimal.py\n(.*?)\n```", (ROOT / "book" / "ddp.md").read_text(), re.S)[1]
    built = tmp_path / "executed"
    _executed_page(built, program, ["rank 0/2 epoch 0: 64 samples\n", "rank 1/2 epoch 0: 64 samples\n"])
    monkeypatch.setenv(support.BUILT_PAGES, str(built))
    done = support.run_page_program("ddp.md", "ddp_minimal.py", tmp_path)
    assert done.returncode == 0
    assert done.stdout == "rank 0/2 epoch 0: 64 samples\nrank 1/2 epoch 0: 64 samples\n"
    assert (tmp_path / "ddp_minimal.py").read_text() == program  # the test still gets the file it may read
    assert support._run_by_the_build("ddp.md", "ddp_minimal.py", program + "\nprint('changed')") is None
    monkeypatch.delenv(support.BUILT_PAGES)
    assert support._run_by_the_build("ddp.md", "ddp_minimal.py", program) is None
