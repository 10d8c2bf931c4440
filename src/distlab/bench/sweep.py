"""DDP against ZeRO-1/2/3 and FSDP2, measured side by side: GPT presets from tiny up to what the
machine holds, at one world size per run.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.sweep --device cpu --out results

For each preset every strategy is built through the strategy registry (sharding strategies on
``meta``, so no rank ever holds the whole model) from one seed; the strategies take turns step by
step (round-robin), and a step's time is its slowest rank's. Then one more step of each is
observed: every byte each rank holds, by what it is, and the bytes it sends, by collective.

The same run also measures what the cost model (:mod:`distlab.predict.costmodel`) needs as inputs, under
the same conditions: each preset's forward, backward and optimizer step with no communication at
all (``local``: every rank trains its own copy), and all-reduce, all-gather and reduce-scatter at
several sizes, torch's and the course's ring. The model never sees the strategies' own times.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..cli import BenchConfig, finish_run, option, parse
from ..comm.traffic import TrafficCounter
from ..config import ParallelConfig
from ..errors import DistlabError, run_main
from ..models import GPT_PRESETS, build_model, count_parameters
from ..predict.memory import expected_state_bytes, parameter_shapes, shard_unit_shapes
from ..runtime import LOW_PRECISION, Runtime, distributed, synchronize
from . import shard_collectives
from .harness import Progress, parse_sizes, round_robin, summarize_times
from .step import Trainee, cuda_peaks, observe_memory, token_batch

VARIANTS = {
    "ddp": dict(strategy="ddp"),
    "zero1": dict(strategy="zero1"),
    "zero2": dict(strategy="zero2"),
    "zero3": dict(strategy="zero3"),
    "fsdp": dict(strategy="fsdp"),
    "fsdp-no-reshard": dict(strategy="fsdp", fsdp_reshard_after_forward=False),
}
"""What the sweep compares: each name a ``ParallelConfig``; fsdp twice, FULL_SHARD and SHARD_GRAD_OP."""


@dataclass
class SweepConfig(BenchConfig):
    """Step time, memory per rank and bytes sent of every strategy on GPT presets, with the cost model's inputs."""

    models: str = option("gpt-tiny,gpt-mini,gpt-34m,gpt-small", "GPT presets, smallest first")
    variants: str = option(",".join(VARIANTS), "strategies to compare, comma-separated")
    batch_size: int = option(4, "sequences per rank per step")
    seq_len: int = option(64, "tokens per sequence")
    steps: int = option(20, "timed steps per strategy and preset")
    warmup: int = option(1, "untimed steps per strategy and preset")
    collective_sizes: str = option("64KB:64MB", "sizes of the collectives timed for the cost model")
    collective_repeats: int = option(8, "timed repetitions per collective and size")
    memory_fraction: float = option(
        0.6, "skip a preset whose strategies, all resident at once, would take more than this share of free memory"
    )
    precision: str = option(
        "fp32",
        "fp32, or bf16 or fp16: every variant's forward and backward under autocast (parameters kept in fp32), "
        "and ZeRO-3 and FSDP2 also gather their parameters in it (fp16 without a loss scaler: for timing only)",
        choices=["fp32", "bf16", "fp16"],
    )

    def validate(self) -> None:
        for name in self.models.split(","):
            if name not in GPT_PRESETS:
                raise DistlabError(f"unknown preset {name!r}: choose from {', '.join(GPT_PRESETS)}")
        unknown = set(self.variants.split(",")) - set(VARIANTS)
        if unknown:
            raise DistlabError(f"unknown variant(s) {', '.join(sorted(unknown))}: choose from {', '.join(VARIANTS)}")


class LocalTrainee(Trainee):
    """The calibration: the same model and optimizer with no communication at all (every rank trains
    its own copy); forward + backward and the optimizer step are timed apart, for the cost model."""

    def __init__(self, model_name: str, runtime: Runtime, autocast_dtype: torch.dtype | None = None):
        super().__init__(ParallelConfig(strategy="single"), model_name, runtime, autocast_dtype=autocast_dtype)
        self.compute_s: list[float] = []
        self.optimizer_s: list[float] = []

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        synchronize(self.device)  # a GPU runs behind the CPU: each clock reading waits for its kernels
        started = time.perf_counter()
        with self.autocast():
            loss = F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        synchronize(self.device)
        stepped = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        self.compute_s.append(stepped - started)
        self.optimizer_s.append(time.perf_counter() - stepped)


def variant_config(name: str, precision: str) -> ParallelConfig:
    """A variant's parallel section; in low precision ZeRO-3 and FSDP2 gather and compute in it, reduce in fp32."""
    low = precision != "fp32" and VARIANTS[name]["strategy"] in ("zero3", "fsdp")
    return ParallelConfig(**VARIANTS[name], **({"fsdp_param_dtype": precision} if low else {}))


def preset_parameters(model_name: str) -> int:
    return count_parameters(build_model(model_name, device="meta"))


