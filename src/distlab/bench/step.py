"""One optimizer step of each strategy, side by side: forward, backward,
gradient synchronisation and the optimizer's step, as the training loop runs them.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.step --model gpt-mini --strategies ddp,zero3,fsdp

Every variant is built through the strategy registry from the same seed and
trains on the same batches; the variants take turns within each repetition
(round-robin), and a step's time is its slowest rank's. After the timing,
one more step of each variant is observed: the bytes each rank sends, by
collective (:mod:`distlab.comm.traffic`), and every byte it holds, by what it is,
with a timeline (:mod:`distlab.measure.memory`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..cli import BenchConfig, entry_point, finish_run, option
from ..comm.traffic import TrafficCounter
from ..config import ParallelConfig
from ..data import SyntheticTokens
from ..errors import DistlabError, run_main
from ..measure.memory import MemoryTracker, state_bytes
from ..models import GPT_PRESETS, build_model, checkpoint_activations, count_parameters
from ..parallel import make_strategy
from ..runtime import Runtime, distributed, gather_per_rank
from .harness import round_robin, summarize_times


@dataclass
class SideBySideConfig(BenchConfig):
    """What the step benchmarks share: one batch of a GPT preset per rank, every variant's steps timed in turns."""

    model: str = option("gpt-mini", "a GPT preset", choices=list(GPT_PRESETS))
    batch_size: int = option(4, "sequences per rank per step")
    seq_len: int = option(128, "tokens per sequence")
    steps: int = option(10, "timed steps per variant")
    warmup: int = option(2, "untimed steps per variant")

    def validate(self) -> None:
        longest = GPT_PRESETS[self.model].seq_len
        if not 1 <= self.seq_len <= longest:
            raise DistlabError(f"{self.model} takes sequences of 1 to {longest} tokens, not --seq-len {self.seq_len}")


@dataclass
class StepBenchConfig(SideBySideConfig):
    """Time one optimizer step of each strategy side by side, and count the bytes each rank sends."""

    strategies: str = option("ddp,zero1,zero2,zero3,fsdp", "strategies to compare, comma-separated")
    reshard_after_forward: bool = option(True, "zero3 and fsdp: free gathered parameters after forward")
    zero_collectives: str = option("", "zero3: torch or ring (default: the strategy's own default)")


class Trainee:
    """A model wrapped by one strategy, with its optimizer: one call is one optimizer step.

    Every trainee of a run starts from the same weights, materialised from one seed."""

    def __init__(
        self,
        parallel: ParallelConfig,
        model_name: str,
        runtime,
        activation_checkpointing: bool = False,
        autocast_dtype: torch.dtype | None = None,
    ):
        self.device = runtime.device
        # Mixed precision as torch does it: forward and backward under autocast, the parameters kept in fp32.
        self.autocast_dtype = autocast_dtype
        self.strategy = make_strategy(parallel)
        model = build_model(model_name, device="meta")
        if activation_checkpointing:
            checkpoint_activations(model, model_name)
        # a sharding strategy shards before the model has weights: no rank ever holds it whole
        self.model = self.strategy.build(model, runtime, seed=0, sharded_init=True)
        self.optimizer = self.strategy.make_optimizer(self.model, lambda params: torch.optim.Adam(params, lr=1e-4))

    def autocast(self):
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        with self.autocast():
            logits = self.model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def strategy_trainee(name: str, cfg: StepBenchConfig, runtime) -> Trainee:
    parallel = ParallelConfig(strategy=name, fsdp_reshard_after_forward=cfg.reshard_after_forward)
    if cfg.zero_collectives:
        parallel.zero_collectives = cfg.zero_collectives
    return Trainee(parallel, cfg.model, runtime)


