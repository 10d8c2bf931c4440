"""What each FSDP2 option costs and saves: one optimizer step per option, side by side.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.fsdp_options --model gpt-mini

Every variant is FSDP2 with one option changed from the default (per-block
units, full resharding, implicit prefetch, fp32), plus torch DDP and the
course's ZeRO-3 for reference. All start from the same weights and train on
the same batches; they take turns within each repetition (round-robin), and
a step's time is its slowest rank's. After the timing, one more step of each
is observed: every byte each rank holds, by what it is, with a timeline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..cli import BenchConfig, entry_point, finish_run, option
from ..config import ParallelConfig
from ..errors import DistlabError, run_main
from ..models import GPT_PRESETS, count_parameters
from ..runtime import distributed
from .step import Trainee, cuda_peaks, measure_trainees, token_batch

FSDP = ParallelConfig(strategy="fsdp")
VARIANTS: dict[str, tuple[str, ParallelConfig, bool]] = {
    # name: (what changes, the parallel section, activation checkpointing)
    "fsdp": ("FSDP2 defaults: a unit per block, reshard after forward", FSDP, False),
    "keep_after_forward": (
        "no resharding after forward (SHARD_GRAD_OP)",
        replace(FSDP, fsdp_reshard_after_forward=False),
        False,
    ),
    "reshard_to_2": ("after forward, gathered over pairs of ranks", replace(FSDP, fsdp_reshard_to=2), False),
    "explicit_prefetch": ("explicit forward and backward prefetch", replace(FSDP, fsdp_prefetch="explicit"), False),
    "prefetch_depth_2": (
        "explicit prefetch, two units ahead",
        replace(FSDP, fsdp_prefetch="explicit", fsdp_prefetch_depth=2),
        False,
    ),
    "checkpointing": ("activation checkpointing per block", FSDP, True),
    "bf16": ("bf16 parameters, fp32 gradient reduction", replace(FSDP, fsdp_param_dtype="bf16"), False),
    "offload": ("CPU offload of shards, gradients, optimizer state", replace(FSDP, fsdp_cpu_offload=True), False),
    "root_only": ("one unit: the whole model gathered at once", replace(FSDP, fsdp_units="root"), False),
    "zero3": ("the course's ZeRO-3 from scratch", ParallelConfig(strategy="zero3"), False),
    "ddp": ("torch DDP: everything replicated", ParallelConfig(strategy="ddp"), False),
}


@dataclass
class FsdpOptionsConfig(BenchConfig):
    """Time one optimizer step of FSDP2 with each option, and measure every byte each rank holds."""

    model: str = option("gpt-mini", "a GPT preset", choices=list(GPT_PRESETS))
    variants: str = option(",".join(VARIANTS), "variants to compare, comma-separated")
    batch_size: int = option(4, "sequences per rank per step")
    seq_len: int = option(128, "tokens per sequence")
    steps: int = option(10, "timed steps per variant")
    warmup: int = option(2, "untimed steps per variant")

    def validate(self) -> None:
        longest = GPT_PRESETS[self.model].seq_len
        if not 1 <= self.seq_len <= longest:
            raise DistlabError(f"{self.model} takes sequences of 1 to {longest} tokens, not --seq-len {self.seq_len}")
        unknown = set(self.variants.split(",")) - set(VARIANTS)
        if unknown:
            raise DistlabError(f"unknown variant(s) {', '.join(sorted(unknown))}: choose from {', '.join(VARIANTS)}")


def runnable(name: str, world_size: int) -> bool:
    """Resharding to pairs means something only when pairs are fewer than all ranks."""
    return name != "reshard_to_2" or (world_size > 2 and world_size % 2 == 0)


@entry_point(FsdpOptionsConfig)
def main(cfg: FsdpOptionsConfig) -> None:
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        names = [name for name in cfg.variants.split(",") if name and runnable(name, runtime.world_size)]
        tokens, targets = token_batch(cfg.model, cfg.seq_len, cfg.batch_size, runtime)
        trainees = {}
        for name in names:
            _, parallel, checkpointing = VARIANTS[name]
            trainees[name] = Trainee(parallel, cfg.model, runtime, activation_checkpointing=checkpointing)
        parameters = count_parameters(trainees[names[0]].model)
        runtime.log(
            f"distlab.bench.fsdp_options: {cfg.model} ({parameters:,} parameters), "
            f"{cfg.batch_size}x{cfg.seq_len} tokens/rank, {runtime.describe()}, "
            f"{len(names)} variants x {cfg.steps} steps"
        )
        measured, _ = measure_trainees(trainees, tokens, targets, runtime, cfg.steps, cfg.warmup, timeline=True)
        rows = []
        for name, trainee in trainees.items():
            row = {"variant": name, "change": VARIANTS[name][0], **measured[name]}
            if runtime.device.type == "cuda":
                row["cuda_memory"] = cuda_peaks(trainee, tokens, targets, runtime)
            rows.append(row)
            if runtime.is_main:
                peak = max(rank["peak"] for rank in row["memory"]["ranks"]) / 2**20
                runtime.log(f"  {name:<18} median {1e3 * row['time_s']:8.1f} ms, peak {peak:7.1f} MiB/rank")
        metrics = {"variants": rows, "parameters": parameters}
        name = cfg.output.name or f"fsdp-options-{cfg.model}-{runtime.world_size}x{runtime.device.type}"
        finish_run(runtime, cfg.output.out, name, "fsdp_options_bench", asdict(cfg), metrics)


if __name__ == "__main__":
    run_main(main)
