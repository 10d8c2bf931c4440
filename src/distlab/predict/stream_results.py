"""The stream model (:mod:`.streams`) fed from result files: its inputs from the host benchmark and the
transfer benchmark, and its prediction of each transfer result, mode by mode, fitted on the whole run and with
each copy size left out of its own fit (:func:`leave_one_out_inputs`).
"""

from __future__ import annotations

import copy
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


CACHE_CLIFF = 2.0
"""How many times faster than the largest one a ``clone()`` must run for its source to count as cache-resident."""


def cache_bytes_from(pinning_cost: list[dict]) -> int | None:
    """The largest size whose pageable ``clone()`` (:func:`distlab.bench.transfer.pinning_cost`, the same host)
    ran ``CACHE_CLIFF`` times faster than the largest size's, whose source and copy stream from DRAM: the
    largest buffer the host's caches kept between repetitions, as far as these sizes tell. None without rows or
    without such a drop (every size behaved alike)."""
    rows = sorted((r for r in pinning_cost or [] if r.get("pageable_clone_s")), key=lambda r: r["bytes"])
    if len(rows) < 2:
        return None
    rate = lambda r: r["bytes"] / r["pageable_clone_s"]
    cached = [r["bytes"] for r in rows[:-1] if rate(r) >= CACHE_CLIFF * rate(rows[-1])]
    return max(cached) if cached else None


def _host_rates(metrics: dict, chunk_bytes: int = 2 << 20) -> dict:
    """The staging rate (``chunk_bytes`` buffers) and the DRAM-to-DRAM copy rate of a bench.host result."""
    rows = metrics["staging_copy"]
    row = next((r for r in rows if r["chunk_bytes"] == chunk_bytes), rows[-1])
    plain = metrics.get("memory_copy")
    return {"stage": row, "dram": plain}


