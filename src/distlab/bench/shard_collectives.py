"""The two halves of an all-reduce, timed: reduce-scatter and all-gather,
torch's against the course's hand-written ring, next to a whole all-reduce.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.shard_collectives --sizes 1MB:64MB --out results

Sharded data parallelism (ZeRO-2/3, FSDP) replaces DDP's all-reduce by these
two. A ring sends ``(n-1)/n · S`` per rank for each, half an all-reduce; a
backend that implements reduce-scatter as a whole all-reduce underneath (gloo
does) pays a full all-reduce for it. Every result is checked against
``dist.all_reduce`` before it is timed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..cli import BenchConfig, entry_point, finish_run, option
from ..comm.collectives import ring_all_gather, ring_reduce_scatter, segment_bounds
from ..errors import run_main
from ..parallel.flat_param import all_gather_flat, reduce_scatter_flat
from ..predict.costmodel import RING_FACTOR
from ..runtime import Runtime, distributed
from .harness import human_bytes, parse_sizes, round_robin, summarize_times


def _variants(full: torch.Tensor, runtime: Runtime) -> tuple[dict[tuple[str, str], object], torch.Tensor]:
    """(collective, implementation) -> a call, and the buffer the in-place ones work on
    (refilled from ``full`` before every call, outside the timing)."""
    shard_numel = full.numel() // runtime.world_size
    work = full.clone()
    shard = full[:shard_numel].clone()
    ring_input = full.clone()
    return {
        ("all_reduce", "torch"): (lambda: dist.all_reduce(work)),
        ("reduce_scatter", "torch"): (lambda: reduce_scatter_flat(work, shard_numel)),
        ("reduce_scatter", "ring"): (lambda: ring_reduce_scatter(work)),
        ("all_gather", "torch"): (lambda: all_gather_flat(shard, full.numel())),
        ("all_gather", "ring"): (lambda: ring_all_gather(ring_input)),
    }, work


def check_against_all_reduce(full: torch.Tensor, runtime: Runtime) -> None:
    """Each reduce-scatter's slice equals the same slice of ``dist.all_reduce``'s result."""
    n, r = runtime.world_size, runtime.rank
    total = full.clone()
    dist.all_reduce(total)
    shard_numel = full.numel() // n
    torch_slice = reduce_scatter_flat(full.clone(), shard_numel)
    ring_slice = ring_reduce_scatter(full.clone())
    a, b = segment_bounds(full.numel(), n)[(r + 1) % n]
    ok = torch.allclose(torch_slice, total[r * shard_numel : (r + 1) * shard_numel], rtol=1e-4, atol=1e-4 * n)
    ok = ok and torch.allclose(ring_slice, total[a:b], rtol=1e-4, atol=1e-4 * n)
    if not ok:
        raise AssertionError(f"a reduce-scatter disagrees with dist.all_reduce at {human_bytes(full.numel() * 4)}")


def sweep(runtime: Runtime, sizes: list[int], warmup: int, repeats: int) -> list[dict]:
    n = runtime.world_size
    rows = []
    for size in sizes:
        numel = max(n, size // 4 // n * n)  # equal shards for torch's collectives
        full = torch.randn(numel, generator=torch.Generator().manual_seed(runtime.rank)).to(runtime.device)
        check_against_all_reduce(full, runtime)
        calls, work = _variants(full, runtime)
        steps = {f"{collective}/{impl}": call for (collective, impl), call in calls.items()}
        times = round_robin(steps, runtime, repeats, warmup, prepare=lambda name: work.copy_(full))
        for (collective, impl), name in zip(calls, steps):
            stats = summarize_times(times[name])
            busbw = numel * 4 * RING_FACTOR[collective](n) / stats["time_s"]
            rows.append(
                {"collective": collective, "impl": impl, "bytes": numel * 4, **stats, "busbw_GBps": busbw / 1e9}
            )
        line = ", ".join(f"{r['collective']}/{r['impl']} {1e3 * r['time_s']:.1f}" for r in rows[-len(calls) :])
        runtime.log(f"  {human_bytes(numel * 4):>6}: ms {line}")
    return rows


@dataclass
class ShardCollectivesBenchConfig(BenchConfig):
    """Time reduce-scatter and all-gather (torch's and the course's ring) next to all-reduce, and write a result."""

    sizes: str = option("1MB:64MB", "comma list or a range in powers of 4")
    warmup: int = option(2, "untimed repetitions per size")
    repeats: int = option(15, "timed repetitions per size")


@entry_point(ShardCollectivesBenchConfig)
def main(cfg: ShardCollectivesBenchConfig) -> None:
    sizes = parse_sizes(cfg.sizes)
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        runtime.log(f"distlab.bench.shard_collectives: {runtime.describe()}, {len(sizes)} sizes")
        rows = sweep(runtime, sizes, cfg.warmup, cfg.repeats)
        name = cfg.output.name or f"shard-collectives-{runtime.world_size}x{runtime.device.type}"
        finish_run(runtime, cfg.output.out, name, "shard_collectives_bench", {**asdict(cfg), "sizes": sizes}, rows)


if __name__ == "__main__":
    run_main(main)