def token_batch(model: str, seq_len: int, batch_size: int, runtime) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of synthetic token sequences for a GPT preset (its own seed: each rank its own data)."""
    batch = SyntheticTokens(GPT_PRESETS[model].vocab_size, seq_len, batch_size, seed=1234 + runtime.rank)
    return batch.data.to(runtime.device), batch.targets.to(runtime.device)


def observe_memory(trainee: Trainee, tokens, targets, runtime, timeline: bool = True) -> list[dict] | None:
    """One step of ``trainee`` under the memory tracker: every rank's peak, its breakdown and the state at the
    optimizer step, and (with ``timeline``) rank 0's timeline; on rank 0. The ranks' timelines are alike and rank
    0's is the one drawn: every rank's would add about a megabyte a rank to a result file (a GPU report's files
    are capped at 8 MiB)."""
    at_step = {}
    handle = trainee.optimizer.register_step_pre_hook(
        lambda *_: at_step.update(state_bytes(trainee.strategy, trainee.model, trainee.optimizer))
    )
    categories = lambda: trainee.strategy.state_tensors(trainee.model, trainee.optimizer)  # noqa: E731
    with MemoryTracker(categories, trainee.model) as tracker:
        trainee.step(tokens, targets)
    handle.remove()
    mine = {**at_step, "peak": tracker.peak_bytes, "peak_by_category": tracker.peak_by_category}
    # the activations' own high-water mark (what the model adds), which a rank's peak by category cannot say
    mine["activations_peak"] = max((s.by_category.get("activations", 0) for s in tracker.timeline), default=0)
    if timeline and runtime.rank == 0:
        mine["timeline"] = [
            {"event": s.event, "phase": s.phase, "total": s.total, **s.by_category} for s in tracker.timeline
        ]
    return gather_per_rank(mine, runtime)


def observed_row(trainee: Trainee, times: list[float], runtime, tokens, targets, timeline: bool = False) -> dict:
    """A trainee's row: its timed steps (with their median and spread), then one more step observed (every byte
    each rank holds, by the course's count) and one counted (the bytes it sends, by collective and by device)."""
    memory = observe_memory(trainee, tokens, targets, runtime, timeline=timeline)
    with TrafficCounter(runtime.world_size) as counted:
        trainee.step(tokens, targets)
    return {**summarize_times(times), "times_s": times, "traffic": counted.summary(),
            "traffic_by_device": dict(counted.bytes_by_device), "memory": {"ranks": memory}}  # fmt: skip


def measure_trainees(
    trainees: dict[str, Trainee], tokens, targets, runtime, steps: int, warmup: int, timeline: bool = False,
    also_timed: dict | None = None, after=None,
) -> tuple[dict[str, dict], dict[str, list[float]]]:  # fmt: skip
    """The benchmarks' shared tail: every trainee (and each of ``also_timed``'s steps) timed round-robin for
    ``steps`` after ``warmup``, then each trainee observed once (:func:`observed_row`). Each trainee's row by its
    name, and every series of times."""
    step_of = {name: (lambda t=trainee: t.step(tokens, targets)) for name, trainee in trainees.items()}
    times = round_robin({**(also_timed or {}), **step_of}, runtime, steps, warmup, after=after)
    rows = {name: observed_row(t, times[name], runtime, tokens, targets, timeline) for name, t in trainees.items()}
    return rows, times


def time_side_by_side(entry: str, trainees: dict[str, Trainee], tokens, targets, cfg, runtime) -> tuple[dict, int]:
    """A step benchmark's run, said in one line first: :func:`measure_trainees` with ``cfg``'s steps, warm-up
    and timelines. Each trainee's row by its name, and the model's parameter count."""
    parameters = count_parameters(next(iter(trainees.values())).model)
    runtime.log(
        f"{entry}: {cfg.model} ({parameters:,} parameters), {cfg.batch_size}x{cfg.seq_len} tokens/rank, "
        f"{runtime.describe()}, {len(trainees)} variants x {cfg.steps} steps"
    )
    measured, _ = measure_trainees(trainees, tokens, targets, runtime, cfg.steps, cfg.warmup, timeline=True)
    return measured, parameters


def finish_side_by_side(runtime, cfg, kind: str, rows: list[dict], parameters: int) -> None:
    """Rank 0 writes a step benchmark's rows, one a variant: ``<kind>-<model>-<N>x<device>.json`` unless
    ``--name`` says otherwise."""
    prefix = kind.removesuffix("_bench").replace("_", "-")
    name = cfg.output.name or f"{prefix}-{cfg.model}-{runtime.world_size}x{runtime.device.type}"
    finish_run(runtime, cfg.output.out, name, kind, asdict(cfg), {"variants": rows, "parameters": parameters})


