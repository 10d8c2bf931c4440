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

On a GPU each preset can have its own batch (``--batch-sizes``, which ``distlab.gpu_report`` sizes so that
compute dominates the step: :func:`distlab.predict.gpu_predictions.sweep_size`), and one preset can run first
at ``--batch-size`` as well, the labelled launch-bound point (``--launch-bound``). Every point reports its
FLOPs per step, the TFLOP/s each variant achieved and, where the course cites the GPU, their share of its
dense peak. CUDA's own peak of each variant is taken with that variant alone on the GPU (:func:`each_alone`).

FSDP2 costs about a millisecond per collective call on a GPU whatever it sends, so its step is compute-dominated
only on a model whose units are large: too large for every variant and the calibration copy at once. The
``--fsdp2-point`` runs last, with only the FSDP2 variants, each built, timed and measured alone, and no
calibration copy (:func:`time_each_alone`): its check is the course's cited-specification model, not this run's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..cli import BenchConfig, entry_point, finish_run, option
from ..config import ParallelConfig
from ..errors import DistlabError, run_main
from ..models import GPT_PRESETS, build_model, count_parameters
from ..predict.costmodel import training_flops
from ..predict.gpu_predictions import gpu_for
from ..predict.memory import expected_state_bytes, parameter_shapes, shard_unit_shapes
from ..runtime import LOW_PRECISION, Runtime, distributed, synchronize
from . import shard_collectives
from .harness import Progress, parse_sizes, summarize_times
from .step import Trainee, device_peaks, each_alone, measure_trainees, observe_memory, token_batch

VARIANTS = {
    "ddp": dict(strategy="ddp"),
    "zero1": dict(strategy="zero1"),
    "zero2": dict(strategy="zero2"),
    "zero3": dict(strategy="zero3"),
    "fsdp": dict(strategy="fsdp"),
    "fsdp-no-reshard": dict(strategy="fsdp", fsdp_reshard_after_forward=False),
}
"""What the sweep compares: each name a ``ParallelConfig``; fsdp twice, FULL_SHARD and SHARD_GRAD_OP."""
FSDP2_VARIANTS = tuple(name for name, variant in VARIANTS.items() if variant["strategy"] == "fsdp")
FSDP2_POINT = "fsdp2-sized"
"""The label of the point where the FSDP2 variants run alone (``--fsdp2-point``)."""


