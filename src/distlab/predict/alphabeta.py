"""The alpha-beta model of a ring all-reduce: ``t = alpha*2(n-1) + 2(n-1)/n * S/B``, fitted to a
benchmark's medians (:mod:`distlab.bench.allreduce`), and its time for any size.
"""

from __future__ import annotations

import torch


def bus_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size


def fit_latency_bandwidth(rows: list[dict], impl: str, world_size: int) -> dict:
    """Least-squares fit of ``t = alpha*2(n-1) + 2(n-1)/n * S/B`` to one
    implementation's medians: returns the per-hop latency ``alpha`` (s) and
    the link bandwidth ``B`` (bytes/s)."""
    points = [(r["bytes"], r["time_s"]) for r in rows if r["impl"] == impl]
    xs, ys = (
        torch.tensor([p[0] for p in points], dtype=torch.float64),
        torch.tensor([p[1] for p in points], dtype=torch.float64),
    )
    design = torch.stack([torch.ones_like(xs), xs], dim=1)
    # weight by 1/t so small messages (latency) count as much as large ones (bandwidth)
    weights = 1 / ys
    intercept, slope = (
        torch.linalg.lstsq(design * weights[:, None], (ys * weights)[:, None]).solution.flatten().tolist()
    )
    hops = 2 * (world_size - 1)
    return {
        "alpha_s": intercept / hops,
        "bandwidth_Bps": bus_factor(world_size) / slope if slope > 0 else float("inf"),
        "intercept_s": intercept,
        "slope_s_per_byte": slope,
    }


def predict_time(fit: dict, size: float, world_size: int) -> float:
    """The fitted model's time for one all-reduce of ``size`` bytes on ``world_size`` ranks."""
    return 2 * (world_size - 1) * fit["alpha_s"] + bus_factor(world_size) * size / fit["bandwidth_Bps"]