def cuda_peaks(
    trainee: Trainee,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    runtime,
    warmup: int = 0,
    resident_before: int | None = None,
) -> list[dict] | None:
    """One more step with CUDA's allocator counting: every rank's ``torch.cuda.max_memory_allocated`` and
    ``max_memory_reserved`` over it (on rank 0), beside the course's own byte count. ``warmup`` untimed steps
    first (a trainee just built has no optimizer state yet); ``resident_before``, what this rank had allocated
    before the trainee was built, is recorded beside them (it is inside ``max_allocated``), with the peak of what
    tensors requested before rounding and the device's used memory after the step. GPU-only (the GPU tier's sweep
    tests run it); a CPU sweep records none of these."""
    for _ in range(warmup):
        trainee.step(tokens, targets)
    torch.cuda.synchronize(runtime.device)
    torch.cuda.reset_peak_memory_stats(runtime.device)
    trainee.step(tokens, targets)
    torch.cuda.synchronize(runtime.device)
    peaks = {"max_allocated": torch.cuda.max_memory_allocated(runtime.device)}
    peaks["max_reserved"] = torch.cuda.max_memory_reserved(runtime.device)
    # What tensors asked for before the allocator rounded them up, and what the device shows as used (nvidia-smi's
    # number: the reserved segments, CUDA's context, NCCL's buffers): the profiling chapter's outer layers.
    peaks["max_requested"] = torch.cuda.memory_stats(runtime.device).get("requested_bytes.all.peak")
    free, total = torch.cuda.mem_get_info(runtime.device)
    peaks["device_used"] = total - free
    if resident_before is not None:
        peaks["resident_before"] = resident_before
    return gather_per_rank(peaks, runtime)


def each_alone(
    names: list[str],
    build: Callable[[str], object],
    measure: Callable[[object, object], object],
    before: Callable[[], object] = lambda: None,
    release: Callable[[], None] = lambda: None,
) -> dict[str, object]:
    """``measure(build(name), before())`` for each name in turn, nothing built here alive but that one: garbage
    collected and ``release()`` called before each is built and after the last, and the built object dropped as
    soon as ``measure`` returns. The caller must hold no other of its kind (:func:`~distlab.bench.sweep.measure_preset`
    and :mod:`~distlab.bench.fsdp_options` measure this way once their timed variants are gone)."""
    results = {}
    for name in names:
        gc.collect()
        release()
        baseline = before()
        results[name] = measure(build(name), baseline)
    gc.collect()
    release()
    return results


@dataclass(frozen=True)
class DevicePeaks:
    """How a device counts a variant's own peak: ``measure(trainee, tokens, targets, runtime, warmup=,
    resident_before=)`` (per-rank rows on rank 0), what is allocated now, and how to hand cached blocks back."""

    measure: Callable[..., list[dict] | None]
    allocated: Callable[[], int]
    release: Callable[[], None]


def device_peaks(runtime: Runtime) -> DevicePeaks | None:
    """:func:`~distlab.bench.step.cuda_peaks` with CUDA's allocator on a GPU; None elsewhere (a CPU has no allocator
    counter; the course's own count is each row's ``memory``). Not reached on a CPU: ``torch.cuda.memory_allocated``,
    ``empty_cache`` and what ``cuda_peaks`` reads need a CUDA device; the order and the freeing around them are
    :func:`each_alone`'s, and tests run the sweep and fsdp-options with this replaced."""
    if runtime.device.type != "cuda":
        return None
    return DevicePeaks(cuda_peaks, lambda: torch.cuda.memory_allocated(runtime.device), torch.cuda.empty_cache)


@entry_point(StepBenchConfig)
def main(cfg: StepBenchConfig) -> None:
    names = [name for name in cfg.strategies.split(",") if name]
    with distributed(cfg.where.device, cfg.where.backend) as runtime:
        tokens, targets = token_batch(cfg.model, cfg.seq_len, cfg.batch_size, runtime)
        trainees = {name: strategy_trainee(name, cfg, runtime) for name in names}
        measured, parameters = time_side_by_side("distlab.bench.step", trainees, tokens, targets, cfg, runtime)
        rows = [{"strategy": name, **row} for name, row in measured.items()]
        for row in rows:
            sent = sum(entry["bytes_sent"] for entry in row["traffic"].values()) / 2**20
            runtime.log(f"  {row['strategy']:<8} median {1e3 * row['time_s']:8.1f} ms, sends {sent:7.1f} MiB/step")
        finish_side_by_side(runtime, cfg, "step_bench", rows, parameters)


if __name__ == "__main__":
    run_main(main)
