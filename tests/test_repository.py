"""The repository keeps its promises: CI runs the README's commands, and
every committed result carries its provenance."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in ("pip install -r requirements.txt && python -m pytest", "pip install -r requirements.txt && jupyter-book build book"):
        assert command in readme
        assert command in ci_lines


def test_book_toc_and_labs_are_wired():
    assert (ROOT / "book" / "_toc.yml").resolve() == (ROOT / "_toc.yml").resolve()
    assert (ROOT / "book" / "labs").resolve() == (ROOT / "notebooks").resolve()


def test_committed_results_carry_their_environment():
    for path in sorted((ROOT / "book" / "results").rglob("*.json")):
        env = json.loads(path.read_text())["environment"]
        for key in ("torch", "backend", "world_size", "date", "command"):
            assert key in env, f"{path} lacks environment[{key!r}]"


def test_nothing_the_book_reads_is_git_ignored():
    """A clean checkout must hold every file the chapters read (CI builds from one)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    book_files = [str(p.relative_to(ROOT)) for p in (ROOT / "book").rglob("*")
                  if p.is_file() and "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *book_files], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
    assert not ignored, f"git ignores files the book needs: {ignored}"
