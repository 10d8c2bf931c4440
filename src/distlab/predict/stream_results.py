"""The stream model (:mod:`.streams`) fed from result files: its inputs from the host benchmark and the
transfer benchmark, and its prediction of each transfer result, mode by mode.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .stream_scenarios import VARIANTS, d2h_read_hazard, overlap_experiment, predicted_bandwidth, step_time
from .streams import Inputs


def inputs_from_host_result(
    record: dict, link_GBps: float, link_source: str, chunk_bytes: int = 2 << 20, **overrides
) -> Inputs:
    """Model inputs from a :mod:`distlab.bench.host` result (the staging rate and the call time
    measured on that CPU) and a link rate with its source."""
    from ..results import hardware_label  # the label only; nothing here needs torch otherwise

    metrics = record["metrics"]
    rows = metrics["staging_copy"]
    row = next((r for r in rows if r["chunk_bytes"] == chunk_bytes), max(rows, key=lambda r: r["chunk_bytes"]))
    where = hardware_label(record["environment"]).removesuffix(" (no backend)")
    values = dict(
        link_GBps=link_GBps,
        stage_GBps=row["GBps"],
        api_s=metrics["dispatch"]["time_s"],
        chunk_bytes=row["chunk_bytes"],
        sources={
            "link_GBps": link_source,
            "stage_GBps": f"measured: {row['chunk_bytes'] >> 20} MiB chunks, {where}",
            "api_s": f"measured: one tiny torch call, {where}",
        },
    )
    values.update(overrides)
    return Inputs(**values)


def inputs_from_transfer_result(record: dict, rank: int = 0) -> Inputs | None:
    """Model inputs from a GPU result of :mod:`distlab.bench.transfer`, all measured on that
    machine: the link rate (the largest pinned copy), the fixed cost of a copy (the smallest pinned
    copy, less its bytes at that rate), the call overhead (how long a ``non_blocking`` pinned copy
    blocked the host) and, when the result holds the host's figures, the staging rate. The
    pageable rows are *not* inputs: they are what the model predicts. None without the rows."""
    measured = record["metrics"]["ranks"][rank]
    rows = [r for r in measured.get("bandwidth", []) if r["direction"] == "h2d"]
    pinned = sorted((r for r in rows if r["mode"] == "pinned"), key=lambda r: r["bytes"])
    quick = sorted((r for r in rows if r["mode"] == "pinned+non_blocking"), key=lambda r: r["bytes"])
    if not pinned or not quick:
        return None
    link, api_s = pinned[-1]["GBps"], quick[0]["host_blocked_s"]
    # events bracket the call, so a copy's time holds the call's own overhead too
    latency = max(0.0, pinned[0]["time_s"] - pinned[0]["bytes"] / (link * 1e9) - api_s)
    host_side = record["metrics"].get("host")
    stage = None
    if host_side:
        staged_rows = host_side["staging_copy"]
        stage = next((r for r in staged_rows if r["chunk_bytes"] == 2 << 20), staged_rows[-1])["GBps"]
    size = lambda n: f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
    return Inputs(
        link_GBps=link,
        stage_GBps=stage or math.nan,
        api_s=api_s,
        copy_latency_s=latency,
        sources={
            "link_GBps": f"measured: pinned copy of {size(pinned[-1]['bytes'])}",
            "stage_GBps": "measured on that host" if stage else "not in this result",
            "api_s": f"measured: a non_blocking pinned copy of {size(quick[0]['bytes'])}",
            "copy_latency_s": f"measured: pinned copy of {size(pinned[0]['bytes'])}",
        },
    )


def predict_transfer_result(record: dict, rank: int = 0) -> dict | None:
    """What the model predicts for each experiment in a GPU result, from inputs measured in that
    same result (:func:`inputs_from_transfer_result`), next to what was measured."""
    inputs = inputs_from_transfer_result(record, rank)
    if inputs is None:
        return None
    measured = record["metrics"]["ranks"][rank]
    sizes = sorted({r["bytes"] for r in measured["bandwidth"]})
    staged = not math.isnan(inputs.stage_GBps)
    out: dict = {"inputs": inputs, "bandwidth": predicted_bandwidth(inputs, sizes) if staged else []}
    if not staged:  # without the host's staging rate only the pinned rows can be predicted
        out["bandwidth"] = [
            r for r in predicted_bandwidth(replace(inputs, stage_GBps=1.0), sizes) if r["mode"].startswith("pinned")
        ]
    overlap = measured.get("overlap")
    if overlap:
        serial = overlap["timeline"]["serial"]

        def median(lane: str) -> float:
            durations = sorted(i["dur_ms"] for i in serial if i["lane"] == lane)
            return durations[len(durations) // 2] / 1e3

        copy_s, compute_s = median("copy"), median("compute")
        model = replace(inputs, link_GBps=overlap["batch_bytes"] / copy_s / 1e9, copy_latency_s=0.0)
        timelines = {
            key: overlap_experiment(
                model,
                batches=overlap["batches"],
                batch_bytes=overlap["batch_bytes"],
                compute_s=compute_s,
                overlapped=key,
            )
            for key in (False, True)
        }
        out["overlap"] = {
            "copy_s": copy_s,
            "compute_s": compute_s,
            "serial": timelines[False],
            "overlapped": timelines[True],
            "predicted_speedup": timelines[False].end / timelines[True].end,
            "measured_speedup": overlap["serial_s"] / overlap["overlapped_s"],
        }
    hazard = measured.get("non_blocking_hazard")
    if hazard:
        early, _ = d2h_read_hazard(inputs, nbytes=hazard["numel"] * 4, compute_s=1e-3).reads
        out["hazard"] = {"predicted_stale": early.stale, "measured_stale": hazard["early_read_was_wrong"]}
    loader = {row["variant"]: row for row in record["metrics"].get("loader") or []}
    if staged and "device-resident" in loader:
        batch = loader["device-resident"]["config"]["training"]["batch_size"]
        batch_bytes = batch * (28 * 28 * 4 + 8)  # float32 MNIST-shaped images and int64 labels
        world = record["environment"].get("world_size", 1)
        compute_s = batch * world / loader["device-resident"]["samples_per_s"]  # a step with no copy at all
        kwargs = dict(batch_bytes=batch_bytes, compute_s=compute_s)
        base = step_time(inputs, "pageable", **kwargs)
        out["loader"] = {
            "compute_s": compute_s,
            "batch_bytes": batch_bytes,
            "predicted": {name: base / step_time(inputs, name, **kwargs) for name in VARIANTS},
        }
    return out
