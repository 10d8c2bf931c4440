"""Forward+backward step time of the course's DDP wrappers and torch DDP,
side by side, plus a profiler timeline of one bucketed step.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.ddp_step --model cnn --batch-size 64 --out results

Every variant wraps a copy of the same model, through the same strategy
classes the training loop uses, and runs the same batch. ``local`` runs the
bare model with no communication at all: the compute floor, so
``step - local`` is the communication a variant failed to hide behind
backward. torch DDP runs with ``broadcast_buffers=False`` (no buffer sync in
forward), so it does exactly the work the course's wrappers do.
"""

from __future__ import annotations

import copy
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from ..cli import BenchConfig, entry_point, finish_run, option
from ..data import IMAGE_SHAPES, SyntheticImages, SyntheticTokens
from ..errors import run_main
from ..measure.profile import merged_intervals
from ..models import GPT_PRESETS, build_model, count_parameters, model_input_kind
from ..parallel.base import Strategy
from ..parallel.mini_ddp import BucketedDDP
from ..parallel.replicated import BucketedDDPStrategy, NaiveDDPStrategy, Single, TorchDDP
from ..runtime import Runtime, distributed, synchronize
from .harness import round_robin, summarize_times

# The images each model is benchmarked on: MNIST's for the CNN, CIFAR-10's otherwise.
BENCH_IMAGES = {"cnn": "mnist", "resnet18": "cifar10"}
# The variants' names in a record: the compute floor, and the prefixes of the bucketed and torch DDP variants,
# which end in their bucket cap ("MB" in the name is torch's unit, MiB).
LOCAL = "local (no sync)"
BUCKETED = "BucketedDDP"
TORCH_DDP = "torch DDP"


def variant_name(kind: str, cap_mb: float) -> str:
    """A bucketed variant's name in the records, e.g. ``BucketedDDP 25 MB``."""
    return f"{kind} {cap_mb:g} MB"