def resident_bytes_per_rank(model_name: str, variants: list[str], world_size: int) -> int:
    """What building every variant of a preset at once costs one rank (the model's state bytes, the
    calibration copy and torch DDP's gradient buckets): the guard against swapping."""
    parameters = preset_parameters(model_name)
    total = sum(expected_state_bytes(parameters, "ddp", 1).values())  # the calibration copy
    for name in variants:
        state = expected_state_bytes(parameters, VARIANTS[name]["strategy"], world_size)
        total += sum(state.values()) + (4 * parameters if name == "ddp" else 0)  # torch DDP's buckets
    return total


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def measure_preset(model_name: str, cfg: SweepConfig, runtime: Runtime, progress: Progress) -> dict:
    names = cfg.variants.split(",")
    tokens, targets = token_batch(model_name, cfg.seq_len, cfg.batch_size, runtime)
    dtype = LOW_PRECISION.get(cfg.precision)
    local = LocalTrainee(model_name, runtime, dtype)
    trainees = {name: Trainee(variant_config(name, cfg.precision), model_name, runtime, autocast_dtype=dtype)
                for name in names}  # fmt: skip
    steps = {"local": lambda: local.step(tokens, targets)}
    steps |= {name: (lambda t=trainee: t.step(tokens, targets)) for name, trainee in trainees.items()}
    work = preset_parameters(model_name)  # a step's cost grows about with the model
    times = round_robin(
        steps, runtime, cfg.steps, cfg.warmup, after=lambda name: progress.advance(model_name, name, work=work)
    )
    skip = cfg.warmup
    rows = []
    for name, trainee in trainees.items():
        memory = observe_memory(trainee, tokens, targets, runtime, timeline=False)
        with TrafficCounter(runtime.world_size) as counted:
            trainee.step(tokens, targets)
        rows.append(
            {"variant": name, **VARIANTS[name], **summarize_times(times[name]), "times_s": times[name]}
            | {"traffic": counted.summary(), "traffic_by_device": dict(counted.bytes_by_device)}
            | {"memory": {"ranks": memory}}
            | ({"cuda_memory": cuda_peaks(trainee, tokens, targets, runtime)} if runtime.device.type == "cuda" else {})
        )
    units = shard_unit_shapes(local.model)
    local_memory = observe_memory(local, tokens, targets, runtime)
    for rank in local_memory or []:  # the activations' own high-water mark: what the model adds
        rank["activations_peak"] = max(sample["activations"] for sample in rank.pop("timeline"))
    return {
        "model": model_name,
        "parameters": count_parameters(local.model),
        "units": [[list(shape) for shape in unit] for unit in units],
        "parameter_shapes": [list(shape) for shape in parameter_shapes(local.model)],
        "tokens_per_rank": cfg.batch_size * cfg.seq_len,
        "seq_len": cfg.seq_len,
        "local": {
            **summarize_times(times["local"]),
            "compute_s": summarize_times(local.compute_s[skip:])["time_s"],
            "optimizer_s": summarize_times(local.optimizer_s[skip:])["time_s"],
            "memory": {"ranks": local_memory},
        },
        "variants": rows,
    }


CONFIG = SweepConfig


def main(argv: list[str] | None = None) -> None:
    cfg = parse(SweepConfig, argv)
    names, models = cfg.variants.split(","), cfg.models.split(",")
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        n = runtime.world_size
        free = available_bytes()
        fits = [
            m for m in models if free is None or n * resident_bytes_per_rank(m, names, n) <= cfg.memory_fraction * free
        ]
        skipped = [m for m in models if m not in fits]
        runtime.log(
            f"distlab.bench.sweep: {runtime.describe()}, {torch.get_num_threads()} thread(s) per rank, "
            f"presets {', '.join(fits)}"
            + (f" (skipped, too large for this machine: {', '.join(skipped)})" if skipped else "")
        )
        collectives = []
        if n > 1:
            runtime.log("  collectives (the cost model's alpha, beta, gamma):")
            collectives = shard_collectives.sweep(runtime, parse_sizes(cfg.collective_sizes), 2, cfg.collective_repeats)
        progress = Progress(
            runtime, sum(preset_parameters(m) for m in fits) * (len(names) + 1) * (cfg.warmup + cfg.steps)
        )
        presets = []
        for model_name in fits:
            presets.append(measure_preset(model_name, cfg, runtime, progress))
            for row in presets[-1]["variants"]:
                runtime.log(f"  {model_name:<10} {row['variant']:<16} {1e3 * row['time_s']:9.1f} ms")
        metrics = {
            "presets": presets,
            "skipped": skipped,
            "collectives": collectives,
            "threads_per_rank": torch.get_num_threads(),
            "available_bytes": free,
        }
        name = cfg.output.name or f"sweep-{n}x{runtime.device.type}"
        finish_run(runtime, cfg.output.out, name, "sweep", asdict(cfg), metrics)


if __name__ == "__main__":
    run_main(main)
