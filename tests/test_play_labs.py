"""One command plays the labs and keeps what they printed and drew (scripts/play_labs.py);
the book shows a lab's committed played copy, labelled with the GPUs, the date and the commit, and every other lab
unrun. Played here on the CPU through the command; the book's side on fixture folders, through the Sphinx hooks
and one small Sphinx build of a lab page."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from distlab.measure import hardware
from support import site_extension

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "play_labs.py"
_spec = importlib.util.spec_from_file_location("distlab_play_labs", SCRIPT)
play = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(play)
BOOK_LABS = ROOT / "book" / "results" / "labs"
LAB_NAMES = sorted(lab.stem for lab in (ROOT / "notebooks").glob("lab*.ipynb"))
CHEAPEST = "lab_ring_allreduce"  # about a minute on two CPU cores
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def _cpu_only() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow
def test_the_command_plays_a_lab_on_the_cpu_keeping_its_outputs_without_machine_paths(tmp_path: Path):
    pytest.importorskip("nbclient")
    out = tmp_path / "played"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--lab", CHEAPEST, "--offline-data"]
    job = subprocess.run(command, capture_output=True, text=True, timeout=900, env=_cpu_only(), cwd=tmp_path)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    (folder,) = out.iterdir()
    assert folder.name.startswith("cpu-") and [p.name for p in folder.iterdir()] == [f"{CHEAPEST}.ipynb"]
    assert f"1 of 1 labs played into {folder}" in job.stdout
    path = folder / f"{CHEAPEST}.ipynb"
    assert play.problems(path, CHEAPEST) == []
    notebook = play.read(path)
    lab = play.read(ROOT / "notebooks" / f"{CHEAPEST}.ipynb")
    assert play.same_cells(notebook, lab), "the played copy is the lab, cell for cell"
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert all(cell["execution_count"] for cell in code) and sum(bool(cell["outputs"]) for cell in code) >= 6
    assert any("image/png" in o.get("data", {}) for cell in code for o in cell["outputs"]), "the plots are kept"
    first = "".join("".join(o.get("text", [])) for o in code[0]["outputs"])  # a list of lines, or one string
    assert first.startswith(hardware.describe({"gpus": []})), "the first output says where it ran"
    meta = play.provenance(notebook)
    from distlab.results import environment

    env = environment()
    assert meta["gpus"] == [] and meta["gpu_count"] == 0 and meta["lab"] == CHEAPEST
    assert meta["commit"] == env["git_commit"] and meta["torch"] == env["torch"]
    assert folder.name.startswith(f"cpu-{meta['date'][:10].replace('-', '')}-")
    assert "--offline-data" in meta["data"] and meta["seconds"] > 0
    text = play.output_text(notebook)
    assert "wrote results/lab-ring.json" in text and "busbw" in text
    for leak in (str(tmp_path), "/tmp/", str(ROOT), str(Path.home()) + "/", socket.gethostname()):
        assert leak not in text, leak
    assert "checkout" not in meta, "the metadata names no folder of this machine"
    commit = f"commit {meta['commit']}" if meta["commit"] else "an unknown commit"  # a wheel knows no commit
    cores = f"a {os.cpu_count()}-core CPU (no GPU; the lab's ranks are gloo processes sharing it)"
    assert meta["cpu_count"] == os.cpu_count()
    assert play.label(meta) == f"Played on {cores} on {meta['date'][:10]} at {commit}"


def test_the_command_keeps_a_cpu_play_out_of_the_books_gpu_runs():
    before = sorted(BOOK_LABS.rglob("*")) if BOOK_LABS.exists() else None
    job = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(BOOK_LABS)], capture_output=True, text=True, env=_cpu_only()
    )
    assert job.returncode == 2 and "no CUDA GPU here" in job.stderr and "play into another folder" in job.stderr
    assert "--cpu-stand-in" in job.stderr
    assert (sorted(BOOK_LABS.rglob("*")) if BOOK_LABS.exists() else None) == before


def test_scrub_takes_out_folders_hosts_and_machine_paths_but_leaves_pictures():
    host = "gpu-node-17.example.org"
    notebook = {
        "cells": [
            {"cell_type": "markdown", "source": "see /home/someone/ (the lab's own text stays)"},
            {
                "cell_type": "code",
                "outputs": [
                    {"output_type": "stream", "text": ["wrote /scratch/x/lab/results/a.json\n", f"on {host}\n"]},
                    {"output_type": "display_data", "data": {"text/plain": "/home/me/.venv/lib", "image/png": "/tmp/"}},
                    {"output_type": "error", "evalue": "/root/x failed", "traceback": ["in /Users/me/a.py"]},
                ],
            },
        ]
    }
    scrubbed = play.scrub(copy.deepcopy(notebook), {"/scratch/x/lab": ".", "/scratch/x": "<scratch>"}, [host])
    outputs = scrubbed["cells"][1]["outputs"]
    assert outputs[0]["text"] == ["wrote ./results/a.json\n", "on <host>\n"]
    assert outputs[1]["data"] == {"text/plain": "<path>", "image/png": "/tmp/"}
    assert outputs[2]["evalue"] == "<path> failed" and outputs[2]["traceback"] == ["in <path>"]
    assert scrubbed["cells"][0] == notebook["cells"][0]
    assert not play.MACHINE_PATH.search(play.output_text(scrubbed))


def fake_played(lab: str, folder: Path, *, gpus=("Tesla T4", "Tesla T4"), date="2026-05-01T10:00:00+00:00",
                commit="abc123def456", **broken) -> Path:  # fmt: skip
    """The lab as scripts/play_labs.py writes it, with made-up outputs; ``broken`` spoils one thing."""
    notebook = play.read(ROOT / "notebooks" / f"{lab}.ipynb")
    for count, cell in enumerate((c for c in notebook["cells"] if c["cell_type"] == "code"), start=1):
        cell["execution_count"] = count
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": [f"cell {count} ran\n"]}]
    first = next(c for c in notebook["cells"] if c["cell_type"] == "code")
    first["outputs"][0]["text"] = [hardware.describe({"gpus": list(gpus)}) + "\n"]
    first["outputs"].append({"output_type": "display_data", "data": {"image/png": PNG, "text/plain": "<Figure>"},
                             "metadata": {}})  # fmt: skip
    meta = {"schema": play.SCHEMA, "lab": lab, "gpus": list(gpus), "gpu_count": len(gpus), "date": date,
            "commit": commit, "torch": "2.10.0+cu128", "cuda": "12.8", "data": "MNIST as the lab loads it"}  # fmt: skip
    notebook["metadata"][play.KEY] = meta
    last = notebook["cells"][-1] if notebook["cells"][-1]["cell_type"] == "code" else first
    if broken.get("error"):
        last["outputs"].append({"output_type": "error", "ename": "E", "evalue": "x", "traceback": []})
    if broken.get("unrun"):
        last["execution_count"] = None
    if broken.get("path"):
        last["outputs"][0]["text"].append("wrote /home/someone/results/x.json\n")
    if broken.get("unnamed"):
        first["outputs"][0]["text"] = ["set up\n"]
    if broken.get("no_metadata"):
        del notebook["metadata"][play.KEY]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{lab}{broken.get('suffix', '')}.ipynb"
    path.write_text(json.dumps(notebook, indent=1))
    return path


def test_the_book_chooses_the_newest_valid_played_copy_and_refuses_a_broken_one(tmp_path: Path):
    root, lab = tmp_path / "labs", "lab0_first_run"
    assert play.choose(root, lab) is None, "nothing committed: the lab stays unrun"
    old = fake_played(lab, root / "2x-tesla-t4-a", date="2026-04-01T09:00:00+00:00")
    assert play.choose(root, lab) == old and play.choose(root, "lab_fsdp") is None
    new = fake_played(lab, root / "1x-nvidia-h200-b", gpus=["NVIDIA H200"], date="2026-05-02T09:00:00+00:00")
    assert play.choose(root, lab) == new
    why = {
        "error": "a cell failed",
        "unrun": "code cells never ran",
        "path": "a machine path in an output, '/home/someone/results/x.json'",
        "unnamed": "the first output does not name ['Tesla T4']",
        "no_metadata": "no distlab_played metadata",
    }
    for number, (spoilt, reason) in enumerate(why.items()):
        bad = fake_played(lab, root / f"z-{spoilt}", date=f"2026-06-0{number + 1}T00:00:00+00:00", **{spoilt: True})
        assert any(reason in line for line in play.problems(bad, lab)), (spoilt, play.problems(bad, lab))
        assert play.choose(root, lab) == new, f"a copy with {spoilt} is never shown"
    failed = fake_played(lab, root / "z-failed", date="2026-07-01T00:00:00+00:00", suffix=".failed")
    assert play.problems(failed, lab) == [] and play.choose(root, lab) == new, "a .failed copy is never shown"
    assert set(play.invalid(root)) == {root / f"z-{spoilt}" / f"{lab}.ipynb" for spoilt in why} | {failed}
    elsewhere = fake_played("lab_fsdp", root / "z-renamed")
    (elsewhere.parent / f"{lab}.ipynb").write_bytes(elsewhere.read_bytes())
    assert play.problems(elsewhere.parent / f"{lab}.ipynb", lab) == [
        f"{lab}.ipynb: a played copy of 'lab_fsdp', not of '{lab}'"
    ]
    stand_in = fake_played(lab, root / "cpu-later", gpus=(), date="2026-08-01T00:00:00+00:00")
    assert play.problems(stand_in, lab) == [] and play.choose(root, lab) == new, "a GPU play before a newer CPU one"
    assert play.choose(root, "lab_pinned_memory") is None
    cpu_only = fake_played("lab_pinned_memory", root / "cpu-later", gpus=(), date="2026-08-01T00:00:00+00:00")
    assert play.choose(root, "lab_pinned_memory") == cpu_only, "a CPU play stands in while no GPU play exists"
    cpu = play.provenance(play.read(cpu_only)) | {"cpu_count": 2}
    assert play.label(cpu).startswith("Played on a 2-core CPU (no GPU; the lab's ranks are gloo processes sharing it)")
    meta = play.provenance(play.read(new))
    assert play.label(meta) == "Played on 1 x NVIDIA H200 on 2026-05-02 at commit abc123def456"
    two = play.provenance(play.read(old)) | {"commit": None}
    assert play.label(two) == "Played on 2 x Tesla T4 on 2026-04-01 at an unknown commit"


class _Env:
    def __init__(self, srcdir: Path, docnames: list[str]):
        self.srcdir, self.found_docs, self.dependencies = srcdir, set(docnames), []

    def doc2path(self, docname: str) -> str:
        return str(self.srcdir / f"{docname}.ipynb")

    def note_dependency(self, path: str) -> None:
        self.dependencies.append(path)


def test_a_lab_page_shows_its_played_copy_with_its_label_instead_of_the_unrun_note(tmp_path: Path):
    """The Sphinx side, hook by hook: source-read swaps the played copy in, html-page-context (after the site's
    own extension put the "shown unrun" note on every lab page) puts the label in its place, and a lab whose
    chosen copy changed is read again."""
    site = site_extension()
    book = tmp_path / "book"
    env = _Env(book, ["labs/lab0_first_run", "labs/lab_fsdp", "running"])
    app = SimpleNamespace(srcdir=str(book), config=SimpleNamespace(distlab_played_labs="results/labs"), env=env)
    played = fake_played("lab0_first_run", book / "results" / "labs" / "2x-tesla-t4-x")
    for docname in sorted(env.found_docs):
        lab = (ROOT / "notebooks" / f"{docname.split('/')[-1]}.ipynb").read_text() if "labs/" in docname else "# x"
        source = [lab]
        play._swap_in_played_copy(app, docname, source)
        expected = played.read_text() if docname == "labs/lab0_first_run" else lab
        assert source == [expected], docname
    assert env.dependencies == [str(played)]
    assert env.distlab_played["labs/lab_fsdp"] is None and env.distlab_played["labs/lab0_first_run"]["changed"] is False
    kaggle = '<p class="distlab-kaggle"><a href="https://kaggle.com/kernels/welcome?src=x">Open in Kaggle</a></p>\n'
    pages = {}
    for docname in ("labs/lab0_first_run", "labs/lab_fsdp"):
        context = {"body": kaggle + site.UNRUN_LAB + "<section>the lab</section>"}
        play._label_played_page(app, docname, "page.html", context, None)
        pages[docname] = context["body"]
    label = "Played on 2 x Tesla T4 on 2026-05-01 at commit abc123def456"
    assert pages["labs/lab_fsdp"] == kaggle + site.UNRUN_LAB + "<section>the lab</section>"
    shown = pages["labs/lab0_first_run"]
    assert shown.startswith(kaggle) and shown.endswith("<section>the lab</section>") and "shown unrun" not in shown
    assert f'<p class="admonition-title">{label}</p>' in shown and "torch 2.10.0+cu128, CUDA 12.8" in shown
    assert "changed since" not in shown
    assert play._outdated(app, env, set(), set(), set()) == []
    newer = fake_played("lab_fsdp", book / "results" / "labs" / "1x-h200-y", gpus=["NVIDIA H200"])
    assert play._outdated(app, env, set(), set(), set()) == ["labs/lab_fsdp"]
    notebook = play.read(newer)
    notebook["cells"][0]["source"] = ["# an older version of the lab\n"]
    newer.write_text(json.dumps(notebook))
    source = [(ROOT / "notebooks" / "lab_fsdp.ipynb").read_text()]
    play._swap_in_played_copy(app, "labs/lab_fsdp", source)
    context = {"body": "<section>the lab</section>"}  # no unrun note (the site's extension absent): label on top
    play._label_played_page(app, "labs/lab_fsdp", "page.html", context, None)
    assert context["body"].startswith('<div class="admonition note distlab-played">')
    assert "Played on 1 x NVIDIA H200" in context["body"] and "The lab has changed since this run" in context["body"]


def test_a_sphinx_build_renders_the_played_copy_of_a_lab_with_its_outputs(tmp_path: Path):
    """A small book as the real one is set up (myst-nb, the labs excluded from execution, the site's extension
    and this one): the lab with a played copy shows its outputs and label, the other stays unrun."""
    pytest.importorskip("myst_nb")
    from sphinx.application import Sphinx

    book = tmp_path / "book"
    (book / "labs").mkdir(parents=True)
    for lab in ("lab0_first_run", "lab_fsdp"):
        (book / "labs" / f"{lab}.ipynb").write_text((ROOT / "notebooks" / f"{lab}.ipynb").read_text())
    (book / "index.md").write_text("# Book\n\n```{toctree}\nlabs/lab0_first_run\nlabs/lab_fsdp\n```\n")
    fake_played("lab0_first_run", book / "results" / "labs" / "2x-tesla-t4-x")
    (book / "conf.py").write_text(
        f"import sys\nsys.path[:0] = [{str(ROOT / 'book' / '_ext')!r}, {str(ROOT / 'scripts')!r}]\n"
        "extensions = ['myst_nb', 'distlab_site', 'play_labs']\n"
        "exclude_patterns = ['_build', 'results/**']\nnb_execution_mode = 'cache'\n"
        "nb_execution_excludepatterns = ['labs/*.ipynb']\nhtml_theme = 'basic'\n"
        "suppress_warnings = ['myst.xref_missing']\n"  # the labs link chapters this small book does not have
    )
    out, warnings = tmp_path / "html", tmp_path / "warnings.txt"
    with warnings.open("w") as stream:
        app = Sphinx(str(book), str(book), str(out), str(tmp_path / "doctrees"), "html", status=None, warning=stream)
        app.build()
    assert warnings.read_text() == ""
    played = (out / "labs" / "lab0_first_run.html").read_text()
    unrun = (out / "labs" / "lab_fsdp.html").read_text()
    assert "Played on 2 x Tesla T4 on 2026-05-01 at commit abc123def456" in played and "shown unrun" not in played
    assert "2 x Tesla T4: the hardware this lab is written for." in played and "cell 3 ran" in played
    assert played.count('class="cell_output') >= 5 and "<img" in played
    assert "This lab is shown unrun" in unrun and "Played on" not in unrun and 'class="cell_output' not in unrun


def test_the_book_config_runs_the_extension_and_still_leaves_the_labs_unexecuted():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["sphinx"]["local_extensions"]["play_labs"] == "scripts", "scripts/play_labs.py's setup()"
    assert config["execute"]["exclude_patterns"] == ["labs/*.ipynb"], "a played copy is shown, never re-run"


def test_every_committed_played_lab_is_one_the_book_shows_as_what_it_is():
    """What is under book/results/labs/ is shown: nothing there the book refuses, every copy a lab of the course; a
    CPU play only as a stand-in for a lab no GPU has played, labelled with its cores and its data."""
    if not BOOK_LABS.is_dir():
        pytest.skip("no played lab is committed: every lab page shows its lab unrun")
    assert play.invalid(BOOK_LABS) == {}, "fix or remove them: the book would not show them"
    copies = sorted(BOOK_LABS.glob("*/*.ipynb"))
    assert copies, "book/results/labs/ holds no played lab"
    for path in copies:
        meta = play.provenance(play.read(path))
        assert meta["lab"] in LAB_NAMES and path.stem == meta["lab"], path
        if meta["gpu_count"] == 0:
            assert (
                play.choose(BOOK_LABS, meta["lab"]) == path
                or play.provenance(play.read(play.choose(BOOK_LABS, meta["lab"])))["gpu_count"] > 0
            ), path
            assert meta.get("cpu_count") and "-core CPU (no GPU" in play.label(meta), path
