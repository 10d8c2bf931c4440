"""Timing harness for collectives, writing results with provenance.

    torchrun --standalone --nproc_per_node=4 -m distlab.bench --sizes 4KB:256MB --out results

Conventions (those of nccl-tests): warm up, then repeat; each repetition's
time is the slowest rank's; report the median and the quartiles.
``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n`` for all-reduce,
the rate each link must sustain, comparable across world sizes.
Implementations are timed round-robin within each repetition, so drift in
the machine's speed hits all of them alike.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from .collectives import ALL_REDUCES, Traffic
from .results import write_result
from .runtime import DistlabError, Runtime, distributed, run_main

UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B)\s*", text.upper())
    if not match:
        raise DistlabError(f"cannot read size {text!r}: write it like 4KB, 16MB or 1GB")
    return int(match.group(1)) * UNITS[match.group(2)]


def parse_sizes(text: str) -> list[int]:
    """``4KB,1MB`` lists sizes; ``4KB:256MB`` means every power of 4 from one to the other."""
    if ":" in text:
        low, high = (parse_size(t) for t in text.split(":"))
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 4
        return sizes
    return [parse_size(t) for t in text.split(",")]


def human_bytes(n: float) -> str:
    for unit in ("GB", "MB", "KB"):
        if n >= UNITS[unit]:
            return f"{n / UNITS[unit]:g}{unit}"
    return f"{n:g}B"


def bus_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize_times(times: list[float]) -> dict[str, float]:
    """Median and quartiles of a list of timings, in seconds."""
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"time_s": statistics.median(times), "time_q1_s": q1, "time_q3_s": q3}


def repeats_for(size: int, max_repeats: int, min_repeats: int, budget_bytes: int = 1 << 30) -> int:
    """More repetitions for small messages, fewer for large ones."""
    return max(min_repeats, min(max_repeats, budget_bytes // max(size, 1)))


def sweep_all_reduce(runtime: Runtime, sizes: list[int], names: list[str], warmup: int = 2, max_repeats: int = 30, min_repeats: int = 5, dtype=torch.float32, progress: bool = True) -> list[dict]:
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
        traffic, error, times = {}, {}, {name: [] for name in impls}
        for name, fn in impls.items():
            counted = Traffic()
            result = fn(source.clone(), traffic=counted)
            error[name] = (result - expected).abs().max().item()
            if not torch.allclose(result, expected, rtol=1e-4, atol=1e-4 * n):
                raise AssertionError(f"{name} disagrees with dist.all_reduce at {human_bytes(size)}")
            traffic[name] = counted.bytes_sent if name != "torch" else None
        repeats = repeats_for(size, max_repeats, min_repeats)
        for rep in range(warmup + repeats):
            for name, fn in impls.items():
                work = source.clone()
                dist.barrier()
                synchronize(device)
                start = time.perf_counter()
                fn(work)
                synchronize(device)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends when its slowest rank does
                if rep >= warmup:
                    times[name].append(elapsed.item())
        for name in impls:
            stats = summarize_times(times[name])
            algbw = numel * source.element_size() / stats["time_s"]
            rows.append({
                "impl": name, "bytes": numel * source.element_size(), "repeats": repeats, **stats,
                "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * bus_factor(n) / 1e9,
                "bytes_sent_per_rank": traffic[name], "max_abs_diff_vs_torch": error[name],
            })
        if progress:
            summary = ", ".join(f"{r['impl']} {r['busbw_GBps']:.2f}" for r in rows[-len(impls):])
            runtime.log(f"  {human_bytes(size):>6}: busbw GB/s {summary}")
    return rows


def fit_latency_bandwidth(rows: list[dict], impl: str, world_size: int) -> dict:
    """Least-squares fit of ``t = alpha*2(n-1) + 2(n-1)/n * S/B`` to one
    implementation's medians: returns the per-hop latency ``alpha`` (s) and
    the link bandwidth ``B`` (bytes/s)."""
    points = [(r["bytes"], r["time_s"]) for r in rows if r["impl"] == impl]
    xs, ys = torch.tensor([p[0] for p in points], dtype=torch.float64), torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(xs), xs], dim=1)
    # weight by 1/t so small messages (latency) count as much as large ones (bandwidth)
    weights = 1 / ys
    intercept, slope = torch.linalg.lstsq(design * weights[:, None], (ys * weights)[:, None]).solution.flatten().tolist()
    hops = 2 * (world_size - 1)
    return {"alpha_s": intercept / hops, "bandwidth_Bps": bus_factor(world_size) / slope if slope > 0 else float("inf"), "intercept_s": intercept, "slope_s_per_byte": slope}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="torchrun --standalone --nproc_per_node=N -m distlab.bench", description="Time hand-written all-reduces against dist.all_reduce, side by side, and write a result JSON.")
    parser.add_argument("--sizes", default="4KB:64MB", help="comma list (4KB,16MB) or a range in powers of 4 (4KB:256MB)")
    parser.add_argument("--impls", default="ring,naive_ring,reduce_broadcast,torch", help="which all-reduces to time")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the tensors live; the backend follows")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help="override the backend")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size")
    parser.add_argument("--max-repeats", type=int, default=30, help="timed repetitions for small sizes")
    parser.add_argument("--min-repeats", type=int, default=5, help="timed repetitions for the largest sizes")
    parser.add_argument("--out", default="results", help="directory for the result JSON")
    parser.add_argument("--name", default="", help="file name without .json (default: allreduce-<ranks>x<device>)")
    args = parser.parse_args(argv)
    sizes, names = parse_sizes(args.sizes), args.impls.split(",")
    with distributed(args.device, args.backend) as runtime:
        runtime.log(f"distlab.bench: all-reduce on {runtime.describe()}, {len(sizes)} sizes {human_bytes(sizes[0])}..{human_bytes(sizes[-1])}")
        rows = sweep_all_reduce(runtime, sizes, names, args.warmup, args.max_repeats, args.min_repeats)
        if runtime.is_main:
            path = Path(args.out) / f"{args.name or f'allreduce-{runtime.world_size}x{runtime.device.type}'}.json"
            config = {**vars(args), "sizes": sizes, "impls": names}
            write_result(path, "allreduce_bench", config, rows, runtime.device, world_size=runtime.world_size, backend=runtime.backend)
            runtime.log(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