@dataclass
class SweepConfig(BenchConfig):
    """Step time, memory per rank and bytes sent of every strategy on GPT presets, with the cost model's inputs."""

    models: str = option("gpt-tiny,gpt-mini,gpt-34m,gpt-small", "GPT presets, smallest first")
    variants: str = option(",".join(VARIANTS), "strategies to compare, comma-separated")
    batch_size: int = option(4, "sequences per rank per step (every preset's, unless --batch-sizes)")
    seq_len: int = option(64, "tokens per sequence")
    batch_sizes: str = option(
        "", "sequences per rank per step of each preset, comma-separated in --models order (empty: --batch-size)"
    )
    launch_bound: str = option(
        "", "a preset run first at --batch-size as well, labelled the launch-bound point (empty: none)"
    )
    fsdp2_point: str = option(
        "",
        "PRESET:BATCH, a last point where only the FSDP2 variants run, each built and timed alone with no "
        "calibration copy, for a model too large for every variant at once (empty: none)",
    )
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
        alone = self.fsdp2_point.split(":")
        if self.fsdp2_point and (len(alone) != 2 or not alone[1].isdigit() or int(alone[1]) < 1):
            raise DistlabError(f"--fsdp2-point {self.fsdp2_point!r}: a preset and a positive batch, as gpt-2.7b:32")
        extra = [self.launch_bound] if self.launch_bound else []
        for name in self.models.split(",") + extra + (alone[:1] if self.fsdp2_point else []):
            if name not in GPT_PRESETS:
                raise DistlabError(f"unknown preset {name!r}: choose from {', '.join(GPT_PRESETS)}")
            if self.seq_len > GPT_PRESETS[name].seq_len:
                raise DistlabError(
                    f"{name} takes at most {GPT_PRESETS[name].seq_len} tokens, not --seq-len {self.seq_len}"
                )
        unknown = set(self.variants.split(",")) - set(VARIANTS)
        if unknown:
            raise DistlabError(f"unknown variant(s) {', '.join(sorted(unknown))}: choose from {', '.join(VARIANTS)}")
        sizes = self.batch_sizes.split(",") if self.batch_sizes else []
        if sizes and (len(sizes) != len(self.models.split(",")) or not all(s.isdigit() and int(s) > 0 for s in sizes)):
            raise DistlabError(f"--batch-sizes {self.batch_sizes!r}: one positive whole number per preset of --models")

    def points(self) -> list[tuple[str, int, str]]:
        """(preset, sequences per rank, label) of every point, in the order they run: the launch-bound point first
        (labelled ``launch-bound``), then each preset at its own batch (``sized``) or at ``--batch-size`` (no label),
        then the FSDP2 variants' own point (``fsdp2-sized``)."""
        models = self.models.split(",")
        sizes = [int(s) for s in self.batch_sizes.split(",")] if self.batch_sizes else [self.batch_size] * len(models)
        label = "sized" if self.batch_sizes else ""
        first = [(self.launch_bound, self.batch_size, "launch-bound")] if self.launch_bound else []
        last = []
        if self.fsdp2_point:
            model, batch = self.fsdp2_point.split(":")
            last = [(model, int(batch), FSDP2_POINT)]
        return first + [(model, size, label) for model, size in zip(models, sizes)] + last

    def variants_at(self, point: str) -> list[str]:
        """The variants a point runs: all of ``--variants``, or at the FSDP2 point its FSDP2 ones."""
        names = self.variants.split(",")
        return [name for name in names if name in FSDP2_VARIANTS] if point == FSDP2_POINT else names


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


def variant_trainee(name: str, model_name: str, cfg: SweepConfig, runtime: Runtime) -> Trainee:
    """One variant of the sweep built for ``model_name``, under ``cfg.precision``'s autocast."""
    dtype = LOW_PRECISION.get(cfg.precision)
    return Trainee(variant_config(name, cfg.precision), model_name, runtime, autocast_dtype=dtype)


def model_entry(model: torch.nn.Module) -> dict:
    """What the cost model reads of a point's model: its parameter count, shard units and registration order."""
    return {
        "parameters": count_parameters(model),
        "units": [[list(shape) for shape in unit] for unit in shard_unit_shapes(model)],
        "parameter_shapes": [list(shape) for shape in parameter_shapes(model)],
    }


def preset_parameters(model_name: str) -> int:
    return count_parameters(build_model(model_name, device="meta"))


def resident_bytes_per_rank(model_name: str, variants: list[str], world_size: int, calibrated: bool = True) -> int:
    """What building every variant of a preset at once costs one rank (the model's state bytes, the
    calibration copy unless not ``calibrated``, and torch DDP's gradient buckets): the guard against swapping."""
    parameters = preset_parameters(model_name)
    total = sum(expected_state_bytes(parameters, "ddp", 1).values()) if calibrated else 0  # the calibration copy
    for name in variants:
        state = expected_state_bytes(parameters, VARIANTS[name]["strategy"], world_size)
        total += sum(state.values()) + (4 * parameters if name == "ddp" else 0)  # torch DDP's buckets
    return total