def inputs_from_transfer_result(record: dict, rank: int = 0, host: dict | None = None) -> Inputs | None:
    """Model inputs from a GPU result of :mod:`distlab.bench.transfer`, all measured on that machine:

    * the link rate: the largest pinned copy;
    * the call overhead: how long a ``non_blocking`` pinned copy blocked the host (the smallest);
    * the fixed cost of a copy: the smallest ``non_blocking`` pinned copy, less its bytes at that rate and the call;
    * the wake-up after a wait (``sync_s``): a blocking pinned copy's time less a ``non_blocking`` one's of the
      same size (the end event is recorded only once the host has woken from ``cudaStreamSynchronize``), the
      median over the sizes;
    * the staging rates, where the result holds the host's figures (or ``host``, a :mod:`distlab.bench.host`
      result from the same machine, is given): the staging copy into a 2 MiB buffer, and for sources the caches
      do not keep (over :func:`cache_bytes_from` the result's ``pin_memory()`` rows) the copy between two
      64 MiB buffers, both sides in DRAM.

    The pageable rows are *not* inputs: they are what the model predicts. None without the rows."""
    measured = record["metrics"]["ranks"][rank]
    rows = [r for r in measured.get("bandwidth", []) if r["direction"] == "h2d"]
    pinned = sorted((r for r in rows if r["mode"] == "pinned"), key=lambda r: r["bytes"])
    quick = sorted((r for r in rows if r["mode"] == "pinned+non_blocking"), key=lambda r: r["bytes"])
    if not pinned or not quick:
        return None
    link, api_s = pinned[-1]["GBps"], quick[0]["host_blocked_s"]
    # events bracket the call, so a copy's time holds the call's own overhead too
    latency = max(0.0, quick[0]["time_s"] - quick[0]["bytes"] / (link * 1e9) - api_s)
    blocking = {r["bytes"]: r["time_s"] for r in pinned}
    waits = sorted(max(0.0, blocking[r["bytes"]] - r["time_s"]) for r in quick if r["bytes"] in blocking)
    sync_s = waits[len(waits) // 2] if waits else 0.0
    size = lambda n: f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
    host_side = (host or {}).get("metrics") or record["metrics"].get("host")
    where = "bench.host on that machine" if host else "on that host, by the same run"
    values: dict = dict(
        link_GBps=link,
        stage_GBps=math.nan,
        api_s=api_s,
        copy_latency_s=latency,
        sync_s=sync_s,
        sources={
            "link_GBps": f"measured: pinned copy of {size(pinned[-1]['bytes'])}",
            "stage_GBps": "not in this result",
            "api_s": f"measured: a non_blocking pinned copy of {size(quick[0]['bytes'])}",
            "copy_latency_s": f"measured: non_blocking pinned copy of {size(quick[0]['bytes'])}",
            "sync_s": f"measured: blocking less non_blocking pinned copies, median of {len(waits)} sizes",
        },
    )
    if host_side:
        rates = _host_rates(host_side)
        values["stage_GBps"] = rates["stage"]["GBps"]
        values["sources"]["stage_GBps"] = f"measured: {size(rates['stage']['chunk_bytes'])} buffers, {where}"
        cache = cache_bytes_from(measured.get("pinning_cost"))
        if rates["dram"] and cache is not None:
            values["stage_dram_GBps"] = rates["dram"]["GBps"]
            values["cache_bytes"] = cache
            values["sources"]["stage_dram_GBps"] = (
                f"measured: {size(rates['dram']['bytes'])} to {size(rates['dram']['bytes'])}, {where}"
            )
            values["sources"]["cache_bytes"] = "measured: pageable clone() rates of the same run"
    return Inputs(**values)


def without_host_terms(inputs: Inputs) -> Inputs:
    """``inputs`` as the model took them before the wake-up after a wait and the DRAM staging rate
    (issue 34): what the "before" columns of :func:`bandwidth_table` predict."""
    return replace(inputs, sync_s=0.0, stage_dram_GBps=None, cache_bytes=None)


def without_size(record: dict, size: int, rank: int = 0) -> dict:
    """A copy of a GPU transfer result with everything ``rank`` measured at ``size`` bytes taken out: its copies
    in both directions and its ``pin_memory()``/``clone()`` timing (which places the cache threshold). What is left
    is what :func:`leave_one_out_inputs` may fit on."""
    out = copy.deepcopy(record)
    measured = out["metrics"]["ranks"][rank]
    measured["bandwidth"] = [r for r in measured.get("bandwidth", []) if r["bytes"] != size]
    if measured.get("pinning_cost"):
        measured["pinning_cost"] = [r for r in measured["pinning_cost"] if r["bytes"] != size]
    return out


def leave_one_out_inputs(record: dict, size: int, rank: int = 0, host: dict | None = None) -> Inputs | None:
    """The model's inputs found on every copy size of the run but ``size`` (:func:`without_size`): the link rate,
    the call and copy latency, the wake-up after a wait and the cache threshold, none of them from a copy of
    ``size``. The host's staging rates come from :mod:`distlab.bench.host`, a separate experiment, and stay."""
    return inputs_from_transfer_result(without_size(record, size, rank), rank, host)


def bandwidth_table(record: dict, rank: int = 0, host: dict | None = None) -> list[dict]:
    """Each host-to-device row of a GPU transfer result, measured, next to three predictions of the model; errors
    are predicted over measured, less one.

    * ``before``: fitted on the whole run (:func:`inputs_from_transfer_result`, ``host`` as there), without the
      wake-up after a wait and the DRAM staging rate (:func:`without_host_terms`);
    * ``after``: fitted on the whole run, with both: in-sample, a fit of the very copies it is compared with;
    * ``held_out``: the same model with its inputs found on the other copy sizes only
      (:func:`leave_one_out_inputs`): the error on a copy it was not fitted to."""
    inputs = inputs_from_transfer_result(record, rank, host)
    if inputs is None or math.isnan(inputs.stage_GBps):
        return []
    measured = [r for r in record["metrics"]["ranks"][rank]["bandwidth"] if r["direction"] == "h2d"]
    sizes = sorted({r["bytes"] for r in measured})
    guess = {
        key: {(r["bytes"], r["mode"]): r["GBps"] for r in predicted_bandwidth(model, sizes)}
        for key, model in (("before", without_host_terms(inputs)), ("after", inputs))
    }
    guess["held_out"] = {}
    for size in sizes:
        model = leave_one_out_inputs(record, size, rank, host)
        if model is not None:
            guess["held_out"].update({(r["bytes"], r["mode"]): r["GBps"] for r in predicted_bandwidth(model, [size])})
    out = []
    for row in measured:
        point = (row["bytes"], row["mode"])
        line = {"bytes": row["bytes"], "mode": row["mode"], "measured_GBps": row["GBps"]}
        for key in ("before", "after", "held_out"):
            if point in guess[key]:
                line[f"{key}_GBps"] = guess[key][point]
                line[f"{key}_error"] = guess[key][point] / row["GBps"] - 1
        out.append(line)
    return out


def error_summary(rows: list[dict], key: str, at_least: int = 0) -> dict:
    """The ``key`` errors (``before``, ``after``, ``held_out``) of :func:`bandwidth_table`'s rows of ``at_least``
    bytes: how many, the mean and the largest magnitude, and the row with the largest."""
    found = [r for r in rows if r["bytes"] >= at_least and f"{key}_error" in r]
    if not found:
        return {"rows": 0, "mean_abs": math.nan, "max_abs": math.nan, "worst": None}
    worst = max(found, key=lambda r: abs(r[f"{key}_error"]))
    mean = sum(abs(r[f"{key}_error"]) for r in found) / len(found)
    return {"rows": len(found), "mean_abs": mean, "max_abs": abs(worst[f"{key}_error"]), "worst": worst}


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def error_claims(record: dict, rank: int = 0, host: dict | None = None, at_least: int = 1 << 20) -> dict | None:
    """What the chapter says of the model's errors on one GPU transfer result (``rank``, ``host`` as in
    :func:`bandwidth_table`), as numbers, and why the worst copy left out misses, where the data say why.

    * ``rows``: :func:`bandwidth_table`;
    * ``fit`` and ``held_out``: :func:`error_summary` of the copies of ``at_least`` bytes and more, fitted with the
      two host terms (in-sample) and with each size left out of its own fit;
    * ``small_fit`` and ``small_held_out``: the same for the smaller copies;
    * ``cache_bytes``: the cache threshold fitted on the whole run (``"fit"``) and with the worst left-out copy's
      size left out (``"held_out"``);
    * ``why``: where the whole run's threshold keeps that size in the caches and the threshold found without it
      falls below it, a sentence saying so: left out, the model stages that source at the DRAM rate. Otherwise
      empty.

    None where the result cannot be predicted (no copies, or no host staging rate)."""
    rows = bandwidth_table(record, rank, host)
    if not rows:
        return None
    large = [r for r in rows if r["bytes"] >= at_least]
    small = [r for r in rows if r["bytes"] < at_least]
    out = {
        "rows": rows,
        "fit": error_summary(large, "after"),
        "held_out": error_summary(large, "held_out"),
        "small_fit": error_summary(small, "after"),
        "small_held_out": error_summary(small, "held_out"),
        "cache_bytes": {"fit": None, "held_out": None},
        "why": "",
    }
    worst = out["held_out"]["worst"]
    if worst is None:
        return out
    fitted = inputs_from_transfer_result(record, rank, host)
    left_out = leave_one_out_inputs(record, worst["bytes"], rank, host)
    out["cache_bytes"] = {"fit": fitted.cache_bytes, "held_out": left_out.cache_bytes if left_out else None}
    fit_cache, held_cache = out["cache_bytes"]["fit"], out["cache_bytes"]["held_out"]
    # the explanation holds only where the size's own clone() put it inside the caches and, left out, below them
    if fit_cache is not None and held_cache is not None and held_cache < worst["bytes"] <= fit_cache:
        out["why"] = (
            f"Left out, the {_size(worst['bytes'])} `clone()` no longer marks a {_size(worst['bytes'])} source as "
            f"kept in the caches: the threshold falls to {_size(held_cache)}, and the model stages that source at the "
            "DRAM rate. Where the caches end is read from one size's timing."
        )
    return out


def markdown_table(rows: list[dict]) -> str:
    """:func:`bandwidth_table`'s rows as a Markdown table: measured, the two fits, and the size left out."""
    size = lambda n: f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
    cell = lambda r, key: f"{r[key + '_GBps']:.2f} | {r[key + '_error']:+.0%}" if key + "_GBps" in r else "- | -"
    lines = [
        "| size | mode | measured GB/s | fit without the two terms | error | fit with them | error | "
        "size left out of the fit | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {size(r['bytes'])} | {r['mode']} | {r['measured_GBps']:.2f} | {cell(r, 'before')} | "
            f"{cell(r, 'after')} | {cell(r, 'held_out')} |"
        )
    return "\n".join(lines)


def predict_transfer_result(record: dict, rank: int = 0, host: dict | None = None) -> dict | None:
    """What the model predicts for each experiment in a GPU result, from inputs measured in that
    same result (:func:`inputs_from_transfer_result`; ``host`` as there), next to what was measured."""
    inputs = inputs_from_transfer_result(record, rank, host)
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
