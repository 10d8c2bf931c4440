"""What several test files set up alike, written once: the book's Sphinx extension loaded as a module, a bare
Jupyter kernel that runs a lab as Kaggle does (its own Python, which cannot import distlab until the lab installs
the wheel), a page's own program run on two gloo ranks, and the committed H200 copies the pinned chapter reads.
Tests import it as ``support`` (pytest puts this folder on the path)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_INDEX = "http://127.0.0.1:9/simple"
"""A package index nothing answers at: a lab that reached for an index instead of its wheel fails."""


def site_extension():
    """The book's extension (``book/_ext/distlab_site.py``), loaded from its file; skipped where Sphinx is absent."""
    pytest.importorskip("sphinx", reason="the book's extensions need Sphinx, which the book's stack has")
    spec = importlib.util.spec_from_file_location("distlab_site", ROOT / "book" / "_ext" / "distlab_site.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    return site


def python_without_distlab(tmp_path: Path) -> Path:
    """A Python whose kernel cannot import distlab but has everything else this one has (torch, ipykernel,
    pip). A fresh venv, no pip of its own, reads a view of this environment's site-packages: a folder of
    symlinks to every entry except distlab's (the editable install's .pth and finder, its dist-info). The view
    goes on sys.path through a .pth line naming it, so .pth files inside it are never run, and pip, seeing no
    distlab installed, installs into the venv's own site-packages. torch is shared, never reinstalled, and the
    environment the tests run in is not touched."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([python, "-c", query], text=True).strip())
    view = tmp_path / "site-view"
    view.mkdir()
    for source in {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}:
        for entry in source.iterdir():
            if not entry.name.startswith(("distlab", "__editable__")) and entry.suffix != ".pth":
                if not (view / entry.name).exists():
                    (view / entry.name).symlink_to(entry)
    (site / "site-view.pth").write_text(f"{view}\n")
    return python


def bare_kaggle_kernel(tmp_path: Path, monkeypatch, python: Path, name: str, display_name: str) -> str:
    """A Jupyter kernel ``name`` on ``python`` (:func:`python_without_distlab`), found through ``JUPYTER_PATH``, in an
    environment like a fresh Kaggle session's: no package index (the wheel must do), and none of this machine's
    distlab or NCCL settings. Returns the kernel's name, for ``nbclient.NotebookClient(kernel_name=...)``."""
    kernels = tmp_path / "jupyter" / "kernels" / name
    kernels.mkdir(parents=True)
    spec = {"argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"], "language": "python"}
    (kernels / "kernel.json").write_text(json.dumps({**spec, "display_name": display_name}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("PIP_INDEX_URL", NO_INDEX)
    for variable in ("PYTHONPATH", "DISTLAB_SOURCE", "NCCL_P2P_DISABLE", "NCCL_CUMEM_HOST_ENABLE"):
        monkeypatch.delenv(variable, raising=False)
    return name


BUILT_PAGES = "DISTLAB_BUILT_PAGES"
"""Where CI's book build keeps the pages it executed, as it executed them (``_build/.jupyter_cache/executed``: one
folder a page; the copies in ``_build/jupyter_execute`` have their streams merged for the site), set by ``.ci/run``
once the book is built: a page's program that the build ran is read from there instead of being launched again."""


def run_page_program(
    page: str, filename: str, tmp_path: Path, ranks: int = 2, files_needed: bool = False
) -> subprocess.CompletedProcess:
    """The program a book page writes with ``%%writefile <filename>``, run as the page runs it: torchrun on
    ``ranks`` gloo ranks of this CPU, in ``tmp_path``. Its exit status is asserted; the finished job is returned.

    Where ``DISTLAB_BUILT_PAGES`` names the executed pages of a book build of this same page (CI builds the book
    before this tier), the job is the build's own run of the same program, read from the cell that launched it: the
    build stops on a job that fails, so a page that built ran its program to a zero exit. ``files_needed``: the test
    reads what the program writes into ``tmp_path``, so it always runs here."""
    import re

    text = (ROOT / "book" / page).read_text()
    program = re.search(rf"%%writefile {re.escape(filename)}\n(.*?)\n```", text, re.S).group(1)
    (tmp_path / filename).write_text(program)
    built = None if files_needed else _run_by_the_build(page, filename, program)
    if built is not None:
        return built
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", filename]
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _run_by_the_build(page: str, filename: str, program: str) -> subprocess.CompletedProcess | None:
    """What the book build's run of ``filename`` printed, from the executed page that wrote this same program (None
    where there is no build to read, or no executed page wrote it: then the test runs it). Its stdout is what the
    launching cell printed."""
    import os

    folder = os.environ.get(BUILT_PAGES)
    if not folder:
        return None
    for executed in sorted(Path(folder).glob("*/base.ipynb")):
        code = [cell for cell in json.loads(executed.read_text())["cells"] if cell["cell_type"] == "code"]
        source = ["".join(cell["source"]) for cell in code]
        written = [i for i, s in enumerate(source) if s == f"%%writefile {filename}\n{program}"]
        if not written:
            continue
        launched = next(
            i for i in range(written[0] + 1, len(code)) if "torchrun(" in source[i] and filename in source[i]
        )
        printed = "".join("".join(out["text"]) for out in code[launched]["outputs"] if out["output_type"] == "stream")
        return subprocess.CompletedProcess([f"{page}: the book build's run of {filename}"], 0, printed, "")
    return None


def committed_h200_copies_and_host() -> tuple[dict, dict]:
    """The committed H200 report's copies and the same machine's host benchmark, as the pinned chapter reads them."""
    from distlab.gpu_report import schema
    from distlab.results import committed_results, read_result

    for report in schema.read_reports(committed_results("gpu")):
        files = [report["folder"] / name for part in report["parts"] for name in part["files"]]
        by_kind = {(r := read_result(path))["kind"]: r for path in files}
        if "transfer" in by_kind and "H200" in by_kind["transfer"]["metrics"]["ranks"][0]["gpu"]:
            return by_kind["transfer"], by_kind["host"]
    pytest.fail("no committed H200 transfer result")
