"""distlab.predict.streams: the stream model reproduces the orderings CUDA documents,
asserted on its timelines. Each test names the rule it checks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distlab.predict import stream_results, stream_scenarios, streams
from distlab.predict.streams import COMPUTE, DEFAULT, HOST, Inputs, StreamModel

MB = 1 << 20
# Round, made-up inputs: the orderings must hold whatever the figures are.
INPUTS = Inputs(link_GBps=16.0, stage_GBps=6.0, api_s=5e-6, chunk_bytes=2 * MB, staging_chunks=2)
COPY_64MB = 64 * MB / 16e9


def test_the_model_does_not_need_torch():
    modules = "distlab.predict.streams, distlab.predict.stream_scenarios, distlab.predict.stream_results"
    code = f"import sys, {modules}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_blocking_copy_waits_for_the_copy_to_finish():
    for pinned in (True, False):
        m = StreamModel(INPUTS)
        call = m.copy_h2d("x", 64 * MB, pinned=pinned, non_blocking=False)
        assert call.returned == pytest.approx(call.end)
        assert call.returned >= COPY_64MB


def test_a_blocking_copy_also_waits_for_the_work_queued_before_it():
    m = StreamModel(INPUTS)
    kernel = m.kernel("k", 0.010)
    call = m.copy_h2d("x", 1 * MB, pinned=True, non_blocking=False)
    assert call.start >= kernel.end  # same stream: the copy runs after the kernel
    assert call.returned >= kernel.end  # cudaStreamSynchronize waits for both


def test_a_non_blocking_copy_from_pinned_memory_returns_at_once():
    m = StreamModel(INPUTS)
    m.kernel("k", 0.010)
    call = m.copy_h2d("x", 64 * MB, pinned=True, non_blocking=True)
    assert call.host_blocked_s == pytest.approx(INPUTS.api_s)  # the call's own overhead, nothing else
    assert call.end > call.returned + COPY_64MB  # the copy happens later, after the kernel


def test_work_on_one_stream_runs_in_order_and_never_overlaps():
    timeline = stream_scenarios.same_stream_non_blocking(INPUTS, batch_bytes=64 * MB, compute_s=0.005, steps=4)
    device = sorted((i for i in timeline.intervals if i.lane != HOST), key=lambda i: i.start)
    for k in range(4):
        copy = [i for i in timeline.step(k) if i.kind == "copy"]
        step = [i for i in timeline.step(k) if i.kind == "kernel"]
        assert step[0].start >= copy[-1].end  # step k waits for its batch
        if k:
            previous = [i for i in timeline.step(k - 1) if i.kind == "kernel"]
            assert copy[0].start >= previous[0].end  # copy k+1 waits for step k: no overlap on one stream
    for a, b in zip(device, device[1:]):
        assert b.start >= a.end - 1e-12
    # ...while the host ran ahead: it issued every copy before the first step finished
    last_issue = timeline.calls["copy 3"].returned
    assert last_issue < timeline.calls["step 0"].end


def test_a_side_stream_copy_from_pinned_memory_overlaps_compute():
    timeline = stream_scenarios.side_stream_prefetch(INPUTS, batch_bytes=64 * MB, compute_s=COPY_64MB, steps=4)
    copies, steps = timeline.on("copy H2D"), timeline.on(COMPUTE)
    assert any(c.overlaps(s) for c in copies for s in steps)
    serial = stream_scenarios.same_stream_non_blocking(INPUTS, batch_bytes=64 * MB, compute_s=COPY_64MB, steps=4)
    assert timeline.steady_step_s() == pytest.approx(COPY_64MB, rel=0.01)  # max(copy, compute)
    assert serial.steady_step_s() == pytest.approx(2 * COPY_64MB, rel=0.01)  # copy + compute
    for k in range(4):  # and each step still waits for its own batch
        copy = [i for i in timeline.step(k) if i.kind == "copy"]
        step = [i for i in timeline.step(k) if i.kind == "kernel"]
        assert step[0].start >= copy[-1].end


def test_a_pageable_source_is_staged_by_the_host_thread():
    """The model's reading of 'might be synchronous': the host copies every chunk into a staging
    buffer at the staging rate, and a chunk is sent only once it is staged."""
    m = StreamModel(INPUTS)
    call = m.copy_h2d("x", 64 * MB, pinned=False, non_blocking=True)
    staged = [i for i in m.intervals if i.lane == HOST and i.kind == "stage"]
    assert sum(i.duration for i in staged) == pytest.approx(64 * MB / 6e9)
    assert call.host_blocked_s >= 64 * MB / 6e9  # non_blocking or not, the host did the staging
    assert len(call.device) == 32
    chunk_staged = 2 * MB / 6e9
    for k, dma in enumerate(call.device):  # chunk k is sent only after chunks 0..k are staged
        assert dma.start >= INPUTS.api_s + (k + 1) * chunk_staged - 1e-12


def test_a_small_pageable_copy_returns_before_the_stream_reaches_it_and_a_large_one_waits():
    timeline = stream_scenarios.pageable_non_blocking(INPUTS, small_bytes=1 * MB, large_bytes=64 * MB, compute_s=0.020)
    kernel, small, large = (timeline.calls[k] for k in ("kernel", "small", "large"))
    assert small.returned < kernel.end <= small.start  # staged and returned; its DMA comes after the kernel
    assert large.returned > kernel.end  # more chunks than staging buffers: the host waited for the stream
    assert any(i.label == "wait for a staging buffer" for i in timeline.on(HOST, "wait"))


def test_a_side_stream_copy_from_pageable_memory_keeps_the_host_busy_staging():
    pinned = stream_scenarios.side_stream_prefetch(INPUTS, batch_bytes=64 * MB, compute_s=COPY_64MB, steps=4)
    pageable = stream_scenarios.side_stream_prefetch(
        INPUTS, pinned=False, batch_bytes=64 * MB, compute_s=COPY_64MB, steps=4
    )
    staging = sum(i.duration for i in pageable.on(HOST, "stage"))
    assert staging == pytest.approx(4 * 64 * MB / 6e9)
    assert pageable.steady_step_s() >= 64 * MB / 6e9 > pinned.steady_step_s()  # the host's staging sets the pace


def test_an_early_read_of_a_non_blocking_d2h_copy_into_pinned_memory_is_stale():
    timeline = stream_scenarios.d2h_read_hazard(INPUTS, nbytes=16 * MB, compute_s=0.005)
    early, late = timeline.reads
    assert early.stale and early.saw == "initial" and early.time < timeline.calls["copy"].end
    assert not late.stale and late.saw == "copy to host"


def test_a_d2h_copy_into_pageable_memory_returns_only_with_the_data():
    timeline = stream_scenarios.d2h_read_hazard(INPUTS, nbytes=16 * MB, compute_s=0.005, pinned=False)
    early, late = timeline.reads
    assert not early.stale and not late.stale
    assert timeline.calls["copy"].returned >= timeline.calls["copy"].end


def test_events_order_work_across_streams():
    m = StreamModel(INPUTS)
    copy = m.copy_h2d("x", 64 * MB, pinned=True, non_blocking=True, stream="side")
    m.record("copied", "side")
    free = m.kernel("independent", 0.001)  # no wait: runs beside the copy
    m.wait_event(DEFAULT, "copied")
    dependent = m.kernel("dependent", 0.001)
    assert free.start < copy.end
    assert dependent.start >= copy.end
    m.event_synchronize("copied")
    assert m.now >= copy.end
    with pytest.raises(ValueError, match="never recorded"):
        m.wait_event(DEFAULT, "nothing")


def test_one_copy_engine_serialises_both_directions_and_two_do_not():
    for engines, overlap in ((1, False), (2, True)):
        m = StreamModel(Inputs(link_GBps=16.0, stage_GBps=6.0, copy_engines=engines))
        up = m.copy_h2d("up", 64 * MB, pinned=True, non_blocking=True, stream="a")
        down = m.copy_d2h("down", 64 * MB, pinned=True, non_blocking=True, stream="b")
        assert up.device[0].overlaps(down.device[0]) == overlap


def test_the_notes_loop_with_a_per_step_sync_cannot_run_ahead():
    """loss.item() every step: the host waits for each step before fetching the next batch."""
    timeline = stream_scenarios.notes_loop(INPUTS, optimized=True, batch_bytes=16 * MB, compute_s=0.004, load_s=0.001)
    for k in range(1, 4):
        load = [i for i in timeline.step(k, lane=HOST, kind="work")]
        previous = [i for i in timeline.step(k - 1, lane=COMPUTE)]
        assert load[0].start >= previous[0].end


def test_speedups_order_as_the_pipelines_do_and_match_the_closed_forms():
    ratios = [0.1, 1.0, 3.0]
    curves = stream_scenarios.speedup_curve(INPUTS, ratios, batch_bytes=64 * MB)
    for i in range(len(ratios)):
        assert curves["pageable"][i] == pytest.approx(1.0)
        assert curves["pinned + non_blocking"][i] >= curves["pinned"][i] - 1e-9
        assert curves["pinned + non_blocking + side stream"][i] > curves["pinned + non_blocking"][i]
    # step times against the closed forms: copy T on the link, compute C, a pageable copy at the staging
    # rate (T_stage), of which at most the staging pool can be staged ahead while the previous step computes
    T, T_stage = COPY_64MB, 64 * MB / 6e9
    ahead = INPUTS.staging_chunks * INPUTS.chunk_bytes / 6e9
    for r in ratios:
        C = T / r
        step = lambda variant: stream_scenarios.step_time(INPUTS, variant, batch_bytes=64 * MB, compute_s=C)
        assert C + T_stage - ahead - 1e-9 <= step("pageable") <= C + T_stage + 2 * MB / 16e9
        assert step("pinned + non_blocking") == pytest.approx(C + T, rel=1e-3)  # in series on one stream
        assert step("pinned + non_blocking + side stream") == pytest.approx(max(C, T), rel=1e-3)  # overlapped


def test_pinning_speeds_a_large_copy_up_by_the_link_over_the_staging_rate():
    assert stream_scenarios.transfer_speedup(INPUTS, 256 * MB) == pytest.approx(16 / 6, rel=0.02)
    fast_host = Inputs(link_GBps=16.0, stage_GBps=40.0)
    assert stream_scenarios.transfer_speedup(fast_host, 256 * MB) == pytest.approx(1.0, abs=0.02)


def test_where_between_finds_every_range_inside_a_band():
    xs = [0, 1, 2, 3, 4]
    assert stream_scenarios.where_between(xs, [0, 1, 2, 3, 4], 1.5, 2.5) == [(1.5, 2.5)]
    assert stream_scenarios.where_between(xs, [0, 2, 0, 2, 0], 1.0, 3.0) == [(0.5, 1.5), (2.5, 3.5)]
    assert stream_scenarios.where_between(xs, [0, 0, 0, 0, 0], 1.0, 2.0) == []


def test_the_model_is_deterministic():
    run = lambda: (
        stream_scenarios.side_stream_prefetch(INPUTS, pinned=False, batch_bytes=20 * MB, compute_s=0.003).intervals
    )
    assert run() == run()


def test_links_from_spec_sheets():
    assert streams.pcie_GBps(3, 16) == pytest.approx(15.75, abs=0.01)
    assert streams.pcie_GBps(4, 16) == pytest.approx(31.5, abs=0.02)
    assert streams.link_for_gpu("Tesla T4") == (3, 16)
    assert streams.link_for_gpu("NVIDIA H100 80GB HBM3") == (5, 16)
    assert streams.link_for_gpu("Some Future GPU") is None


def test_the_timelines_draw(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from distlab import plots

    timelines = [
        stream_scenarios.notes_loop(INPUTS, optimized=False, batch_bytes=16 * MB, compute_s=0.004),
        stream_scenarios.d2h_read_hazard(INPUTS, nbytes=16 * MB, compute_s=0.004),
    ]
    axes = plots.plot_stream_timelines(timelines, caption="predicted by the model")
    assert len(axes) == 2
    ratios = [0.1, 1.0]
    plots.plot_speedup_curves(ratios, stream_scenarios.speedup_curve(INPUTS, ratios, batch_bytes=16 * MB))
    animation = plots.animate_copy_compute_ratio(INPUTS, ratios, batch_bytes=16 * MB)
    assert "<script" in animation.to_jshtml()


def _gpu_shaped_record(tmp_path, truth: Inputs):
    """A record shaped like a GPU run of distlab.bench.transfer whose 'measurements' are the model's own
    output for ``truth``: written to a temporary folder, never committed, never shown as a GPU result."""
    import torch

    from distlab.results import read_result, write_result
    from distlab.runtime import Runtime

    rows = [
        {**r, "time_q1_s": r["time_s"], "time_q3_s": r["time_s"], "repeats": 1}
        for r in stream_scenarios.predicted_bandwidth(truth, [4096, 1 * MB, 64 * MB])
    ]
    timelines = {
        key: stream_scenarios.overlap_experiment(truth, batches=4, batch_bytes=16 * MB, compute_s=0.001, overlapped=key)
        for key in (False, True)
    }
    as_measured = lambda t: [
        {
            "lane": "copy" if i.kind == "copy" else "compute",
            "batch": i.step,
            "start_ms": i.start * 1e3,
            "dur_ms": i.duration * 1e3,
        }
        for i in t.intervals
        if i.lane != HOST
    ]
    rank = {
        "rank": 0,
        "gpu": "test double",
        "bandwidth": rows,
        "overlap": {
            "batches": 4,
            "batch_bytes": 16 * MB,
            "serial_s": timelines[False].end,
            "overlapped_s": timelines[True].end,
            "timeline": {"serial": as_measured(timelines[False]), "overlapped": as_measured(timelines[True])},
        },
        "non_blocking_hazard": {"numel": 1 << 20, "early_read_was_wrong": True},
    }
    host_side = {"staging_copy": [{"chunk_bytes": 2 * MB, "GBps": truth.stage_GBps}]}
    path = write_result(
        tmp_path / "t.json",
        "transfer",
        {},
        {"ranks": [rank], "loader": [], "host": host_side},
        Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo"),
    )
    return read_result(path)


@pytest.mark.parametrize("sync_s", [0.0, 15e-6])
def test_predictions_for_a_gpu_result_come_from_its_own_measured_inputs(tmp_path, sync_s):
    truth = Inputs(link_GBps=12.0, stage_GBps=7.0, api_s=8e-6, copy_latency_s=10e-6, sync_s=sync_s)
    record = _gpu_shaped_record(tmp_path, truth)
    prediction = stream_results.predict_transfer_result(record)
    inputs = prediction["inputs"]
    assert inputs.link_GBps == pytest.approx(12.0, rel=0.01) and inputs.stage_GBps == 7.0
    assert inputs.copy_latency_s == pytest.approx(10e-6, rel=0.05) and inputs.api_s == pytest.approx(8e-6)
    assert inputs.sync_s == pytest.approx(sync_s, abs=1e-9)
    assert inputs.cache_bytes is None and inputs.stage_dram_GBps is None  # no pin_memory() rows: one staging rate
    measured = {(r["bytes"], r["mode"]): r for r in record["metrics"]["ranks"][0]["bandwidth"]}
    for row in prediction["bandwidth"]:  # the pageable rows were not inputs: they are predicted
        assert row["GBps"] == pytest.approx(measured[row["bytes"], row["mode"]]["GBps"], rel=0.02)
    overlap = prediction["overlap"]
    assert overlap["predicted_speedup"] == pytest.approx(overlap["measured_speedup"], rel=0.01)
    assert prediction["hazard"] == {"predicted_stale": True, "measured_stale": True}


def test_a_gpu_result_is_drawn_next_to_the_model(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from distlab import plots

    record = _gpu_shaped_record(tmp_path, Inputs(link_GBps=12.0, stage_GBps=7.0, api_s=8e-6))
    figures, summary = plots.plot_transfer_against_model(record)
    assert len(figures) == 3
    assert "measured" in summary and "predicted" in summary and "test double" in summary


def test_a_host_that_waits_wakes_sync_s_after_the_work_it_waited_for():
    """A blocking copy returns ``sync_s`` after its copy ends, and the events around it see that (the end
    event is recorded once the call returns); a non_blocking one is unchanged. Without ``sync_s``, as before."""
    woken = Inputs(link_GBps=16.0, stage_GBps=6.0, api_s=5e-6, sync_s=20e-6)
    for pinned in (True, False):
        call = stream_scenarios.single_copy(woken, 1 * MB, pinned=pinned, non_blocking=False)
        assert call.returned == pytest.approx(call.end + 20e-6)
        plain = stream_scenarios.single_copy(INPUTS, 1 * MB, pinned=pinned, non_blocking=False)
        assert plain.returned == pytest.approx(plain.end)
    rows = {r["mode"]: r for r in stream_scenarios.predicted_bandwidth(woken, [1 * MB])}
    before = {r["mode"]: r for r in stream_scenarios.predicted_bandwidth(INPUTS, [1 * MB])}
    assert rows["pinned"]["time_s"] == pytest.approx(before["pinned"]["time_s"] + 20e-6)
    assert rows["pinned+non_blocking"]["time_s"] == pytest.approx(before["pinned+non_blocking"]["time_s"])
    m = StreamModel(woken)  # every wait for the device: an event, a stream, the device
    m.kernel("k", 0.001)
    m.record("done")
    m.event_synchronize("done")
    assert m.now == pytest.approx(woken.api_s + 0.001 + 20e-6)  # the kernel's end, then the wake-up
    m.synchronize()  # nothing left to wait for: no wake-up
    assert m.now == pytest.approx(woken.api_s + 0.001 + 20e-6)


def test_a_pageable_source_too_large_for_the_caches_is_staged_at_the_dram_rate():
    dram = Inputs(link_GBps=50.0, stage_GBps=12.0, stage_dram_GBps=7.0, cache_bytes=16 * MB)
    assert dram.stage_rate(16 * MB) == 12.0 and dram.stage_rate(64 * MB) == 7.0
    assert INPUTS.stage_rate(1 << 40) == INPUTS.stage_GBps  # no cache size: one rate
    staged = lambda n: sum(
        i.duration for i in stream_scenarios.single_copy(dram, n, pinned=False, non_blocking=True).device
    )
    for size, rate in ((16 * MB, 12.0), (64 * MB, 7.0)):
        m = StreamModel(dram)
        m.copy_h2d("x", size, pinned=False, non_blocking=False)
        assert sum(i.duration for i in m.intervals if i.kind == "stage") == pytest.approx(size / (rate * 1e9))
    assert staged(64 * MB) == pytest.approx(64 * MB / 50e9)  # the link's share does not change
    assert "from DRAM" in dram.describe() and "from DRAM" not in INPUTS.describe()


def test_the_cache_size_is_where_a_pageable_clone_slows_down():
    clone = lambda pairs: [{"bytes": n * MB, "pageable_clone_s": s} for n, s in pairs]
    assert stream_results.cache_bytes_from(clone([(1, 14.5e-6), (16, 237e-6), (64, 3.6e-3), (256, 14.4e-3)])) == 16 * MB
    assert stream_results.cache_bytes_from(clone([(1, 1e-4), (4, 4e-4), (16, 1.6e-3)])) is None  # no drop
    assert stream_results.cache_bytes_from([]) is None


# The H200's host-to-device copies, as measured on 2026-11-27 (shared/gpu-runs/2026-11-27-h200/run2-probe/
# copies.json, rank 0): KiB, mode, time between the CUDA events (us), time the call blocked the host (us).
H200_H2D = [
    (64, "pageable", 35.68, 43.26),
    (64, "pageable+non_blocking", 26.40, 34.91),
    (64, "pinned", 18.66, 25.55),
    (64, "pinned+non_blocking", 11.36, 18.46),
    (256, "pageable", 50.94, 63.20),
    (256, "pageable+non_blocking", 38.18, 49.15),
    (256, "pinned", 31.46, 41.75),
    (256, "pinned+non_blocking", 18.62, 29.58),
    (1024, "pageable", 140.16, 157.55),
    (1024, "pageable+non_blocking", 112.51, 131.14),
    (1024, "pinned", 53.06, 69.62),
    (1024, "pinned+non_blocking", 35.90, 41.24),
    (4096, "pageable", 461.70, 476.05),
    (4096, "pageable+non_blocking", 420.29, 433.42),
    (4096, "pinned", 116.90, 127.30),
    (4096, "pinned+non_blocking", 97.57, 29.80),
    (16384, "pageable", 1575.62, 1590.86),
    (16384, "pageable+non_blocking", 1478.46, 1498.55),
    (16384, "pinned", 343.46, 354.98),
    (16384, "pinned+non_blocking", 311.78, 29.70),
    (65536, "pageable", 10317.57, 10343.59),
    (65536, "pageable+non_blocking", 8204.67, 8216.79),
    (65536, "pinned", 1264.32, 1280.49),
    (65536, "pinned+non_blocking", 1229.98, 57.81),
    (262144, "pageable", 31845.44, 31858.74),
    (262144, "pageable+non_blocking", 36821.82, 36851.48),
    (262144, "pinned", 4893.98, 4908.17),
    (262144, "pinned+non_blocking", 4864.29, 45.71),
]
H200_CLONE_S = [(1, 14.5e-6), (4, 24.4e-6), (16, 237.4e-6), (64, 3613.5e-6), (256, 14429.6e-6)]  # pinning_cost
H200_HOST = {  # the same machine's distlab.bench.host (run2-probe/host.json): 64 MiB staged, 64 MiB copied
    "staging_copy": [{"bytes": 64 * MB, "chunk_bytes": 2 * MB, "GBps": 11.876245690779411}],
    "memory_copy": {"bytes": 64 * MB, "GBps": 7.002712540512028},
}


def _h200_record() -> dict:
    rows = [
        {"bytes": k << 10, "direction": "h2d", "mode": mode, "time_s": t * 1e-6, "host_blocked_s": h * 1e-6,
         "GBps": (k << 10) / (t * 1e-6) / 1e9}
        for k, mode, t, h in H200_H2D
    ]  # fmt: skip
    clone = [{"bytes": n * MB, "pageable_clone_s": s} for n, s in H200_CLONE_S]
    return {"metrics": {"ranks": [{"rank": 0, "gpu": "NVIDIA H200", "bandwidth": rows, "pinning_cost": clone}]}}


def test_the_model_predicts_the_h200_copies_from_that_machines_own_inputs():
    """Issue 34: fed from the H200's own measurements the model missed the 256 MiB pageable copy by +41 % and the
    1 MiB blocking pinned copy by +41 %. What it lacked: the host's wake-up after cudaStreamSynchronize (the end
    event of a blocking copy is recorded only then), and the staging rate of a source the caches do not keep
    (a 256 MiB source streams from DRAM; bench.host's staging copy keeps its destination in the caches)."""
    record, host = _h200_record(), {"metrics": H200_HOST}
    inputs = stream_results.inputs_from_transfer_result(record, host=host)
    assert inputs.sync_s == pytest.approx(19.33e-6, abs=0.01e-6)  # blocking less non_blocking pinned, median
    assert inputs.cache_bytes == 16 * MB and inputs.stage_dram_GBps == pytest.approx(7.0, abs=0.01)
    assert inputs.stage_GBps == pytest.approx(11.88, abs=0.01) and inputs.link_GBps == pytest.approx(54.85, abs=0.01)
    table = {(r["bytes"], r["mode"]): r for r in stream_results.bandwidth_table(record, host=host)}
    named = [(256 * MB, "pageable"), (16 * MB, "pageable"), (1 * MB, "pinned")]
    assert [table[p]["before_GBps"] for p in named] == pytest.approx([11.9, 11.4, 27.9], abs=0.06)  # the issue's
    assert table[256 * MB, "pageable"]["before_error"] > 0.35 and table[1 * MB, "pinned"]["before_error"] > 0.35
    for point, row in table.items():
        if point[0] >= 1 * MB:  # the 256 MiB pageable copy: 8.4 GB/s blocking, 7.3 non_blocking, the same staging
            assert abs(row["after_error"]) < 0.18, (point, row)
    large = [abs(r["after_error"]) for p, r in table.items() if p[0] >= 1 * MB]
    assert sum(large) / len(large) < 0.07
    assert "| 256 MiB | pageable |" in stream_results.markdown_table(list(table.values()))
