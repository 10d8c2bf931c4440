"""distlab.bench.transfer and distlab.bench.host: what a CPU can check (sizes,
statistics, the clear errors without CUDA, the host-side measurements, ranks
taking turns, the plots reading a result file) and, where a GPU is present,
the measurements themselves."""

from __future__ import annotations

import errno
import json
import sys
import time

import matplotlib
import pytest
import torch

from distlab.bench import host, loader, transfer
from distlab.bench.harness import parse_sizes, take_turns
from distlab.errors import DistlabError
from distlab.labs.launch import run_job
from distlab.predict import stream_results, stream_scenarios, streams
from distlab.results import read_result, write_result
from distlab.runtime import Runtime
from distlab.testing import run_ranks

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
        lambda: loader.loader_end_to_end(None),
        lambda: transfer.measure_gpu([4096], 1, torch.device("cuda", 0)),
    ],
    ids=["bandwidth", "pinning", "pinned_loader", "hazard", "overlap", "loader", "measure_gpu"],
)
def test_every_gpu_function_refuses_in_one_sentence_without_cuda(call):
    with pytest.raises(DistlabError) as error:
        call()
    message = str(error.value)
    assert "needs a CUDA GPU" in message and "\n" not in message


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_command_line_without_cuda_is_one_line_not_a_traceback():
    done = run_job([sys.executable, "-m", "distlab.bench.transfer", "--sizes", "4KB"], timeout=120)
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


def test_page_locking_is_measured_on_the_cpu_first_call_apart_from_steady_state():
    row = host.page_lock_cost(host.lockable_size(16 << 20), repeats=5)
    assert row["first_touch"]["time_s"] > 0 and row["first_touch"]["repeats"] == 5
    if not row["mlock_permitted"]:
        pytest.skip(row["mlock_note"])
    first, steady = row["first_lock"], row["steady_lock"]
    assert first["time_s"] > 0 and steady["time_s"] > 0 and row["unlock"]["time_s"] > 0
    assert first["time_q1_s"] <= first["time_s"] <= first["time_q3_s"]
    if row["bytes"] >= 1 << 20:  # the first call also faults every page in; re-locking resident pages does not
        assert first["time_s"] > steady["time_s"]


def test_a_refused_mlock_is_one_line_and_the_rest_is_still_measured(monkeypatch):
    monkeypatch.setattr(host.HostBuffer, "lock", lambda self: errno.ENOMEM)
    row = host.page_lock_cost(1 << 20, repeats=2)
    assert row["mlock_permitted"] is False and "first_lock" not in row
    assert "ulimit -l" in row["mlock_note"] and "\n" not in row["mlock_note"]
    assert row["first_touch"]["time_s"] > 0


def test_host_copy_rates_and_the_dispatch_time_are_sane():
    staging = host.staging_copy_bandwidth(8 << 20, [256 << 10, 1 << 20], repeats=3)
    assert [r["chunk_bytes"] for r in staging] == [256 << 10, 1 << 20]
    plain = host.memory_copy_bandwidth(8 << 20, repeats=3)
    for row in (*staging, plain):
        assert 0.05 < row["GBps"] < 1000
    assert 0 < host.dispatch_time(200)["time_s"] < 0.01


def test_host_command_line_writes_a_result_with_provenance(tmp_path):
    done = run_job(
        [sys.executable, "-m", "distlab.bench.host", "--sizes", "1MB", "--chunks", "256KB,1MB"]
        + ["--staging-total", "4MB", "--repeats", "2", "--out", str(tmp_path), "--name", "h"],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    record = read_result(tmp_path / "h.json")
    assert record["kind"] == "host" and record["environment"]["command"].startswith("python")
    assert [r["chunk_bytes"] for r in record["metrics"]["staging_copy"]] == [256 << 10, 1 << 20]
    inputs = stream_results.inputs_from_host_result(record, link_GBps=15.75, link_source="cited: PCIe 3.0 x16")
    assert inputs.stage_GBps == record["metrics"]["staging_copy"][-1]["GBps"]
    assert "measured" in inputs.describe() and "cited" in inputs.describe()


def test_variants_take_turns_after_an_untimed_warm_up():
    calls = []
    results = take_turns(
        ["a", "b", "c"],
        lambda name: calls.append(("run", name)) or len(calls),
        repeats=2,
        warmup=1,
        warmup_run=lambda name: calls.append(("warm", name)),
    )
    assert calls == [("warm", "a"), ("warm", "b"), ("warm", "c")] + [("run", n) for n in "abcabc"]
    assert results == {"a": [4, 7], "b": [5, 8], "c": [6, 9]}  # only the timed rounds are kept


def measure_in_turn(runtime) -> tuple[float, float]:
    def measure() -> dict:
        started = time.time()
        time.sleep(0.3)
        return {"start": started, "end": time.time()}

    mine = transfer.one_rank_at_a_time(runtime, measure)
    return mine["start"], mine["end"]


def test_ranks_measure_one_after_the_other(tmp_path):
    spans = sorted(run_ranks(measure_in_turn, 2, tmp_path))
    (_, first_end), (second_start, _) = spans
    assert second_start >= first_end  # rank 1 started only once rank 0 had finished


def test_measured_and_predicted_bandwidth_draw_from_a_result_file(tmp_path):
    # Rows shaped like a GPU run's, built by the library; written to a temporary folder, never committed.
    rows = [
        transfer.bandwidth_row(size, "h2d", mode, [size / 1e10], [1e-6])
        for size in (4096, 1 << 20)
        for mode in transfer.MODES
    ]
    path = write_result(
        tmp_path / "t.json",
        "transfer",
        {},
        {"ranks": [{"rank": 0, "gpu": "test double", "bandwidth": rows}], "loader": []},
        Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo"),
    )
    from distlab import plots

    inputs = streams.Inputs(link_GBps=10.0, stage_GBps=5.0)
    predicted = stream_scenarios.predicted_bandwidth(inputs, [4096, 1 << 20])
    axes = plots.plot_measured_vs_predicted_bandwidth(read_result(path), predicted, caption=inputs.describe())
    assert len(axes[0].lines) == 2 * len(transfer.MODES)


def test_a_cpu_machine_reports_no_pcie_link_or_a_well_formed_one():
    link = transfer.pcie_link(0)
    assert link is None or set(link) == {"gen", "gen_max", "width", "width_max"}
    json.dumps(link)


@needs_gpu
def test_pinned_copies_measure_and_the_hazard_is_reported():
    rows = transfer.copy_bandwidth([1 << 20, 64 << 20], warmup=1, repeats=3)
    assert {r["mode"] for r in rows} == set(transfer.MODES)
    assert all(r["GBps"] > 0 for r in rows)
    hazard = transfer.non_blocking_read_hazard()
    assert hazard["late_read_was_right"]
    overlap = transfer.overlap_experiment(batches=4, batch_bytes=16 << 20, matmul_size=1024)
    assert overlap["serial_s"] > 0 and overlap["overlapped_s"] > 0


@needs_gpu
def test_pinning_cost_times_the_first_call_apart_from_the_cached_path():
    (row,) = transfer.pinning_cost([64 << 20], repeats=3)
    assert row["first_pin_memory_s"] > 0 and row["cached_pin_memory_s"] > 0
    assert row["first_calls"] >= 1