def resident_at(cfg: SweepConfig, model_name: str, point: str, world_size: int) -> int:
    """:func:`resident_bytes_per_rank` of a point: every variant and the calibration copy at once, or at the FSDP2
    point the largest of its variants alone."""
    if point != FSDP2_POINT:
        return resident_bytes_per_rank(model_name, cfg.variants.split(","), world_size)
    return max(resident_bytes_per_rank(model_name, [v], world_size, calibrated=False) for v in cfg.variants_at(point))


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def memory_free_on_every_rank(runtime: Runtime) -> tuple[int | None, int]:
    """The memory the sweep may fill, the same on every rank, and how many ranks share it: the smallest free
    memory of any rank's GPU (each rank its own), or the host's free memory (its ranks share it); None where it
    cannot be read. What fits selects the presets, and so the collectives every rank then calls: a rank that
    judged on its own memory could run another preset than its peers and wait for them forever."""
    mine = torch.cuda.mem_get_info(runtime.device)[0] if runtime.device.type == "cuda" else available_bytes()
    (smallest,) = runtime.reduce([math.inf if mine is None else mine], "min")
    return (None if math.isinf(smallest) else int(smallest)), ranks_sharing_memory(runtime)


def ranks_sharing_memory(runtime: Runtime) -> int:
    """How many ranks fill the memory this rank fills: the most on one GPU where ranks beyond the GPU count share
    them (gloo, rank r on GPU r mod gpus), else its machine's ranks, which share the host. Read from the placement
    the rank was started with (CONTRIBUTING: a GPU path never asks the machine again)."""
    placement = runtime.placement
    if placement is None:
        raise ValueError("the sweep needs a Runtime from distlab.runtime.distributed(), which knows its placement")
    return -(-placement.ranks // placement.gpus) if placement.device == "cuda" else placement.ranks


def presets_that_fit(
    cfg: SweepConfig, points: list[tuple[str, int, str]], free: int | None, sharing: int, world_size: int
) -> tuple[list[tuple[str, int, str]], list[str]]:
    """The points whose resident memory, times the ranks that share it, fits in ``cfg.memory_fraction`` of
    ``free`` (every point where free memory cannot be read), and the models left out: the guard against swapping."""
    fits = [
        (m, b, label) for m, b, label in points
        if free is None or sharing * resident_at(cfg, m, label, world_size) <= cfg.memory_fraction * free
    ]  # fmt: skip
    return fits, list(dict.fromkeys(m for m, _, _ in points if m not in {f[0] for f in fits}))


def planned_presets(cfg: SweepConfig, runtime: Runtime) -> tuple[list[tuple[str, int, str]], list[str], int | None]:
    """What the sweep runs: :func:`presets_that_fit` the memory free on every rank, judged the same on every rank
    (:func:`memory_free_on_every_rank`), with the models left out and that free memory."""
    free, sharing = memory_free_on_every_rank(runtime)
    return *presets_that_fit(cfg, cfg.points(), free, sharing, runtime.world_size), free


CUDA_PEAKS = (
    "each variant alone: the timed variants and the calibration copy freed, each variant built in turn, one "
    "warm-up step, then torch.cuda.reset_peak_memory_stats and one step; resident_before is what was allocated "
    "before it was built (the batch, cuBLAS's workspace), inside max_allocated"
)
"""How the sweep's ``cuda_memory`` was taken: on the footing of the course's count, which follows one variant."""


def cited_peak(runtime: Runtime, precision: str) -> dict | None:
    """The dense peak the course cites for this GPU in ``precision`` (:mod:`distlab.predict.gpu_specs`), or None:
    a CPU, fp32, or a GPU the course cites nothing for."""
    if runtime.device.type != "cuda" or precision == "fp32":
        return None
    gpu = gpu_for([torch.cuda.get_device_name(runtime.device)])
    if gpu is None:
        return None
    return {"gpu": gpu.name, "precision": precision, "flops_per_s": gpu.peak_flops(precision)}


def achieved(flops: float, seconds: float, peak: dict | None) -> dict:
    """TFLOP/s per rank of a step of ``flops`` that took ``seconds``, and their share of the cited peak (or None)."""
    rate = flops / seconds
    return {"tflops": rate / 1e12, "peak_share": None if peak is None else rate / peak["flops_per_s"]}


def time_and_observe(
    model_name: str, cfg: SweepConfig, runtime: Runtime, progress: Progress, tokens, targets
) -> tuple[dict, list[dict]]:
    """Every variant and the calibration copy built at once, timed round-robin, then each observed once (memory
    by the course's count, bytes sent); the preset's own entry and the rows. Everything built here is freed
    when it returns."""
    names = cfg.variants.split(",")
    dtype = LOW_PRECISION.get(cfg.precision)
    local = LocalTrainee(model_name, runtime, dtype)
    trainees = {name: variant_trainee(name, model_name, cfg, runtime) for name in names}
    work = preset_parameters(model_name) * tokens.numel()  # a step's cost grows about with the model and the batch
    measured, times = measure_trainees(
        trainees, tokens, targets, runtime, cfg.steps, cfg.warmup,
        also_timed={"local": lambda: local.step(tokens, targets)},
        after=lambda name: progress.advance(model_name, name, work=work),
    )  # fmt: skip
    skip = cfg.warmup
    rows = [{"variant": name, **VARIANTS[name], **row} for name, row in measured.items()]
    local_memory = observe_memory(local, tokens, targets, runtime, timeline=False)
    entry = model_entry(local.model) | {
        "local": {
            **summarize_times(times["local"]),
            "compute_s": summarize_times(local.compute_s[skip:])["time_s"],
            "optimizer_s": summarize_times(local.optimizer_s[skip:])["time_s"],
            "memory": {"ranks": local_memory},
        },
    }
    return entry, rows


def time_each_alone(
    model_name: str, cfg: SweepConfig, runtime: Runtime, progress: Progress, tokens, targets
) -> tuple[dict, list[dict]]:
    """The FSDP2 point: each of its variants built alone (:func:`each_alone`), timed for ``cfg.steps`` after
    ``cfg.warmup``, observed as every row is, and, where the device counts its own peak, measured by it. There is
    no calibration copy (the model is chosen too large for one beside a variant), so the entry has no ``local``
    and says it is not ``calibrated``."""
    peaks = device_peaks(runtime)
    work = preset_parameters(model_name) * tokens.numel()

    def build(name: str) -> tuple[str, Trainee]:
        return name, variant_trainee(name, model_name, cfg, runtime)

    def measure(built: tuple[str, Trainee], before: int | None) -> dict:
        name, trainee = built
        measured, _ = measure_trainees(
            {name: trainee}, tokens, targets, runtime, cfg.steps, cfg.warmup,
            after=lambda done: progress.advance(model_name, done, work=work),
        )  # fmt: skip
        row = {"variant": name, **VARIANTS[name], **measured[name]}
        if peaks is not None:  # warm already: the peak of one more step
            row["cuda_memory"] = peaks.measure(trainee, tokens, targets, runtime, warmup=0, resident_before=before)
        return row

    kept = {"before": peaks.allocated, "release": peaks.release} if peaks is not None else {}
    rows = list(each_alone(cfg.variants_at(FSDP2_POINT), build, measure, **kept).values())
    return model_entry(build_model(model_name, device="meta")) | {"calibrated": False}, rows


def measure_preset(
    model_name: str, cfg: SweepConfig, runtime: Runtime, progress: Progress, batch_size: int | None = None,
    point: str = "",
) -> dict:  # fmt: skip
    """One point: ``model_name`` at ``batch_size`` sequences per rank (``cfg.batch_size`` by default), labelled
    ``point``. Timed with every variant resident; then, where the device counts its own peak, each variant
    measured again alone (:func:`each_alone`), so that its peak holds no other variant's bytes. The FSDP2 point
    is timed with each variant alone as well (:func:`time_each_alone`)."""
    batch_size = batch_size or cfg.batch_size
    tokens, targets = token_batch(model_name, cfg.seq_len, batch_size, runtime)
    if point == FSDP2_POINT:
        entry, rows = time_each_alone(model_name, cfg, runtime, progress, tokens, targets)
        return point_entry(model_name, cfg, runtime, batch_size, point, entry, rows)
    entry, rows = time_and_observe(model_name, cfg, runtime, progress, tokens, targets)
    # time_and_observe has returned: the timed variants and the calibration copy are garbage (each_alone collects
    # them), and each variant is built again, alone.
    peaks = device_peaks(runtime)
    if peaks is not None:
        alone = each_alone(
            [row["variant"] for row in rows],
            lambda name: variant_trainee(name, model_name, cfg, runtime),
            lambda trainee, before: peaks.measure(trainee, tokens, targets, runtime, warmup=1, resident_before=before),
            before=peaks.allocated,
            release=peaks.release,
        )
        for row in rows:
            row["cuda_memory"] = alone[row["variant"]]
    return point_entry(model_name, cfg, runtime, batch_size, point, entry, rows)


def point_entry(
    model_name: str, cfg: SweepConfig, runtime: Runtime, batch_size: int, point: str, entry: dict, rows: list[dict]
) -> dict:
    """A point's record: its size and FLOPs per step, and each row's (and the calibration's) FLOP rate."""
    flops = training_flops(model_name, batch_size * cfg.seq_len, cfg.seq_len)
    peak = cited_peak(runtime, cfg.precision)
    for row in rows:
        row |= achieved(flops, row["time_s"], peak)
    if "local" in entry:
        entry["local"] |= {"compute": achieved(flops, entry["local"]["compute_s"], peak)}
    return {
        "model": model_name,
        "point": point,
        "batch_size": batch_size,
        "tokens_per_rank": batch_size * cfg.seq_len,
        "seq_len": cfg.seq_len,
        "flops_per_step": flops,
        **entry,
        "variants": rows,
    }


@entry_point(SweepConfig)
def main(cfg: SweepConfig) -> None:
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        n = runtime.world_size
        cuda = runtime.device.type == "cuda"
        fits, skipped, free = planned_presets(cfg, runtime)
        shown = [f"{m} ({b}x{cfg.seq_len}" + (f", {label})" if label else ")") for m, b, label in fits]
        runtime.log(
            f"distlab.bench.sweep: {runtime.describe()}, {torch.get_num_threads()} thread(s) per rank, "
            f"presets {', '.join(shown)}"
            + (f" (skipped, too large for this machine: {', '.join(skipped)})" if skipped else "")
        )
        collectives = []
        if n > 1:
            runtime.log("  collectives (the cost model's alpha, beta, gamma):")
            collectives = shard_collectives.sweep(runtime, parse_sizes(cfg.collective_sizes), 2, cfg.collective_repeats)
        progress = Progress(
            runtime,
            sum(
                preset_parameters(m) * b * cfg.seq_len * (len(cfg.variants_at(label)) + (label != FSDP2_POINT))
                for m, b, label in fits
            )
            * (cfg.warmup + cfg.steps),
        )
        presets = []
        for model_name, batch_size, label in fits:
            presets.append(measure_preset(model_name, cfg, runtime, progress, batch_size, label))
            for row in presets[-1]["variants"]:
                share = f", {100 * row['peak_share']:.0f} % of the cited peak" if row["peak_share"] is not None else ""
                runtime.log(
                    f"  {model_name:<10} {batch_size:>5}x{cfg.seq_len:<5} {row['variant']:<16} "
                    f"{1e3 * row['time_s']:9.1f} ms, {row['tflops']:7.2f} TFLOP/s{share}"
                )
        metrics = {
            "presets": presets,
            "skipped": skipped,
            "collectives": collectives,
            "threads_per_rank": torch.get_num_threads(),
            "available_bytes": free,
            "cited_peak": cited_peak(runtime, cfg.precision),
        } | ({"cuda_memory_method": CUDA_PEAKS} if cuda else {})
        name = cfg.output.name or f"sweep-{n}x{runtime.device.type}"
        finish_run(runtime, cfg.output.out, name, "sweep", asdict(cfg), metrics)


if __name__ == "__main__":
    run_main(main)
