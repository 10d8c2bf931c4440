"""The GPU tier of the compile chapter (book/compile.md), ``python -m pytest -m gpu tests/test_gpu_compile.py``:
``distlab.bench.compile`` on CUDA, one NCCL rank per GPU (up to two), inductor generating Triton kernels. It has
not run: this project's CI and the machine the chapter was written on have no GPU. Its CPU twin is the committed
CPU run (``book/results/compile``), which ``tests/test_compile.py`` reads, and the bench's code path up to the
device is the same on both.
"""

from __future__ import annotations

import pytest

from distlab.predict.compiled_ddp import MIB, ddp_optimizer_graphs, linear_layer_bytes
from distlab.results import read_result
from distlab.runtime import gpu_count
from distlab.testing import run_torchrun

GPUS = gpu_count()

CUDA_ARGS = ["--device", "cuda", "--repeats", "10"]
"""The GPU tier's command line for the bench (tests/test_compile.py parses it on the CPU)."""

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is"),
]


def test_the_compile_bench_on_cuda_compiles_and_times_both_variants(tmp_path):
    """Each rank's first (compiling) step and the step compiled against eager, on CUDA: the compiled model must
    have handed the backend DDPOptimizer's graphs (two at the bench's 25 MiB cap on the chapter's model), and every
    number must be a time."""
    ranks = min(GPUS, 2)
    done = run_torchrun(ranks, "distlab.bench.compile", *CUDA_ARGS, "--out", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = read_result(tmp_path / f"compile-inductor-{ranks}xcuda.json")
    assert record["metrics"]["graphs"] == ddp_optimizer_graphs(linear_layer_bytes([512] * 9), 25 * MIB)
    for row in record["metrics"]["rows"]:
        assert len(row["first_step_s_per_rank"]) == ranks and row["time_s"] > 0
