"""Where a lab's ranks run is decided once, by ``distlab.runtime.place``, and every rank is told. The set-up
cells place their ranks with it on 0, 1, 2 and 4 GPUs (never on the CPU while a GPU is idle, never more NCCL
ranks than GPUs); every line of a lab that starts a script or module passes ``--device`` (and ``--backend``
where its target takes it); and the two plain-torch lab scripts, told nothing, never take a GPU that does not
exist, while ranks told to share one GPU through gloo all compute on it. No GPU is needed: the GPU count is
monkeypatched."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import os
import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import distlab.runtime

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LABS = [pytest.param(path, id=path.stem) for path in NOTEBOOKS]
SCRIPTS = {name: ROOT / "scripts" / name for name in ("ddp_train.py", "fsdp_train.py", "profile_ddp.py")}
TOLD = ("--device", "--backend")
"""The flags by which a launcher tells a rank where it runs; a lab passes each one its target takes."""


def _code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


@functools.cache
def _script(name: str):
    """A lab script, imported as a module (its ``main`` does not run): its parser and device choice are
    plain functions, callable without CUDA."""
    spec = importlib.util.spec_from_file_location(f"lab_script_{Path(name).stem}", SCRIPTS[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _help(call) -> str:
    """What ``call`` (a parser, or an entry point that parses first) prints for ``--help``, read from sys.argv."""
    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["lab", "--help"]), contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        call()
    return out.getvalue()


@functools.cache
def _flags_taken(notebook: Path, target: str) -> frozenset[str]:
    """Which of --device/--backend ``target`` takes: a ``.py`` file the notebook writes (a wrapper of a distlab
    entry point, or one of the lab scripts) or a ``distlab`` module."""
    if target.endswith(".py"):
        written = [c for c in _code_cells(notebook) if c.startswith(f"%%writefile {target}\n")]
        assert len(written) == 1, f"{notebook.name} launches {target} but does not write it"
        wrapped = re.search(r"^from (distlab[\w.]*) import main$", written[0], re.M)
        if not wrapped and target not in SCRIPTS and "argparse" not in written[0]:
            return frozenset()  # a plain program that takes no flag (lab 0's copy of the DDP chapter's: gloo, CPU)
        call = importlib.import_module(wrapped.group(1)).main if wrapped else _script(target).parse_args
    else:
        call = importlib.import_module(target).main
    options = set(re.findall(r"^  (?:-\w, )?(--[\w-]+)", _help(call), re.M))
    return frozenset(flag for flag in TOLD if flag in options)


def _python_source(cell: str) -> str:
    """A cell as Python: shell escapes and magics become ``pass`` (at their indentation)."""
    lines = [re.sub(r"^(\s*)[!%].*", r"\1pass", line) for line in cell.splitlines()]
    return "\n".join(lines)


def _launches(notebook: Path) -> list[tuple[str, str, set[str]]]:
    """(what starts it, target, flags it passes with the launcher's own value) for every script or module a
    lab starts: ``!`` lines (``!{TORCHRUN} ... x.py ...``, ``!{sys.executable} -m distlab.x ...``) and
    ``torchrun_command(...)`` calls. A flag counts where its value is the set-up's variable: ``--device
    {DEVICE}``, ``--backend {BACKEND}`` (or ``{BACKEND_1}``, a one-rank run's), or the same in a call."""
    values = {"--device": r"DEVICE", "--backend": r"BACKEND\w*"}
    found = []
    for cell in _code_cells(notebook):
        if cell.startswith("%%"):
            continue
        for line in cell.splitlines():
            words = line.strip()[1:].split() if line.strip().startswith("!") else []
            modules = [b for a, b in zip(words, words[1:]) if a == "-m" and b != "torch.distributed.run"]
            target = next((w for w in words if w.endswith(".py")), modules[0] if modules else None)
            if target:
                passed = {f for f in TOLD if re.search(rf"\s{f} \{{{values[f]}\}}(\s|$)", line)}
                found.append((line.strip(), target, passed))
        for node in ast.walk(ast.parse(_python_source(cell))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "torchrun_command":
                args = node.args
                passed = {
                    a.value
                    for a, b in zip(args, args[1:])
                    if isinstance(a, ast.Constant) and a.value in TOLD and isinstance(b, ast.Name)
                    and re.fullmatch(values[a.value], b.id)
                }  # fmt: skip
                found.append((ast.unparse(node), args[1].value, passed))
    return found


@pytest.mark.parametrize("notebook", LABS)
def test_every_launch_in_a_lab_tells_its_ranks_where_they_run(notebook: Path):
    """A rank told nothing decides again, by rules of its own: the FSDP lab on one GPU then started
    fsdp_train.py without --device, which took cuda:LOCAL_RANK and crashed on rank 1 (invalid device ordinal)."""
    launches = _launches(notebook)
    assert launches, f"{notebook.name} starts nothing? the parser here must have missed its launch lines"
    missing = [
        f"{line}: no {' or '.join(sorted(taken - passed))} {{...}}"
        for line, target, passed in launches
        if (taken := _flags_taken(notebook, target)) - passed
    ]
    assert not missing, f"{notebook.name}:\n" + "\n".join(missing)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    ("gpus", "local_world_size", "expected"),
    [(0, "2", "cpu"), (1, "2", "cpu"), (2, "2", "cuda"), (4, "2", "cuda"), (0, None, "cpu"), (1, None, "cuda")],
)
def test_a_script_told_nothing_takes_the_gpus_only_where_every_rank_has_one(
    script, gpus, local_world_size, expected, monkeypatch
):
    module = _script(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if local_world_size is None:  # a plain `python script.py`: one process
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    monkeypatch.setattr(sys, "argv", [script])
    assert module.parse_args().device == expected


@pytest.mark.parametrize("script", SCRIPTS)
def test_ranks_sharing_one_gpu_through_gloo_all_compute_on_it(script, monkeypatch):
    """Two ranks, one GPU: with gloo, rank 1 computes on cuda:0 (it took cuda:1, which does not exist); with
    NCCL the script refuses in one line that names the fix, before it touches a GPU."""
    module = _script(script)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    shared = module.parse_args(["--device", "cuda", "--backend", "gloo"])
    assert module.device_and_backend(shared) == (torch.device("cuda", 0), "gloo")
    with pytest.raises(SystemExit, match=rf"^{script}: NCCL needs one GPU per rank.*--backend gloo"):
        module.device_and_backend(module.parse_args(["--device", "cuda"]))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert module.device_and_backend(module.parse_args(["--device", "cuda"])) == (torch.device("cuda", 1), "nccl")
    assert module.device_and_backend(module.parse_args(["--device", "cpu"])) == (torch.device("cpu"), "gloo")
    with pytest.raises(SystemExit, match="--backend gloo with --device cpu"):
        module.device_and_backend(module.parse_args(["--device", "cpu", "--backend", "nccl"]))


ONE_PER_GPU = {0: (2, "cpu", "gloo"), 1: (1, "cuda", "nccl"), 2: (2, "cuda", "nccl"), 4: (4, "cuda", "nccl")}
TWO_RANKS = {0: (2, "cpu", "gloo"), 1: (2, "cuda", "gloo"), 2: (2, "cuda", "nccl"), 4: (2, "cuda", "nccl")}
EXPECTED = {
    "lab0_first_run": TWO_RANKS,  # the labs of two ranks: on one GPU, two gloo ranks share it
    "lab_pinned_memory": ONE_PER_GPU,  # each rank measures its own GPU's copies
    "lab_ddp_mnist": TWO_RANKS,
    "lab_fsdp": TWO_RANKS,
    "lab_ring_allreduce": TWO_RANKS,
}
"""(NPROC, DEVICE, BACKEND) a lab's set-up gives on a machine of 0, 1, 2 and 4 GPUs."""


def test_every_lab_has_an_expected_placement():
    assert set(EXPECTED) == {path.stem for path in NOTEBOOKS}


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
@pytest.mark.parametrize("notebook", LABS)
def test_the_setup_places_the_ranks_with_place_for_any_gpu_count(notebook: Path, gpus, tmp_path, monkeypatch, capsys):
    """The code cells up to the one that calls place(...), run as a kernel would, on a machine of ``gpus``
    GPUs: the ranks, device and backend expected, no GPU idle while ranks run on the CPU, no more NCCL ranks
    than GPUs; and it says why in one line, plus one on what differs from Kaggle's two T4s elsewhere."""
    cells = _code_cells(notebook)
    deciding = next((i for i, cell in enumerate(cells) if re.search(r"^P = place\(", cell, re.M)), None)
    assert deciding is not None, f"{notebook.name}: no set-up cell decides with P = place(...)"
    setup = cells[: deciding + 1]
    assert not any(re.search(r"^\s*[!%]", cell, re.M) for cell in setup), "the set-up must be plain Python"
    assert "torch.cuda.device_count" not in "".join(setup), "place() reads the GPU count, nothing else"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(distlab.runtime, "gpu_count", lambda: gpus)
    namespace: dict = {"__name__": "__main__"}
    with mock.patch.dict(os.environ):  # set_nccl_transport may set NCCL variables: not for the other tests
        for cell in setup:
            exec(compile(cell, f"{notebook.stem} set-up", "exec"), namespace)
    said = capsys.readouterr().out.splitlines()
    placed = namespace["NPROC"], namespace["DEVICE"], namespace["BACKEND"]
    assert placed == EXPECTED[notebook.stem][gpus]
    nproc, device, backend = placed
    assert not (gpus and device == "cpu"), "ranks on the CPU while a GPU is idle"
    assert not (backend == "nccl" and nproc > gpus), "more NCCL ranks than GPUs"
    if "BACKEND_1" in namespace:  # a one-rank run on the same device
        assert namespace["BACKEND_1"] == ("nccl" if device == "cuda" else "gloo")
    assert namespace["P"].reason in said
    kaggle = [line for line in said if line.startswith('Kaggle\'s "GPU T4 x2"')]
    assert len(kaggle) == (gpus != 2), said


BOOK_PAGES = sorted((ROOT / "book").glob("*.md"))
LAUNCH_CALL = re.compile(r"launch\.(torchrun|train)\((.*?)\)\s*[;\n]", re.S)


@pytest.mark.parametrize("page", BOOK_PAGES, ids=[page.stem for page in BOOK_PAGES])
def test_every_launch_on_a_book_page_runs_its_ranks_on_the_cpu(page: Path):
    """The book is built on the CPU and reads its runs' files by their CPU names: a launch of an entry point that
    takes --device says ``--device cpu``, itself or in a list the page defines, so a build on a GPU machine runs
    the same jobs (``labs.launch.torchrun`` would otherwise place them on the GPU; architecture review 4, A3)."""
    from distlab.labs.launch import entry_config, takes_placement

    text = page.read_text()
    bodies = dict(re.findall(r"^\s*(\w+) = \[(.*?)\]", text, re.S | re.M))
    lists = {
        name
        for name, value in vars(importlib.import_module("distlab.demos.bad_inputs")).items()
        if isinstance(value, (list, tuple)) and "--device" in value and re.search(rf"import .*\b{name}\b", text)
    }
    while True:  # a list that says it, or spreads one that does
        says = {
            name
            for name, body in bodies.items()
            if '"--device", "cpu"' in body or any(re.search(rf"\*{known}\b", body) for known in lists)
        }
        if says <= lists:
            break
        lists |= says
    for kind, args in LAUNCH_CALL.findall(text):
        target = "distlab.train" if kind == "train" else args.split(",")[0].strip().strip("\"'")
        if not target.startswith("distlab.") or not takes_placement(entry_config(target)):
            continue
        told = '"--device", "cpu"' in args or any(re.search(rf"\*{name}\b", args) for name in lists)
        assert told, f"{page.name}: launch.{kind}({args[:120]}...) does not say --device cpu"
