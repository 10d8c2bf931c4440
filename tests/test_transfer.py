"""distlab.bench.transfer: what a CPU can check (sizes, statistics, the clear
errors without CUDA, the plots reading a result file) and, where a GPU is
present, the measurements themselves."""

from __future__ import annotations

import subprocess
import sys

import matplotlib
import pytest
import torch

from distlab.bench import transfer
from distlab.bench.harness import parse_sizes
from distlab.results import read_result, write_result
from distlab.runtime import DistlabError, Runtime

matplotlib.use("Agg")
NO_CUDA = not torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(NO_CUDA, reason="no CUDA GPU on this machine: the GPU measurements are skipped")


def test_default_sizes_run_from_4kb_to_1gb():
    sizes = parse_sizes("4KB:1GB")
    assert sizes[0] == 4 << 10 and sizes[-1] == 1 << 30
    assert all(b == 4 * a for a, b in zip(sizes, sizes[1:]))


def test_bandwidth_row_uses_the_median_copy_time():
    row = transfer.bandwidth_row(1 << 30, "h2d", "pinned", [0.5, 0.1, 0.2, 0.3, 0.4], [1e-5] * 5)
    assert row["time_s"] == pytest.approx(0.3)
    assert row["GBps"] == pytest.approx((1 << 30) / 0.3 / 1e9)
    assert row["time_q1_s"] < row["time_s"] < row["time_q3_s"]
    assert row["repeats"] == 5


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA, so nothing refuses to run")
@pytest.mark.parametrize(
    "call",
    [
        lambda: transfer.copy_bandwidth([4096]),
        lambda: transfer.pinning_cost([1 << 20]),
        lambda: transfer.pinned_loader_cost(),
        lambda: transfer.non_blocking_read_hazard(),
        lambda: transfer.overlap_experiment(),
        lambda: transfer.loader_end_to_end(None),
    ],
    ids=["bandwidth", "pinning", "pinned_loader", "hazard", "overlap", "loader"],
)
def test_every_gpu_function_refuses_in_one_sentence_without_cuda(call):
    with pytest.raises(DistlabError) as error:
        call()
    message = str(error.value)
    assert "needs a CUDA GPU" in message and "\n" not in message


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_command_line_without_cuda_is_one_line_not_a_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "distlab.bench.transfer", "--sizes", "4KB"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    output = (done.stdout + done.stderr).strip().splitlines()
    assert output == [line for line in output if line.startswith("distlab: error:")] and len(output) == 1, output
    assert "Traceback" not in done.stderr


def test_plots_read_a_transfer_result_file(tmp_path):
    # A record shaped like a GPU run's, built from rows the library computes;
    # it is written to a temporary folder and never committed as a result.
    rows = [
        transfer.bandwidth_row(size, d, mode, [size / 1e10], [1e-6])
        for size in (4096, 1 << 20)
        for d in ("h2d", "d2h")
        for mode in transfer.MODES
    ]
    timeline = [{"lane": lane, "batch": 0, "start_ms": 0.0, "dur_ms": 1.0} for lane in ("copy", "compute")]
    ranks = [
        {
            "rank": 0,
            "gpu": "test double",
            "bandwidth": rows,
            "overlap": {
                "batches": 1,
                "batch_bytes": 1 << 20,
                "serial_s": 0.002,
                "overlapped_s": 0.001,
                "timeline": {"serial": timeline, "overlapped": timeline},
            },
        }
    ]
    path = write_result(
        tmp_path / "t.json",
        "transfer",
        {},
        {"ranks": ranks, "loader": []},
        Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo"),
    )
    from distlab import plots

    record = read_result(path)
    assert len(plots.plot_copy_bandwidth(record)[0].lines) == len(transfer.MODES)
    plots.plot_overlap_timeline(record)


@needs_gpu
def test_pinned_copies_measure_and_the_hazard_is_reported():
    rows = transfer.copy_bandwidth([1 << 20, 64 << 20], warmup=1, repeats=3)
    assert {r["mode"] for r in rows} == set(transfer.MODES)
    assert all(r["GBps"] > 0 for r in rows)
    hazard = transfer.non_blocking_read_hazard()
    assert hazard["late_read_was_right"]
    overlap = transfer.overlap_experiment(batches=4, batch_bytes=16 << 20, matmul_size=1024)
    assert overlap["serial_s"] > 0 and overlap["overlapped_s"] > 0
