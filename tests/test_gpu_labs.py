"""The GPU tier's labs (with tests/test_gpu.py, what ``pytest -m gpu`` collects): every lab played top to bottom on
the GPUs present, and the quick selection's play of each lab up to the job only it runs, with its CPU twin."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from distlab.labs.offline import write_offline_mnist
from test_fsdp_lab import check_adapter_runs
from test_gpu import GPUS, nccl_transport_as_a_lab_sets_it, needs_gpu

ROOT = Path(__file__).resolve().parents[1]


LABS = sorted((ROOT / "notebooks").glob("lab*.ipynb"))
LAB_QUICK_STOP = {
    "lab0_first_run": "--run-name lab0-single",
    "lab_pinned_memory": "transfer_bench.py --sizes",
    "lab_ddp_mnist": "-m distlab.bench.ddp_step",
    "lab_ring_allreduce": "ring_bench.py --sizes",
    "lab_fsdp": "fsdp_train.py --device",
}
"""The quick selection plays each lab up to the cell that launches what only that lab runs on the GPU (its own
script or benchmark; lab 0 its first run), with the jobs of the cells before it left out."""
QUICK_EDITS = (
    ('"--epochs", "5"', '"--epochs", "1"'),  # one epoch of each run: the code path, not the lesson's curve
    ("--sizes 4KB:1GB --out", "--sizes 4KB:64MB --loader-epochs 0 --out"),  # copies, without the DataLoader study
    ('"4KB:256MB" if BACKEND', '"4KB:16MB" if BACKEND'),  # the ring on NCCL: the code path, at gloo's sizes
)
LAUNCH = re.compile(r"^\s*!.*(torch\.distributed\.run|\{TORCHRUN)")


def quick_lab(notebook, stop: str):
    """``notebook`` cut after the cell that holds ``stop``, each earlier torchrun job replaced by a successful
    no-op (``_exit_code = 0``), the sizes made quick."""
    cells = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            source = cell.source
            for old, new in QUICK_EDITS:
                source = source.replace(old, new)
            if stop not in source:
                source = "\n".join("_exit_code = 0" if LAUNCH.match(line) else line for line in source.splitlines())
            cell.source = source
        cells.append(cell)
        if cell.cell_type == "code" and stop in cell.source:
            notebook.cells = cells
            return notebook
    raise AssertionError(f"no cell holds {stop!r}")


def play_lab(lab: Path, tmp_path: Path, monkeypatch, quick: bool):
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    working = tmp_path / "working"
    working.mkdir()
    shutil.copy(lab, working / lab.name)
    write_offline_mnist(working / "data")  # no network on a GPU image: MNIST's format, written here
    notebook = nbformat.read(working / lab.name, as_version=4)
    if quick:
        notebook = quick_lab(notebook, LAB_QUICK_STOP[lab.stem])
    # the kernel inherits the environment: it imports this checkout's distlab, as the maintainers run it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    nbclient.NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(working)}}).execute()
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    setup = "".join(output.get("text", "") for output in first.outputs)
    assert "No CUDA GPU here" not in setup, setup
    gpu_results = [json.loads(p.read_text()) for p in (working / "results").glob("*.json") if p.name != "hardware.json"]
    devices = {r.get("environment", {}).get("device", "") for r in gpu_results}
    assert gpu_results, "the lab wrote no result"
    assert any(d.startswith("cuda") for d in devices), devices  # nothing on the CPU beside a GPU
    step = working / "results" / "mnist-ddp-step.json"
    if step.is_file():  # P14: the profiled DDP step draws its all-reduces, NCCL's kernels or gloo's CPU threads
        lanes = {interval["lane"] for interval in json.loads(step.read_text())["metrics"]["timeline"]}
        assert lanes == {"compute", "communication"}, lanes


@pytest.mark.parametrize("lab", LABS, ids=[lab.stem for lab in LABS])
@pytest.mark.gpu
@needs_gpu
def test_every_lab_plays_top_to_bottom_on_the_gpus_present(lab, tmp_path, monkeypatch):
    play_lab(lab, tmp_path, monkeypatch, quick=False)


@pytest.mark.parametrize("lab", LABS, ids=[lab.stem for lab in LABS])
@pytest.mark.gpu
@pytest.mark.quick
@needs_gpu
def test_every_lab_launches_its_own_job_on_the_gpus_present(lab, tmp_path, monkeypatch, request):
    if any(item.originalname == "test_every_lab_plays_top_to_bottom_on_the_gpus_present" for item in
           request.session.items):  # fmt: skip
        pytest.skip("this run plays every lab top to bottom, which launches this job too")
    play_lab(lab, tmp_path, monkeypatch, quick=True)


@pytest.mark.parametrize("lab", LABS, ids=[lab.stem for lab in LABS])
def test_every_labs_quick_play_stops_at_its_own_job_with_the_earlier_jobs_left_out(lab):
    """The CPU twin of the quick lab test: each lab has the cell it stops at, no torchrun job before it, and the
    quick sizes apply where the lab has them."""
    nbformat = pytest.importorskip("nbformat")
    notebook = quick_lab(nbformat.read(lab, as_version=4), LAB_QUICK_STOP[lab.stem])
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    assert LAB_QUICK_STOP[lab.stem] in code[-1]
    assert not any(LAUNCH.match(line) for source in code[:-1] for line in source.splitlines())
    original = lab.read_text()
    for old, new in QUICK_EDITS:
        if json.dumps(old)[1:-1] in original:
            assert any(new in source for source in code), (old, new)


ADAPTER_PART = ["--model", "gpt-small", "--adapter-rank", "8", "--precision", "fp32", "--epochs", "2"]
ADAPTER_PART += ["--num-workers", "0", "--batch-size", "4", "--samples", "160", "--device", "cuda", "--backend", "nccl"]
"""The FSDP lab's part 4 as its GPU branch runs it (a GPU per rank: part 2's gpt-small and its batch), each wrap."""


@pytest.mark.gpu
@needs_gpu
def test_the_fsdp_labs_adapter_part_sends_the_predicted_bytes_on_nccl_ranks(tmp_path, monkeypatch):
    """Part 4 of ``lab_fsdp`` on two NCCL ranks, a GPU each: gpt-small frozen with rank-8 adapters under both
    wraps. Only the adapters have gradients and move, the base does not, and each rank's first step sends the
    predicted bytes to the byte, every one of them a CUDA tensor's (none through the group's gloo leg). CPU twin:
    ``tests/test_fsdp_lab.py::test_adapters_over_a_frozen_gpt_send_the_predicted_bytes_under_both_wraps``."""
    from distlab.results import read_result
    from distlab.testing import run_torchrun

    if GPUS < 2:
        pytest.skip(f"part 4 runs where each of two ranks has a GPU of its own; this machine has {GPUS}")
    nccl_transport_as_a_lab_sets_it(monkeypatch)
    runs = {}
    for wrap in ("ddp", "fsdp"):
        out = tmp_path / f"gpt-small-adapters-{wrap}.json"
        job = run_torchrun(2, str(ROOT / "scripts" / "fsdp_train.py"), *ADAPTER_PART, "--wrap", wrap, "--out", str(out))
        assert job.returncode == 0, job.stderr[-3000:]
        runs[wrap] = read_result(out)
    check_adapter_runs(runs, 2, "cuda")
    assert all(m["cuda_max_allocated"] for record in runs.values() for m in record["metrics"]["memory"])
