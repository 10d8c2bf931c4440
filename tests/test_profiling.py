"""The profiling chapter (book/profiling.md): the reader of a profiler trace (its lanes on a CPU trace and on a GPU
trace written by hand, its one-line errors), the exposed communication against a brute-force count, the picture,
the launcher's quiet about Kineto's banners, and the page's program on two gloo ranks (slow)."""

from __future__ import annotations

import io
import json
import random
import struct
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.exercises.profiling import STEPS  # noqa: E402
from distlab.jobs import is_torchrun_noise  # noqa: E402
from distlab.measure import profile  # noqa: E402
from support import run_page_program  # noqa: E402

MAIN, GLOO = 11, 12  # thread ids


def _x(name, ts, dur, tid=MAIN, cat="cpu_op", **more):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat, **more}


def _write(tmp_path: Path, events: list[dict], name="trace.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}, *events]}))
    return path


def test_a_cpu_trace_is_read_as_the_main_threads_ops_and_glooss_collectives_clipped_to_each_step(tmp_path):
    events = [
        _x("ProfilerStep#1", 1000, 10_000, cat="user_annotation"),
        _x("ProfilerStep#2", 11_000, 10_000, cat="user_annotation"),
        _x("aten::mm", 2000, 3000),  # step 1
        _x("aten::mm", 12_000, 4000),  # step 2: 1 to 5 ms
        _x("aten::add_", 12_500, 1000),  # nested in the mm
        _x("gloo:all_reduce", 15_000, 3000, tid=GLOO, cat="user_annotation"),  # 4 to 7 ms
        _x("gloo:all_reduce", 20_000, 5000, tid=GLOO, cat="user_annotation"),  # 9 to 10 ms: clipped at the step
        _x("aten::copy_", 13_000, 500, tid=GLOO),  # an op on gloo's thread: not the rank's compute
        _x("c10d::allreduce_", 14_000, 100),  # the call that started it: neither lane
        _x("DistributedDataParallel.forward", 12_000, 2000, cat="python_function"),
    ]
    first, last = profile.read_steps(_write(tmp_path, events))
    assert (first["step"], last["step"], last["step_ms"]) == ("ProfilerStep#1", "ProfilerStep#2", 10.0)
    assert [(e["name"], e["lane"], e["start_ms"], e["end_ms"]) for e in last["events"]] == [
        ("aten::mm", "compute", 1.0, 5.0),
        ("aten::add_", "compute", 1.5, 2.5),
        ("gloo:all_reduce", "communication", 4.0, 7.0),
        ("gloo:all_reduce", "communication", 9.0, 10.0),
    ]
    assert profile.step_time(last) == {
        "step_ms": 10.0, "compute_ms": 4.0, "communication_ms": 4.0, "overlapped_ms": 1.0, "exposed_ms": 3.0,
    }  # fmt: skip
    assert profile.read_step(_write(tmp_path, events))["step"] == "ProfilerStep#2"


def test_a_gpu_trace_is_read_from_its_kernels_nccls_as_communication(tmp_path):
    """The GPU path of the reader, on a trace written as torch.profiler writes one with CUDA activities; the GPU
    tier reads a real one (tests/test_gpu_profiling.py)."""
    events = [
        _x("ProfilerStep#3", 0, 10_000, cat="user_annotation"),
        _x("aten::mm", 100, 50),  # the CPU only launched the kernel: not compute on a GPU
        _x("cudaLaunchKernel", 120, 10, cat="cuda_runtime"),
        _x("ampere_sgemm_128x64_tn", 1000, 4000, tid=7, cat="kernel", args={"stream": 7}),
        _x(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            3000,
            5000,
            tid=20,
            cat="kernel",
            args={"stream": 20},
        ),  # fmt: skip
        _x("gloo:all_reduce", 9000, 500, tid=GLOO, cat="user_annotation"),  # gloo beside a GPU: on the CPU
    ]
    (step,) = profile.read_steps(_write(tmp_path, events))
    assert [(e["name"].split("_")[0], e["lane"]) for e in step["events"]] == [
        ("ampere", "compute"), ("ncclDevKernel", "communication"), ("gloo:all", "communication"),
    ]  # fmt: skip
    assert profile.step_time(step)["exposed_ms"] == pytest.approx(3.5)  # 5 to 8 ms, and gloo's 0.5 ms


def test_a_file_that_is_not_a_trace_or_has_no_step_is_one_line_that_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="not a profiler trace .*export_chrome_trace"):
        profile.read_steps(tmp_path / "missing.json")
    no_step = _write(tmp_path, [_x("aten::mm", 0, 10)])
    with pytest.raises(ValueError, match=r"no ProfilerStep# event: profile with schedule=.* prof\.step\(\)") as raised:
        profile.read_steps(no_step)
    assert "\n" not in str(raised.value)


