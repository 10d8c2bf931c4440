"""The hand-written all-reduces against ``dist.all_reduce``, side by side.

    torchrun --standalone --nproc_per_node=4 -m distlab.bench.allreduce --sizes 4KB:256MB --out results

``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n``: the rate each
link must sustain, comparable across world sizes (nccl-tests' convention).
Every implementation's result is checked against ``dist.all_reduce`` before
it is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..cli import BenchConfig, entry_point, finish_run, option
from ..comm.collectives import ALL_REDUCES, Traffic
from ..errors import DistlabError, run_main
from ..predict.alphabeta import bus_factor
from ..runtime import Runtime, distributed
from .harness import human_bytes, parse_sizes, round_robin, summarize_times


def _library_all_reduce(tensor: torch.Tensor, traffic=None) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def all_reduce_impls(names: list[str]) -> dict[str, Callable]:
    impls = {}
    for name in names:
        if name == "torch":
            impls[name] = _library_all_reduce
        elif name in ALL_REDUCES:
            impls[name] = ALL_REDUCES[name]
        else:
            raise DistlabError(f"unknown all-reduce {name!r}: choose from torch, {', '.join(ALL_REDUCES)}")
    return impls


def repeats_for(size: int, max_repeats: int, min_repeats: int, budget_bytes: int = 1 << 30) -> int:
    """More repetitions for small messages, fewer for large ones."""
    return max(min_repeats, min(max_repeats, budget_bytes // max(size, 1)))


def sweep_all_reduce(
    runtime: Runtime,
    sizes: list[int],
    names: list[str],
    warmup: int = 2,
    max_repeats: int = 30,
    min_repeats: int = 5,
    dtype=torch.float32,
    progress: bool = True,
) -> list[dict]:
    """Time every implementation at every size, side by side; check each
    result against ``dist.all_reduce`` first."""
    impls = all_reduce_impls(names)
    n, device = runtime.world_size, runtime.device
    rows = []
    for size in sizes:
        numel = max(1, size // torch.empty((), dtype=dtype).element_size())
        source = torch.randn(numel, generator=torch.Generator().manual_seed(runtime.rank), dtype=dtype).to(device)
        expected = source.clone()
        dist.all_reduce(expected)
        traffic, error = {}, {}
        for name, fn in impls.items():
            counted = Traffic()
            result = fn(source.clone(), traffic=counted)
            error[name] = (result - expected).abs().max().item()
            if not torch.allclose(result, expected, rtol=1e-4, atol=1e-4 * n):
                raise AssertionError(f"{name} disagrees with dist.all_reduce at {human_bytes(size)}")
            traffic[name] = counted.bytes_sent if name != "torch" else None
        work = {name: source.clone() for name in impls}
        steps = {name: (lambda fn=fn, buffer=work[name]: fn(buffer)) for name, fn in impls.items()}
        repeats = repeats_for(size, max_repeats, min_repeats)
        times = round_robin(steps, runtime, repeats, warmup, prepare=lambda name: work[name].copy_(source))
        for name in impls:
            stats = summarize_times(times[name])
            algbw = numel * source.element_size() / stats["time_s"]
            rows.append(
                {
                    "impl": name,
                    "bytes": numel * source.element_size(),
                    "repeats": repeats,
                    **stats,
                    "algbw_GBps": algbw / 1e9,
                    "busbw_GBps": algbw * bus_factor(n) / 1e9,
                    "bytes_sent_per_rank": traffic[name],
                    "max_abs_diff_vs_torch": error[name],
                }
            )
        if progress:
            summary = ", ".join(f"{r['impl']} {r['busbw_GBps']:.2f}" for r in rows[-len(impls) :])
            runtime.log(f"  {human_bytes(size):>6}: busbw GB/s {summary}")
    return rows


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


@dataclass
class AllReduceBenchConfig(BenchConfig):
    """Time hand-written all-reduces against dist.all_reduce, side by side, and write a result JSON."""

    sizes: str = option("4KB:64MB", "comma list (4KB,16MB) or a range in powers of 4 (4KB:256MB)")
    impls: str = option("ring,naive_ring,reduce_broadcast,torch", "which all-reduces to time")
    warmup: int = option(2, "untimed repetitions per size")
    max_repeats: int = option(30, "timed repetitions for small sizes")
    min_repeats: int = option(5, "timed repetitions for the largest sizes")


@entry_point(AllReduceBenchConfig)
def main(cfg: AllReduceBenchConfig) -> None:
    sizes, names = parse_sizes(cfg.sizes), cfg.impls.split(",")
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        runtime.log(
            f"distlab.bench.allreduce: {runtime.describe()}, {len(sizes)} sizes "
            f"{human_bytes(sizes[0])}..{human_bytes(sizes[-1])}"
        )
        rows = sweep_all_reduce(runtime, sizes, names, cfg.warmup, cfg.max_repeats, cfg.min_repeats)
        name = cfg.output.name or f"allreduce-{runtime.world_size}x{runtime.device.type}"
        finish_run(
            runtime, cfg.output.out, name, "allreduce_bench", {**asdict(cfg), "sizes": sizes, "impls": names}, rows
        )


if __name__ == "__main__":
    run_main(main)
