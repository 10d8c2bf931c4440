"""What a GPU report says at a glance, computed from the result files it holds.

Each function reads one result file's record and returns rows for ``report.json``'s ``summary``: the
collectives' bus bandwidth with their alpha-beta fit (the form the cost model uses) and the bus bandwidth
the course cites for this GPU, if any; host-to-device copy bandwidth; every strategy of the sweep against
the course's cost model with inputs from the same run (each point left out of its own fit, and the fit to every
point, named as one), and against the cost model run on cited specifications where the course has them for this
GPU; FSDP2's options against its defaults; BatchNorm against SyncBatchNorm.
"""

from __future__ import annotations

from typing import Any

from ..predict import costmodel, gpu_predictions
from ..predict.gpu_specs import System

system_for = gpu_predictions.system_for
"""The course's cited system whose GPU these are, or None: no prediction from another GPU's figures (an A100
80 GB, an H100 PCIe or an H200 NVL differs from the cited one)."""


def collectives(record: dict, system: System | None) -> list[dict]:
    """The largest size of each collective and implementation, with the fit over all sizes."""
    rows = record["metrics"]
    fits = costmodel.fit_collectives(rows)
    cited = None if system is None else {"all_reduce": system.allreduce_busbw, "all_gather": system.gather_busbw}
    out = []
    for (collective, impl), fit in fits.items():
        largest = max((r for r in rows if (r["collective"], r["impl"]) == (collective, impl)), key=lambda r: r["bytes"])
        n = record["environment"]["world_size"]
        bus = costmodel.RING_FACTOR[collective](n) / fit.beta_s_per_byte / 1e9 if fit.beta_s_per_byte else None
        out.append(
            {
                "collective": collective,
                "impl": impl,
                "bytes": largest["bytes"],
                "busbw_GBps": largest["busbw_GBps"],
                "fit_alpha_s": fit.alpha_s,
                "fit_bus_GBps": bus,  # None where time did not grow with size: no bandwidth to fit
                "cited_busbw_GBps": None if cited is None else cited.get(collective, system.gather_busbw) / 1e9,
            }
        )
    return out


def copies(record: dict, system: System | None) -> list[dict]:
    """Rank 0's host-to-device and device-to-host bandwidth at the largest size, pageable and pinned."""
    rows = record["metrics"]["ranks"][0]["bandwidth"]
    largest = max(r["bytes"] for r in rows)
    keep = ("bytes", "direction", "mode", "GBps")
    return [{k: r[k] for k in keep} for r in rows if r["bytes"] == largest]


def sweep(record: dict, system: System | None) -> list[dict]:
    """Every point of the sweep: measured; the cost model with this point left out of its fit
    (:func:`distlab.predict.costmodel.leave_one_out`: the model's test, where the run has enough points), and the
    same model fitted to every point, this one included (a fit: ``model_s``, ``error``), both from this run's
    inputs, with no overlap (the no-overlap end); the cited-specification range where the course has this GPU;
    the bytes the course counts at the peak, and CUDA's own counters, each strategy's alone or the whole
    process's (``cuda_alone``)."""
    n = record["environment"]["world_size"]
    # a preset can run at two sizes (launch-bound, then sized): a point is its preset, its size and its strategy
    # on one rank nothing is sent: what the arithmetic misses is each strategy's own cost, fitted on the same run
    overheads = costmodel.StrategyCosts.fit(record) if n == 1 else None
    evaluated = costmodel.evaluate(record, overheads)
    by_point = {(r["model"], r["tokens_per_rank"], r["variant"]): r for r in evaluated}
    left_out = {(r["model"], r["tokens_per_rank"], r["variant"]): r for r in costmodel.leave_one_out(record)}
    points = len(costmodel.calibrated(record["metrics"]["presets"]))
    cuda_alone = "cuda_memory_method" in record["metrics"]  # a sweep since a000737 takes each variant's peak alone
    out = []
    for preset in record["metrics"]["presets"]:
        for row in preset["variants"]:
            # the FSDP2 point ran no calibration copy: the cited-specification model is its only check
            key = (preset["model"], preset["tokens_per_rank"], row["variant"])
            point, test = by_point.get(key), left_out.get(key)
            cuda = row.get("cuda_memory") or []
            predicted = None
            if system is not None and row["variant"] in gpu_predictions.VARIANTS:
                guess = gpu_predictions.predict(
                    system, preset["model"], row["variant"], n, preset["tokens_per_rank"], preset["seq_len"]
                )
                predicted = [guess["step_s_best_overlap"], guess["step_s_no_overlap"]]
            out.append(
                {
                    "model": preset["model"],
                    "point": preset.get("point", ""),
                    "tokens_per_rank": preset["tokens_per_rank"],
                    **_achieved(record, preset, row, system),
                    "compute_over_fixed": _compute_over_fixed(record, preset, row["variant"], system),
                    "variant": row["variant"],
                    "ranks": n,
                    "measured_s": row["time_s"],
                    "model_s": None if point is None else point["predicted_s"],
                    "model_has_strategy_cost": overheads is not None,
                    "error": None if point is None else point["time_error"],
                    "left_out_s": None if test is None else test["predicted_s"],
                    "left_out_error": None if test is None else test["time_error"],
                    "calibrated_points": points,
                    "predicted_s": predicted,
                    "unpredicted": None if predicted or system is None else "DDP and FSDP2 only",
                    "counted_peak": max(rank["peak"] for rank in row["memory"]["ranks"]),
                    "cuda_max_allocated": max((r["max_allocated"] for r in cuda), default=None),
                    "cuda_max_reserved": max((r["max_reserved"] for r in cuda), default=None),
                    "cuda_alone": cuda_alone,
                }
            )
    return out