def _exposed_by_the_grid(events: list[dict], step_ms: float, grid: int = 4) -> float:
    """The exposed time counted moment by moment on a grid of 1/grid ms (the events' ends lie on it)."""
    ticks = 0
    for tick in range(int(step_ms * grid)):
        moment = (tick + 0.5) / grid
        running = {e["lane"] for e in events if e["start_ms"] <= moment < e["end_ms"]}
        ticks += running == {"communication"}
    return ticks / grid


def test_the_exposed_time_is_what_a_moment_by_moment_count_finds():
    rng = random.Random(0)
    for _ in range(300):
        events = []
        for _ in range(rng.randint(0, 12)):
            start = rng.randint(0, 79) / 4
            events.append({"name": "e", "lane": rng.choice(["compute", "communication"]), "start_ms": start,
                           "end_ms": start + rng.randint(1, 24) / 4})  # fmt: skip
        step = {"step_ms": 30.0, "events": events}
        expected = _exposed_by_the_grid(events, 30.0)
        assert profile.step_time(step)["exposed_ms"] == pytest.approx(expected)
        assert sum(end - start for start, end in profile.exposed_intervals(step)) == pytest.approx(expected)
    for _, step_ms, events in STEPS:
        assert profile.step_time({"step_ms": step_ms, "events": events})["exposed_ms"] == _exposed_by_the_grid(
            events, step_ms
        )


def test_the_picture_draws_the_exposed_intervals_and_labels_the_sums_within_the_column():
    _, step_ms, events = STEPS[0]
    step = {"step_ms": step_ms, "events": events}
    fig, ax = plt.subplots(figsize=(6.4, 1.9))
    plots.plot_profiled_step(step, ax, title="a schedule")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["compute 16.0 ms", "communication 8.0 ms", "exposed 4.0 ms"]
    exposed_bars = ax.collections[2].get_paths()
    assert [(p.vertices[:, 0].min(), p.vertices[:, 0].max()) for p in exposed_bars] == [(14.0, 18.0)]
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    assert struct.unpack(">I", buffer.getvalue()[16:20])[0] <= 688
    assert min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 9
    plt.close(fig)


def test_the_launcher_hides_kinetos_banners_and_nothing_else():
    hidden = [
        "USDT:2026-12-07 17:08:27 3437:3437 SyncActivityProfilerHandler.cpp:39] profiler_start",
        "USDT:2026-12-07 17:08:27 3438:3438 SyncActivityProfilerHandler.cpp:46] profiler_stop",
        "ERROR:2026-12-07 17:02:46 1564:1564 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35",
    ]
    shown = ["ddp, rank 0, three steps, the operations by the time spent in each:",
             "ERROR:2026-12-07 17:02:46 1564:1564 CuptiActivityApi.cpp:12] CUPTI_ERROR_NOT_INITIALIZED",
             "                          gloo:all_reduce        13.02%      68.233ms"]  # fmt: skip
    assert all(is_torchrun_noise(line) for line in hidden)
    assert not any(is_torchrun_noise(line) for line in shown)


@pytest.mark.slow
def test_the_pages_program_writes_a_trace_a_rank_with_three_steps_of_compute_and_communication(tmp_path):
    job = run_page_program("profiling.md", "profile_step.py", tmp_path, files_needed=True)  # it reads the traces
    assert job.stdout.count("the operations by the time spent in each") == 2  # rank 0's two tables, no other rank's
    assert "ProfilerStep*" in job.stdout and "aten::mm" in job.stdout and "FSDP::all_gather" in job.stdout
    for name in ("ddp", "fsdp2"):
        for rank in (0, 1):
            steps = profile.read_steps(tmp_path / f"trace-{name}-rank{rank}.json")
            assert [s["step"] for s in steps] == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
            for step in steps:
                names = {e["name"] for e in step["events"] if e["lane"] == "communication"}
                assert names == ({"gloo:all_reduce"} if name == "ddp" else {"gloo:all_gather", "gloo:all_reduce"})
                added = profile.step_time(step)
                assert 0 < added["compute_ms"] <= added["step_ms"]
                assert 0 <= added["exposed_ms"] <= added["communication_ms"] <= added["step_ms"]
    ddp_overlap = [profile.step_time(s)["overlapped_ms"] for s in profile.read_steps(tmp_path / "trace-ddp-rank0.json")]
    assert max(ddp_overlap) > 0, "DDP's first buckets reduce while backward runs"
