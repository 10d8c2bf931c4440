"""What a Kaggle learner runs and no other test did: distlab installed from the wheel dataset, in a bare folder with
no checkout, the lab's GPU branch set up (kaggle-review-1.md K5). Kaggle's two T4s are simulated in the kernel up to
the first job (a cell before the set-up tells torch it has two T4s without peer access), so the set-up cells run as
they do there: the install from the wheel, the survey, NCCL's transport, the placement, the GPU branch's command
lines. Both of Kaggle's input layouts, the input read-only, Kaggle's ``PYTHONPATH``, no package index.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from support import bare_kaggle_kernel, python_without_distlab

pytestmark = pytest.mark.kaggle

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("distlab_kaggle_bundler_gpu", ROOT / "scripts" / "kaggle.py")
kaggle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kaggle)

TWO_T4S = """# not part of the lab: this kernel has no GPU, so torch is told it has Kaggle's two T4s (no peer access)
import torch
from types import SimpleNamespace
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 2
torch.cuda.get_device_name = lambda device=None: "Tesla T4"
torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(total_memory=15828320256, name="Tesla T4")
torch.cuda.is_bf16_supported = lambda including_emulation=True: False
torch.cuda.can_device_access_peer = lambda a, b: False
torch.cuda.nccl.version = lambda: (2, 21, 5)
"""
LAYOUTS = {"classic": Path("distlab-wheel"), "datasets": Path("datasets") / "learner" / "distlab-wheel"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return kaggle.build_wheel(tmp_path_factory.mktemp("wheel"))


def up_to_first_job(notebook: dict) -> dict:
    """The lab's cells before its first torchrun job, after the simulated GPUs' cell."""
    cells = []
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "torch.distributed.run" in source and "!" in source:
            break
        cells.append(cell)
    first = next(cell for cell in cells if cell["cell_type"] == "code")
    gpus = {**first, "id": "two-t4s", "source": TWO_T4S.splitlines(keepends=True), "outputs": []}
    cells.insert(cells.index(first), gpus)
    return {**notebook, "cells": cells}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_bare_lab_on_kaggles_t4_pair_installs_from_the_wheel_and_sets_up_its_gpu_branch(layout, wheel, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    python = python_without_distlab(tmp_path)
    inputs = tmp_path / "input"
    dataset = inputs / LAYOUTS[layout]
    dataset.mkdir(parents=True)
    shutil.copy(wheel, dataset)
    dataset.chmod(0o555)  # Kaggle mounts its inputs read-only
    working = tmp_path / "working"
    working.mkdir()
    notebook = up_to_first_job(kaggle.kernel_notebook(ROOT / "notebooks" / "lab0_first_run.ipynb", None))
    setup = next(cell for cell in notebook["cells"] if cell["cell_type"] == "code" and cell.get("id") != "two-t4s")
    source = "".join(setup["source"])
    setup["source"] = source.replace('"/kaggle/input/', f'"{inputs}/')  # the only change: where the input is
    kernel = bare_kaggle_kernel(tmp_path, monkeypatch, python, "kaggle-gpu", "Kaggle's T4 pair, simulated")
    monkeypatch.setenv("PYTHONPATH", ":/opt/facets/facets_overview/python/")  # Kaggle's image sets this
    nb = nbformat.reads(json.dumps(notebook), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "import json, os\nprint(json.dumps({'P': [P.ranks, P.device, P.backend], 'ON_GPU': ON_GPU, 'COMMON': COMMON, "
        "'NCCL': os.environ.get('NCCL_P2P_DISABLE'), 'distlab': __import__('distlab').__file__}))"
    ))  # fmt: skip
    nbclient.NotebookClient(nb, timeout=300, kernel_name=kernel, resources={"metadata": {"path": str(working)}}
                            ).execute()  # fmt: skip
    said = json.loads("".join(output.get("text", "") for output in nb.cells[-1].outputs))
    assert said["P"] == [2, "cuda", "nccl"] and said["ON_GPU"]
    assert said["COMMON"][said["COMMON"].index("--dataset") + 1] == "mnist"
    assert said["NCCL"] == "1"  # no peer access between the T4s: NCCL told before any job starts
    assert str(tmp_path / "venv") in said["distlab"]  # installed from the wheel into the kernel's own environment
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    setup_output = "".join(output.get("text", "") for cell in code[:2] for output in cell.outputs)
    assert "2 x Tesla T4: the hardware this lab is written for." in setup_output
    assert "GPUs 0 and 1 have no peer access" in setup_output
    record = json.loads((working / "results" / "hardware.json").read_text())
    assert record["gpus"] == ["Tesla T4"] * 2 and record["nccl_env"]["NCCL_P2P_DISABLE"] == "1"
    assert sorted(p.name for p in working.iterdir()) == ["ddp_minimal.py", "results"]  # no wheel, no MNIST here
    subprocess.run(["chmod", "-R", "u+w", str(inputs)], check=True)  # so that pytest can remove it
