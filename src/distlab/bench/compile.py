"""What compiling a DDP step costs and gains: the first step's time (the compile) on each rank, and the step's
time compiled against eager.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.compile --device cpu --out results

The model is the compile chapter's: ``--layers`` of ``Linear(width, width)`` and ReLU, compiled and then wrapped
in DDP (the order torch's documentation recommends). Eager and compiled start from the same weights; each takes
one untimed first step, timed apart (on the compiled model it is the compile: dynamo traces, DDPOptimizer cuts
the graph at the buckets, the backend compiles each piece), then they take turns step by step, each step's time
the slowest rank's. On a CPU inductor generates C++ and needs a C++ compiler (gcc);
``--compile-backend aot_eager`` needs none. Every rank compiles on its own: a rank that compiles slower holds
the others at the first all-reduce.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..cli import BenchConfig, entry_point, finish_run, option
from ..errors import run_main
from ..parallel.compiled import GraphCounter
from ..runtime import Runtime, distributed, synchronize
from .harness import round_robin, summarize_times


@dataclass
class CompileBenchConfig(BenchConfig):
    """Time a DDP step compiled and eager, and each rank's first (compiling) step, and write a result."""

    compile_backend: str = option("inductor", "the torch.compile backend: inductor, aot_eager or eager")
    layers: int = option(8, "Linear + ReLU layers")
    width: int = option(512, "each layer's width (512: 1 MiB of fp32 weights a layer)")
    batch_size: int = option(32, "samples per rank per step")
    bucket_cap_mb: float = option(25.0, "DDP's bucket_cap_mb")
    warmup: int = option(2, "untimed steps after the first")
    repeats: int = option(20, "timed steps of each")


def _model(cfg: CompileBenchConfig, device: torch.device) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = [m for _ in range(cfg.layers) for m in (torch.nn.Linear(cfg.width, cfg.width), torch.nn.ReLU())]
        return torch.nn.Sequential(*layers).to(device)


def _step_of(net: torch.nn.Module, inputs: torch.Tensor):
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        net(inputs).square().mean().backward()
        optimizer.step()

    return step


def _timed_once(step, runtime: Runtime) -> float:
    dist.barrier()
    synchronize(runtime.device)
    start = time.perf_counter()
    step()
    synchronize(runtime.device)
    return time.perf_counter() - start


def measure(cfg: CompileBenchConfig, runtime: Runtime) -> dict:
    torch._dynamo.reset()
    inputs = torch.randn(cfg.batch_size, cfg.width, generator=torch.Generator().manual_seed(runtime.rank))
    inputs = inputs.to(runtime.device)
    counter = GraphCounter(cfg.compile_backend)
    nets = {
        "eager": DDP(_model(cfg, runtime.device), bucket_cap_mb=cfg.bucket_cap_mb),
        "compiled": DDP(torch.compile(_model(cfg, runtime.device), backend=counter), bucket_cap_mb=cfg.bucket_cap_mb),
    }
    steps = {name: _step_of(net, inputs) for name, net in nets.items()}
    first = {name: _timed_once(step, runtime) for name, step in steps.items()}
    graphs = counter.require_graphs(f"the benchmark's compile with backend {cfg.compile_backend}")
    times = round_robin(steps, runtime, cfg.repeats, cfg.warmup)
    every_rank_first = [None] * runtime.world_size
    dist.all_gather_object(every_rank_first, first)
    rows = [
        {
            "variant": name,
            "first_step_s_per_rank": [ranks[name] for ranks in every_rank_first],
            "first_step_s": max(ranks[name] for ranks in every_rank_first),
            **summarize_times(times[name]),
        }
        for name in steps
    ]
    return {"graphs": graphs, "rows": rows}


@entry_point(CompileBenchConfig)
def main(cfg: CompileBenchConfig) -> None:
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        runtime.log(f"distlab.bench.compile: {runtime.describe()}, backend {cfg.compile_backend}")
        metrics = measure(cfg, runtime)
        for row in metrics["rows"]:
            firsts = ", ".join(f"{s:.2f}" for s in row["first_step_s_per_rank"])
            runtime.log(f"  {row['variant']:<9} first step {firsts} s by rank; step {1e3 * row['time_s']:.2f} ms")
        name = cfg.output.name or f"compile-{cfg.compile_backend}-{runtime.world_size}x{runtime.device.type}"
        finish_run(runtime, cfg.output.out, name, "compile_bench", asdict(cfg), metrics)


if __name__ == "__main__":
    run_main(main)


def summary(metrics: dict) -> dict[str, str]:
    """What the chapter says of a result: each variant's first step and median step, and whether the compiled
    median lies outside eager's quartiles (faster, slower) or inside them (no difference this run can show)."""
    rows = {row["variant"]: row for row in metrics["rows"]}
    eager, compiled = rows["eager"], rows["compiled"]
    if compiled["time_s"] < eager["time_q1_s"]:
        verdict = "faster than eager"
    elif compiled["time_s"] > eager["time_q3_s"]:
        verdict = "slower than eager"
    else:
        verdict = "within eager's quartiles: no difference this run can show"
    return {
        name: f"first step {row['first_step_s']:.2f} s, then {1e3 * row['time_s']:.1f} ms a step "
        f"(quartiles {1e3 * row['time_q1_s']:.1f}-{1e3 * row['time_q3_s']:.1f})"
        for name, row in rows.items()
    } | {"verdict": verdict}
