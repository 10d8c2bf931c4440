"""Forward+backward step time of the course's DDP wrappers and torch DDP,
side by side, plus a profiler timeline of one bucketed step.

    torchrun --standalone --nproc_per_node=2 -m distlab.ddp_bench --model cnn --batch-size 64 --out results

Every variant wraps a copy of the same model and runs the same batch. Within
each repetition the variants take turns (round-robin), so a machine that
speeds up or slows down affects all of them alike; each step's time is its
slowest rank's. ``local`` runs the bare model with no communication at all:
the compute floor, so ``step - local`` is the communication a variant
failed to hide behind backward.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

from .bench import summarize_times, synchronize
from .mini_ddp import BucketedDDP, NaiveDDP
from .models import GPT_PRESETS, build_model, count_parameters, model_input_kind
from .results import write_result
from .runtime import Runtime, distributed, run_main


def image_shape(model_name: str) -> tuple[int, int]:
    """(channels, side) of the images a model is benchmarked on: MNIST's for the CNN, CIFAR's otherwise."""
    return (1, 28) if model_name == "cnn" else (3, 32)


def sample_batch(model_name: str, batch_size: int, device: torch.device, seq_len: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch shaped for ``model_name`` (MNIST-sized images for the CNN,
    CIFAR-sized for ResNet-18, tokens for GPT presets), different on every rank."""
    gen = torch.Generator().manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
    if model_name in GPT_PRESETS:
        vocab = GPT_PRESETS[model_name].vocab_size
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    channels, size = image_shape(model_name)
    return torch.randn(batch_size, channels, size, size, generator=gen).to(device), torch.randint(0, 10, (batch_size,), generator=gen).to(device)


def make_model(model_name: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    channels, size = image_shape(model_name)
    return build_model(model_name, channels, 10, size).to(device)


def variants(bucket_caps_mb: list[float], torch_ddp_cap_mb: float, device: torch.device) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """Name -> how to wrap the model. torch DDP runs with ``broadcast_buffers=False``
    (no buffer sync in forward) so that it does exactly the work the course's wrappers do."""
    device_ids = [device.index] if device.type == "cuda" else None
    # torch >= 2.10 renamed broadcast_buffers; either way: no buffer sync in forward
    no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters else {"broadcast_buffers": False}
    found: dict[str, Callable[[nn.Module], nn.Module]] = {"local (no sync)": lambda m: m, "NaiveDDP": NaiveDDP}
    for cap in bucket_caps_mb:
        found[f"BucketedDDP {cap:g} MB"] = lambda m, cap=cap: BucketedDDP(m, bucket_cap_mb=cap)
    found[f"torch DDP {torch_ddp_cap_mb:g} MB"] = lambda m: DistributedDataParallel(m, device_ids=device_ids, bucket_cap_mb=torch_ddp_cap_mb, **no_buffer_sync)
    return found


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()


def time_steps(models: dict[str, nn.Module], inputs, targets, runtime: Runtime, steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per forward+backward for each model, slowest rank's, round-robin."""
    local = {name: [] for name in models}
    for rep in range(warmup + steps):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            dist.barrier()
            synchronize(runtime.device)
            start = time.perf_counter()
            forward_backward(model, inputs, targets)
            synchronize(runtime.device)
            if rep >= warmup:
                local[name].append(time.perf_counter() - start)
    slowest = {}
    for name, times in local.items():
        tensor = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)  # one collective per variant, after the timing
        slowest[name] = tensor.tolist()
    return slowest


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

    On CPU the compute lane is the forward and each backward op of the main
    thread, and the communication lane is gloo's all-reduce on its own
    threads. On CUDA both lanes are GPU kernels: NCCL's and everyone else's.
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
    intervals = []
    for event in prof.events():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        name = event.name
        if runtime.device.type == "cuda":
            if not on_gpu:
                continue
            lane = "communication" if "nccl" in name.lower() else "compute"
        elif name.startswith("gloo:all_reduce"):
            lane = "communication"
        elif name == "forward" or name.startswith("autograd::engine::evaluate_function:"):
            lane, name = "compute", name.replace("autograd::engine::evaluate_function: ", "")
        else:
            continue
        intervals.append({"lane": lane, "name": name, "start_us": event.time_range.start, "dur_us": event.time_range.elapsed_us()})
    origin = min(i["start_us"] for i in intervals)
    return [{"lane": i["lane"], "name": i["name"], "start_ms": (i["start_us"] - origin) / 1e3, "dur_ms": i["dur_us"] / 1e3} for i in intervals]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="torchrun --standalone --nproc_per_node=N -m distlab.ddp_bench", description="Time forward+backward of NaiveDDP, BucketedDDP and torch DDP side by side; profile one bucketed step.")
    parser.add_argument("--model", default="cnn", help="cnn, resnet18 or a GPT preset")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank")
    parser.add_argument("--bucket-caps", default="0.25,1,5,25", help="BucketedDDP bucket caps to sweep, in MB")
    parser.add_argument("--torch-ddp-cap", type=float, default=25.0, help="torch DDP's bucket cap in MB (its default)")
    parser.add_argument("--profile-cap", type=float, default=1.0, help="bucket cap of the profiled BucketedDDP step, in MB")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs; the backend follows")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help="override the backend")
    parser.add_argument("--out", default="results", help="directory for the result JSON")
    parser.add_argument("--name", default="", help="file name without .json (default: ddp-step-<model>-<ranks>x<device>)")
    args = parser.parse_args(argv)
    caps = [float(c) for c in args.bucket_caps.split(",") if c]
    with distributed(args.device, args.backend) as runtime:
        base = make_model(args.model, runtime.device)
        inputs, targets = sample_batch(args.model, args.batch_size, runtime.device)
        models = {name: wrap(copy.deepcopy(base)) for name, wrap in variants(caps, args.torch_ddp_cap, runtime.device).items()}
        runtime.log(f"distlab.ddp_bench: {args.model} ({count_parameters(base):,} parameters), batch {args.batch_size}/rank, {runtime.describe()}, {len(models)} variants x {args.steps} steps")
        times = time_steps(models, inputs, targets, runtime, args.steps, args.warmup)
        rows = []
        for name, series in times.items():
            model = models[name]
            rows.append({"variant": name, **summarize_times(series), "times_s": series,
                         "buckets": len(model.buckets) if isinstance(model, BucketedDDP) else None})
            runtime.log(f"  {name:<22} median {1e3 * rows[-1]['time_s']:8.2f} ms")
        timeline = profile_step(BucketedDDP(copy.deepcopy(base), bucket_cap_mb=args.profile_cap), inputs, targets, runtime)
        if runtime.is_main:
            path = Path(args.out) / f"{args.name or f'ddp-step-{args.model}-{runtime.world_size}x{runtime.device.type}'}.json"
            metrics = {"variants": rows, "parameters": count_parameters(base), "timeline": timeline, "timeline_bucket_cap_mb": args.profile_cap}
            write_result(path, "ddp_step_bench", {**vars(args), "bucket_caps": caps}, metrics, runtime.device, world_size=runtime.world_size, backend=runtime.backend)
            runtime.log(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