def _achieved(record: dict, preset: dict, row: dict, system: System | None) -> dict:
    """TFLOP/s a point achieved and its share of the GPU's cited dense peak: as the sweep recorded them, or, for a
    sweep written before it did, the course's FLOP count of the step over the measured time."""
    if row.get("tflops") is not None:
        return {"tflops": row["tflops"], "peak_share": row.get("peak_share")}
    rate = costmodel.training_flops(preset["model"], preset["tokens_per_rank"], preset["seq_len"]) / row["time_s"]
    precision = (record.get("config") or {}).get("precision")
    peak = system.gpu.peak_flops(precision) if system is not None and precision in ("bf16", "fp16") else None
    return {"tflops": rate / 1e12, "peak_share": rate / peak if peak else None}


def _compute_over_fixed(record: dict, preset: dict, variant: str, system: System | None) -> float | None:
    """The course's prediction of a point's arithmetic (the GPU's cited peak times its MFU) over the strategy's fixed
    costs per step (:func:`distlab.predict.gpu_predictions.fixed_s`): under 3, the step measures the overhead more
    than the GPU. None without a cited GPU or a mixed-precision run."""
    precision = (record.get("config") or {}).get("precision")
    if system is None or precision not in ("bf16", "fp16"):
        return None
    n = record["environment"]["world_size"]
    compute = gpu_predictions.compute_s(system.gpu, preset["model"], preset["tokens_per_rank"], preset["seq_len"],
                                        precision)  # fmt: skip
    return compute / gpu_predictions.fixed_s(preset["model"], variant, n, system)


def fsdp_options(record: dict, system: System | None) -> list[dict]:
    """Each FSDP2 option's step against the defaults', and CUDA's peak where it counted one."""
    rows = record["metrics"]["variants"]
    base = next((r for r in rows if r["variant"] == "fsdp"), rows[0])
    return [
        {
            "variant": r["variant"],
            "change": r["change"],
            "time_s": r["time_s"],
            "vs_default": r["time_s"] / base["time_s"],
            "cuda_max_allocated": max((m["max_allocated"] for m in r.get("cuda_memory") or []), default=None),
        }
        for r in rows
    ]


def batch_norm(record: dict, system: System | None) -> dict[str, Any]:
    """BatchNorm, its statistics all-reduced, and SyncBatchNorm under DDP against one process on the whole batch."""
    return record["metrics"]["batch_norm"]


SUMMARIES = {"collectives": collectives, "copies": copies, "sweep": sweep, "fsdp_options": fsdp_options}
SUMMARIES |= {"batch_norm": batch_norm}
"""A part's name (``-`` as ``_``) -> its summary: each takes the part's result record and the course's cited system
for this GPU (None where there is none; only the collectives and the sweep compare with it)."""


def of_report(report: dict) -> dict:
    """A checked report's at-a-glance rows computed again from its result files by the course's models as they
    are now: a report written by older code is compared with today's cost model and cited systems, not with the
    ones it was written with."""
    from ..results import read_result

    system = system_for(report["environment"].get("gpus") or [])
    out = {}
    for part in report["parts"]:
        key = part["name"].replace("-", "_")
        if part["status"] == "ran" and key in SUMMARIES:
            out[key] = SUMMARIES[key](read_result(report["folder"] / part["files"][0]), system)
    return out