def sample_batch(model_name: str, batch_size: int, rank: int, seq_len: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One synthetic batch shaped for ``model_name``, different on every rank."""
    if model_input_kind(model_name) == "tokens":
        batch = SyntheticTokens(GPT_PRESETS[model_name].vocab_size, seq_len, batch_size, seed=1234 + rank)
    else:
        batch = SyntheticImages(IMAGE_SHAPES[BENCH_IMAGES[model_name]], batch_size, seed=1234 + rank)
    return batch.data, batch.targets


def make_model(model_name: str) -> nn.Module:
    """The benchmarked model, the same weights on every rank (the global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if model_input_kind(model_name) == "tokens":
            return build_model(model_name)
        channels, _, side = IMAGE_SHAPES[BENCH_IMAGES[model_name]]
        return build_model(model_name, channels, 10, side)


def variants(bucket_caps_mb: list[float], torch_ddp_cap_mb: float) -> dict[str, Strategy]:
    """Name -> the strategy that wraps the model for that variant."""
    found: dict[str, Strategy] = {LOCAL: Single(), "NaiveDDP": NaiveDDPStrategy()}
    for cap in bucket_caps_mb:
        found[variant_name(BUCKETED, cap)] = BucketedDDPStrategy(cap)
    found[variant_name(TORCH_DDP, torch_ddp_cap_mb)] = TorchDDP(torch_ddp_cap_mb, broadcast_buffers=False)
    return found


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()


@contextmanager
def _native_stderr_silenced():
    """Kineto prints start/stop banners from C++ straight to fd 2; they say
    nothing a reader needs. Python-level errors are unaffected (they are
    raised, and reported after the fd is restored)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profile_step(model: nn.Module, inputs, targets, runtime: Runtime) -> list[dict]:
    """One profiled forward+backward: intervals (ms from the step's start) on
    a ``compute`` lane and a ``communication`` lane.

    On CPU the compute lane is the forward and each backward op of the main thread, and the communication lane is
    gloo's all-reduce on its own threads. On CUDA the compute lane is the GPU's kernels, and the communication lane
    NCCL's kernels, or, where gloo carries the collectives (ranks sharing one GPU), gloo's all-reduce on the CPU.
    Empty, and said in one line, where the profiler recorded nothing to draw (no GPU kernel: CUPTI can be blocked
    on a managed GPU).
    """
    forward_backward(model, inputs, targets)  # warm
    model.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runtime.device.type == "cuda" else [])
    dist.barrier()
    with _native_stderr_silenced(), profile(activities=activities) as prof:
        with record_function("forward"):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        loss.backward()
        synchronize(runtime.device)
    intervals = [interval for event in prof.events() if (interval := profiled_interval(event, runtime))]
    if not any(interval["lane"] == "compute" for interval in intervals):
        runtime.log("distlab: the profiler recorded no computation (no CUDA kernel: is CUPTI blocked here?): "
                    "the step's timeline is left empty")  # fmt: skip
        return []
    origin = min(i["start_us"] for i in intervals)
    return [
        {"lane": i["lane"], "name": i["name"], "start_ms": (i["start_us"] - origin) / 1e3, "dur_ms": i["dur_us"] / 1e3}
        for i in intervals
    ]


def profiled_interval(event, runtime: Runtime) -> dict | None:
    """One profiler event as an interval on the ``compute`` or ``communication`` lane, or None if it is neither."""
    on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
    name = event.name
    if name.startswith("gloo:all_reduce"):  # gloo's all-reduce runs on CPU threads, beside a GPU too
        lane = "communication"
    elif runtime.device.type == "cuda":
        if not on_gpu:
            return None
        lane = "communication" if "nccl" in name.lower() else "compute"
    elif name == "forward" or name.startswith("autograd::engine::evaluate_function:"):
        lane, name = "compute", name.replace("autograd::engine::evaluate_function: ", "")
    else:
        return None
    return {"lane": lane, "name": name, "start_us": event.time_range.start, "dur_us": event.time_range.elapsed_us()}


# What a page reads from a record. The prose's claims rest on these, so they live here, with tests
# (tests/test_ddp_step_analysis.py), and the pages only print them.


def within_spread(row: dict, reference: dict) -> bool:
    """Whether two variants' interquartile ranges of step time overlap: if they do, the run cannot tell them apart."""
    return row["time_q1_s"] <= reference["time_q3_s"] and reference["time_q1_s"] <= row["time_q3_s"]


def compare_with_torch_ddp(record: dict) -> list[dict]:
    """Every variant of a ``ddp_step`` record against torch DDP's: its median and quartiles (ms), the communication
    it left exposed (its median minus the compute floor's), its ratio to torch DDP's median, and ``verdict``:
    ``"reference"`` for torch DDP, else ``"within"`` (its spread overlaps torch DDP's) or ``"apart"``."""
    rows = {row["variant"]: row for row in record["metrics"]["variants"]}
    reference = rows[next(name for name in rows if name.startswith(TORCH_DDP))]
    local_s = rows[LOCAL]["time_s"]
    table = []
    for name, row in rows.items():
        verdict = "reference" if row is reference else ("within" if within_spread(row, reference) else "apart")
        table.append(
            {
                "variant": name,
                "median_ms": 1e3 * row["time_s"],
                "q1_ms": 1e3 * row["time_q1_s"],
                "q3_ms": 1e3 * row["time_q3_s"],
                "exposed_ms": 1e3 * (row["time_s"] - local_s),
                "ratio_to_torch_ddp": row["time_s"] / reference["time_s"],
                "verdict": verdict,
            }
        )
    return table


def communication_after_backward(record: dict) -> dict:
    """What the profiled bucketed step of a ``ddp_step`` record says about overlap, in ms from the step's start.

    Backward is the compute lane's intervals other than ``forward``; the all-reduces, the communication lane's,
    merged where they overlap (gloo runs several at once). ``after_backward_ms`` is the all-reduce time that runs
    on once backward has ended, which the step waits for; ``share_after`` its fraction of ``all_reduce_ms``.
    ``profiled_over_median`` compares the profiled step with the unprofiled median of the same variant.
    """
    metrics = record["metrics"]
    timeline, cap = metrics["timeline"], metrics["timeline_bucket_cap_mb"]
    backward = [i for i in timeline if i["lane"] == "compute" and i["name"] != "forward"]
    communication = [(i["start_ms"], i["start_ms"] + i["dur_ms"]) for i in timeline if i["lane"] == "communication"]
    if not backward or not communication:
        raise ValueError("the record's timeline has no backward or no all-reduce: rerun the benchmark with profiling")
    backward_end = max(i["start_ms"] + i["dur_ms"] for i in backward)
    busy = merged_intervals(communication)
    all_reduce_ms = sum(end - start for start, end in busy)
    after_ms = sum(end - max(start, backward_end) for start, end in busy if end > backward_end)
    step_ms = max(i["start_ms"] + i["dur_ms"] for i in timeline)
    median_s = next(r["time_s"] for r in metrics["variants"] if r["variant"] == variant_name(BUCKETED, cap))
    return {
        "bucket_cap_mb": cap,
        "backward_start_ms": min(i["start_ms"] for i in backward),
        "backward_end_ms": backward_end,
        "first_all_reduce_ms": busy[0][0],
        "last_all_reduce_end_ms": busy[-1][1],
        "all_reduce_ms": all_reduce_ms,
        "after_backward_ms": after_ms,
        "share_after": after_ms / all_reduce_ms,
        "step_ms": step_ms,
        "median_ms": 1e3 * median_s,
        "profiled_over_median": step_ms / (1e3 * median_s),
    }


@dataclass
class DDPStepBenchConfig(BenchConfig):
    """Time forward+backward of NaiveDDP, BucketedDDP and torch DDP side by side; profile one bucketed step."""

    model: str = option("cnn", "cnn, resnet18 or a GPT preset", choices=["cnn", "resnet18", *GPT_PRESETS])
    batch_size: int = option(64, "samples per rank")
    bucket_caps: str = option("0.25,1,5,25", "BucketedDDP bucket caps to sweep, in MB")
    torch_ddp_cap: float = option(25.0, "torch DDP's bucket cap in MB (its default)")
    profile_cap: float = option(1.0, "bucket cap of the profiled BucketedDDP step, in MB")
    steps: int = option(30, "timed steps per variant")
    warmup: int = option(5, "untimed steps per variant")


@entry_point(DDPStepBenchConfig)
def main(cfg: DDPStepBenchConfig) -> None:
    caps = [float(c) for c in cfg.bucket_caps.split(",") if c]
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        base = make_model(cfg.model).to(runtime.device)
        inputs, targets = (t.to(runtime.device) for t in sample_batch(cfg.model, cfg.batch_size, runtime.rank))
        models = {
            name: strategy.wrap(copy.deepcopy(base), runtime)
            for name, strategy in variants(caps, cfg.torch_ddp_cap).items()
        }
        runtime.log(
            f"distlab.bench.ddp_step: {cfg.model} ({count_parameters(base):,} parameters), batch "
            f"{cfg.batch_size}/rank, {runtime.describe()}, {len(models)} variants x {cfg.steps} steps"
        )
        steps = {name: (lambda model=model: forward_backward(model, inputs, targets)) for name, model in models.items()}
        times = round_robin(
            steps, runtime, cfg.steps, cfg.warmup, prepare=lambda name: models[name].zero_grad(set_to_none=True)
        )
        rows = []
        for name, series in times.items():
            model = models[name]
            rows.append(
                {
                    "variant": name,
                    **summarize_times(series),
                    "times_s": series,
                    "buckets": len(model.buckets) if isinstance(model, BucketedDDP) else None,
                }
            )
            runtime.log(f"  {name:<22} median {1e3 * rows[-1]['time_s']:8.2f} ms")
        timeline = profile_step(
            BucketedDDP(copy.deepcopy(base), bucket_cap_mb=cfg.profile_cap), inputs, targets, runtime
        )
        metrics = {
            "variants": rows,
            "parameters": count_parameters(base),
            "timeline": timeline,
            "timeline_bucket_cap_mb": cfg.profile_cap,
        }
        name = cfg.output.name or f"ddp-step-{cfg.model}-{runtime.world_size}x{runtime.device.type}"
        finish_run(runtime, cfg.output.out, name, "ddp_step_bench", {**asdict(cfg), "bucket_caps": caps}, metrics)


if __name__ == "__main__":
    run_main(main)
