"""Where one training step's time went, read from the trace ``torch.profiler`` writes on each rank.

    with torch.profiler.profile(schedule=torch.profiler.schedule(wait=1, warmup=1, active=1)) as prof:
        for batch in batches:
            train_step(batch)
            prof.step()
    prof.export_chrome_trace(f"trace-rank{rank}.json")

:func:`read_steps` turns a trace into intervals on two lanes, ms from the profiled step's start: **compute**, the
tensor operations (``aten::*``) of the thread that ran the step, and **communication**, gloo's collectives
(``gloo:*``, on gloo's own threads). A trace that holds GPU kernels is read from the kernels instead: NCCL's
kernels are communication, every other kernel compute (a GPU path: the GPU tier reads a real one, the default tier
a trace written by hand). :func:`step_time` adds them up; its ``exposed_ms`` is the communication that nothing hid:
the time during which a collective ran and no computation did, which the step waited for.
"""

from __future__ import annotations

import json
from pathlib import Path

COMPUTE = "compute"
COMMUNICATION = "communication"
STEP_PREFIX = "ProfilerStep#"  # the event torch.profiler's schedule wraps around each step it records
GPU_CATEGORIES = ("kernel",)


def read_steps(path: str | Path) -> list[dict]:
    """Every profiled step of one rank's trace (``prof.export_chrome_trace``), in order: ``{"step":
    "ProfilerStep#3", "step_ms": ..., "events": [{"name", "lane", "start_ms", "end_ms"}, ...]}``, each event
    clipped to its step, ms from the step's start."""
    path = Path(path)
    try:
        trace = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not a profiler trace ({error}): write one with prof.export_chrome_trace") from None
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith(STEP_PREFIX)), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(
            f"{path} has no {STEP_PREFIX} event: profile with schedule=torch.profiler.schedule(...) and call "
            "prof.step() after every step"
        )
    on_gpu = any(e.get("cat") in GPU_CATEGORIES for e in events)
    return [_one_step(step, events, on_gpu) for step in steps]


def read_step(path: str | Path) -> dict:
    """The last profiled step of one rank's trace (:func:`read_steps`)."""
    return read_steps(path)[-1]


def _one_step(step: dict, events: list[dict], on_gpu: bool) -> dict:
    start, end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
    found = []
    for event in events:
        lane = lane_of(event, step["tid"], on_gpu)
        clipped_start, clipped_end = max(float(event["ts"]), start), min(float(event["ts"]) + float(event["dur"]), end)
        if lane is not None and clipped_end > clipped_start:
            found.append(
                {
                    "name": event["name"],
                    "lane": lane,
                    "start_ms": (clipped_start - start) / 1e3,
                    "end_ms": (clipped_end - start) / 1e3,
                }
            )
    return {"step": step["name"], "step_ms": (end - start) / 1e3, "events": found}


def lane_of(event: dict, step_thread, on_gpu: bool) -> str | None:
    """``compute``, ``communication`` or None (neither: launches, Python, the profiler's own events)."""
    name = str(event.get("name", ""))
    if on_gpu:  # the work is the kernels: the CPU's ops only launched them
        if event.get("cat") not in GPU_CATEGORIES:
            return COMMUNICATION if name.startswith("gloo:") else None  # gloo beside a GPU runs on the CPU
        return COMMUNICATION if "nccl" in name.lower() else COMPUTE
    if name.startswith("gloo:"):
        return COMMUNICATION
    if event.get("cat") == "cpu_op" and event.get("tid") == step_thread and name.startswith("aten::"):
        return COMPUTE
    return None


def merged_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, end) intervals, overlapping ones merged: the time during which at least one of them runs."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def busy(events: list[dict], lane: str) -> list[tuple[float, float]]:
    """When ``lane`` was busy: its events' intervals, merged (ops nest, and gloo runs several collectives at once)."""
    return merged_intervals([(e["start_ms"], e["end_ms"]) for e in events if e["lane"] == lane])


def overlap_ms(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """How long two merged interval lists run at the same time."""
    return sum(
        max(0.0, min(a_end, b_end) - max(a_start, b_start)) for a_start, a_end in first for b_start, b_end in second
    )


def exposed_intervals(step: dict) -> list[tuple[float, float]]:
    """The moments of a step when a collective ran and no computation did: the communication lane's busy
    intervals with the compute lane's cut out."""
    exposed = []
    compute = busy(step["events"], COMPUTE)
    for start, end in busy(step["events"], COMMUNICATION):
        for c_start, c_end in compute:
            if c_end <= start or c_start >= end:
                continue
            if c_start > start:
                exposed.append((start, c_start))
            start = max(start, c_end)
            if start >= end:
                break
        if start < end:
            exposed.append((start, end))
    return exposed


def step_time(step: dict) -> dict:
    """A step from :func:`read_step`, added up (ms): its length, the time each lane was busy, the communication that
    ran under compute (``overlapped_ms``) and the communication nothing hid (``exposed_ms``)."""
    compute, communication = busy(step["events"], COMPUTE), busy(step["events"], COMMUNICATION)
    communication_ms = sum(end - start for start, end in communication)
    overlapped = overlap_ms(communication, compute)
    return {
        "step_ms": step["step_ms"],
        "compute_ms": sum(end - start for start, end in compute),
        "communication_ms": communication_ms,
        "overlapped_ms": overlapped,
        "exposed_ms": communication_ms - overlapped,
    }
