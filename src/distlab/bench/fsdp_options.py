"""What each FSDP2 option costs and saves: one optimizer step per option, side by side.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.fsdp_options --model gpt-mini

Every variant is FSDP2 with one option changed from the default (per-block
units, full resharding, implicit prefetch, fp32), plus torch DDP and the
course's ZeRO-3 for reference. All start from the same weights and train on
the same batches; they take turns within each repetition (round-robin), and
a step's time is its slowest rank's. After the timing, one more step of each
is observed: every byte each rank holds, by what it is, with a timeline. On a GPU, CUDA's own peak of each
option is taken last, with that option alone on the GPU (:func:`~distlab.bench.step.each_alone`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..cli import entry_point, option
from ..config import ParallelConfig
from ..errors import DistlabError, run_main
from ..runtime import distributed
from .step import (
    SideBySideConfig,
    Trainee,
    device_peaks,
    each_alone,
    finish_side_by_side,
    time_side_by_side,
    token_batch,
)

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
class FsdpOptionsConfig(SideBySideConfig):
    """Time one optimizer step of FSDP2 with each option, and measure every byte each rank holds."""

    variants: str = option(",".join(VARIANTS), "variants to compare, comma-separated")

    def validate(self) -> None:
        super().validate()
        unknown = set(self.variants.split(",")) - set(VARIANTS)
        if unknown:
            raise DistlabError(f"unknown variant(s) {', '.join(sorted(unknown))}: choose from {', '.join(VARIANTS)}")


def runnable(name: str, world_size: int) -> bool:
    """Resharding to pairs means something only when pairs are fewer than all ranks."""
    return name != "reshard_to_2" or (world_size > 2 and world_size % 2 == 0)


def variant_trainee(name: str, cfg: FsdpOptionsConfig, runtime) -> Trainee:
    _, parallel, checkpointing = VARIANTS[name]
    return Trainee(parallel, cfg.model, runtime, activation_checkpointing=checkpointing)


@entry_point(FsdpOptionsConfig)
def main(cfg: FsdpOptionsConfig) -> None:
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        names = [name for name in cfg.variants.split(",") if name and runnable(name, runtime.world_size)]
        tokens, targets = token_batch(cfg.model, cfg.seq_len, cfg.batch_size, runtime)
        trainees = {name: variant_trainee(name, cfg, runtime) for name in names}
        measured, parameters = time_side_by_side("distlab.bench.fsdp_options", trainees, tokens, targets, cfg, runtime)
        del trainees  # the device's own peak of each option is taken with that option alone (each_alone)
        rows = [{"variant": name, "change": VARIANTS[name][0], **measured[name]} for name in names]
        peaks = device_peaks(runtime)
        if peaks is not None:
            alone = each_alone(
                names,
                lambda name: variant_trainee(name, cfg, runtime),
                lambda trainee, before: peaks.measure(
                    trainee, tokens, targets, runtime, warmup=1, resident_before=before
                ),
                before=peaks.allocated,
                release=peaks.release,
            )
            for row in rows:
                row["cuda_memory"] = alone[row["variant"]]
        for row in rows:
            if runtime.is_main:
                peak = max(rank["peak"] for rank in row["memory"]["ranks"]) / 2**20
                runtime.log(f"  {row['variant']:<18} median {1e3 * row['time_s']:8.1f} ms, peak {peak:7.1f} MiB/rank")
        finish_side_by_side(runtime, cfg, "fsdp_options_bench", rows, parameters)


if __name__ == "__main__":
    run_main(main)
