"""One training loop for every strategy.

    torchrun --standalone --nproc_per_node=2 -m distlab.train --strategy ddp --model cnn --dataset mnist

Read it top to bottom: :func:`build_run` builds the data, the model (wrapped
by the strategy) and the optimizer; :func:`train_step` is one optimizer step
of accumulated micro-steps; :func:`train_epoch` runs the steps of an epoch
and reduces its numbers once; :func:`evaluate` counts on every rank and
reduces. Where the run stands lives in :class:`TrainState`, which a
checkpoint can save and restore.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import FaultTolerance
from .cli import entry_point, finish_run
from .config import TrainConfig
from .data import DataOrderCheck, DeviceResidentLoader, SampledLoader, eval_loader, load_datasets
from .errors import DistlabError, run_main
from .measure.memory import MemoryTracker, state_bytes
from .models import (
    GPT_PRESETS,
    META_INIT_FROM_PARAMETERS,
    build_model,
    checkpoint_activations,
    count_parameters,
    model_input_kind,
)
from .parallel import Strategy, full_state_dict, make_strategy
from .parallel.compiled import compile_for_training, require_compiled
from .runtime import LOW_PRECISION, Runtime, distributed, gather_per_rank, launched_world_size, synchronize

# The optimizer step whose memory is measured: the second, since the first
# also creates the optimizer's state and DDP's buckets.
OBSERVED_STEP = 1


CPU = torch.device("cpu")


@dataclass
class TrainState:
    """Where a run stands: enough to continue it exactly where it stopped."""

    epoch: int = 0
    step_in_epoch: int = 0
    """Optimizer steps already taken in ``epoch``."""
    global_step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    """One record per finished epoch."""
    step_times_s: list[float] = field(default_factory=list)
    """Wall time of every optimizer step, this rank's."""
    memory: dict[str, Any] = field(default_factory=dict)
    """This rank's memory over one optimizer step (:func:`observed_step`)."""
    epoch_progress: dict[str, list[float]] = field(default_factory=dict)
    """The epoch's loss sums so far, over all ranks (saved mid-epoch, so a resumed epoch reports them whole)."""

    def state_dict(self, device: torch.device = CPU) -> dict[str, Any]:
        """Where the run stands, and the random generators this rank draws from: the CPU's, and on a GPU run its
        own GPU's (never every visible GPU's: those are the machine's, not the run's, and reading them starts
        CUDA in a CPU run)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "history": self.history,
            "step_times_s": self.step_times_s,
            "memory": self.memory,
            "epoch_progress": self.epoch_progress,
            "rng": torch.get_rng_state(),
            "cuda_rng": [torch.cuda.get_rng_state(device)] if device.type == "cuda" else [],
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device = CPU) -> None:
        self.epoch, self.step_in_epoch, self.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        self.history, self.step_times_s = list(state["history"]), list(state["step_times_s"])
        self.memory = dict(state.get("memory", {}))
        self.epoch_progress = dict(state.get("epoch_progress", {}))
        torch.set_rng_state(state["rng"])
        saved = state["cuda_rng"]
        if saved and device.type == "cuda":  # a GPU run's state resumed on a CPU has no generator to set
            index = 0 if len(saved) == 1 else device.index or 0  # an older distlab saved every visible GPU's
            if index < len(saved):
                torch.cuda.set_rng_state(saved[index], device)


class Precision:
    """Autocast and, for fp16, a gradient scaler; fp32 makes both no-ops."""

    def __init__(self, precision: str, device: torch.device, strategy: Strategy):
        self.dtype = LOW_PRECISION.get(precision)
        self.device_type = device.type
        self.scaler = strategy.grad_scaler(enabled=precision == "fp16", device=device)

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the gradients back to their true scale (before clipping them)."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()


def optimizer_factory(cfg: TrainConfig):
    """Parameters -> the optimizer ``--optimizer`` names, with ``--lr``."""
    lr = cfg.training.lr
    if cfg.training.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.training.optimizer](params, lr=lr)


def loss_and_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target cross-entropy and correctness, for class labels (B,) and token targets (B, T) alike."""
    losses = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="none")
    return losses.view(targets.shape), logits.argmax(-1) == targets


class MetricSums:
    """Loss, correct predictions and targets, summed on this rank; :meth:`all_reduce` sums over ranks."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, losses: torch.Tensor, correct: torch.Tensor) -> None:
        self.sums[:2] += torch.stack([losses.detach().sum().double(), correct.sum().double()])
        # The count is a Python number, passed to the kernel as an argument. torch.tensor(count, device=cuda) would
        # copy it from the host and wait for the GPU every step, and the host could never run ahead.
        self.sums[2] += correct.numel()

    def all_reduce(self) -> MetricSums:
        dist.all_reduce(self.sums)
        return self

    @property
    def loss(self) -> float:
        return self.sums[0].item() / max(self.sums[2].item(), 1)

    @property
    def accuracy(self) -> float:
        return self.sums[1].item() / max(self.sums[2].item(), 1)

    @property
    def count(self) -> int:
        return int(self.sums[2].item())


def epoch_progress(sums: MetricSums, step_losses: torch.Tensor, steps_done: int, world_size: int) -> dict:
    """The epoch so far, summed over ranks (a collective): what a checkpoint taken mid-epoch keeps."""
    totals = torch.cat([sums.sums, step_losses[:steps_done]])
    dist.all_reduce(totals)
    return {"sums": totals[:3].tolist(), "step_loss": (totals[3:] / world_size).tolist()}


def restore_epoch_progress(progress: dict, sums: MetricSums, step_losses: torch.Tensor, runtime: Runtime) -> None:
    """Rank 0 carries a resumed epoch's saved totals: the epoch's reductions add every rank's share."""
    if not progress or not runtime.is_main:
        return
    sums.sums += torch.tensor(progress["sums"], dtype=torch.float64, device=sums.sums.device)
    losses = torch.tensor(progress["step_loss"], dtype=torch.float64, device=step_losses.device)
    if len(losses) <= len(step_losses):  # per-step losses of another world size's steps do not line up
        step_losses[: len(losses)] = losses * runtime.world_size


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset, runtime: Runtime, batch_size: int = 512, precision: Precision | None = None
) -> dict[str, float]:
    """Loss and accuracy over the whole dataset, every rank on its own shard."""
    model.eval()
    sums = MetricSums(runtime.device)
    for inputs, targets, real in eval_loader(dataset, batch_size, runtime):
        with precision.autocast() if precision else nullcontext():
            logits = model(inputs)
        losses, correct = loss_and_correct(logits, targets)
        mask = real.view(-1, *[1] * (targets.dim() - 1)).expand_as(targets)
        sums.add(losses[mask], correct[mask])
    sums.all_reduce()
    return {"loss": sums.loss, "accuracy": sums.accuracy, "samples": sums.count}


@dataclass
class Run:
    """Everything a run is built from, made once by :func:`build_run`."""

    cfg: TrainConfig
    runtime: Runtime
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    loader: SampledLoader | DeviceResidentLoader
    test_set: Any
    parameters: int
    steps_per_epoch: int
    global_batch: int


def build_model_for(cfg: TrainConfig, runtime: Runtime, strategy: Strategy, spec) -> tuple[nn.Module, int]:
    """The wrapped model and its parameter count. Every rank starts from the
    same weights (seeded, without touching the global RNG); a sharding strategy
    with a large model builds it on ``meta`` and materialises only its shards."""
    image_size = spec.shape[-1] if spec.kind == "image" else 0
    meta = build_model(cfg.model.name, spec.shape[0], spec.num_classes, image_size, device="meta")
    parameters = count_parameters(meta)
    if cfg.model.activation_checkpointing:
        checkpoint_activations(meta, cfg.model.name)
    sharded_init = {"on": True, "off": False}.get(cfg.model.meta_init, parameters >= META_INIT_FROM_PARAMETERS)
    model = strategy.build(meta, runtime, cfg.training.seed, sharded_init)
    if cfg.model.compile:
        compile_for_training(model, cfg.parallel.strategy, cfg.model.compile_backend)
    return model, parameters


def build_run(cfg: TrainConfig, runtime: Runtime) -> Run:
    cfg.validate()
    strategy = make_strategy(cfg.parallel)
    strategy.check_world_size(runtime.world_size)
    data, training = cfg.data, cfg.training
    kind = model_input_kind(cfg.model.name)
    vocab = GPT_PRESETS[cfg.model.name].vocab_size if kind == "tokens" else 0
    train_set, test_set, spec = load_datasets(
        data.dataset,
        data.data_dir,
        runtime,
        data.synthetic_size,
        kind,
        vocab,
        cfg.model.seq_len,
        training.seed,
        data.download,
    )
    model, parameters = build_model_for(cfg, runtime, strategy, spec)
    optimizer = strategy.make_optimizer(model, optimizer_factory(cfg))
    precision = Precision(cfg.precision.dtype, runtime.device, strategy)
    if data.loader == "device":
        loader = DeviceResidentLoader(train_set, training.batch_size, runtime, seed=training.seed)
    else:
        loader = SampledLoader(
            train_set,
            training.batch_size,
            runtime,
            seed=training.seed,
            num_workers=data.num_workers,
            pin_memory=data.pin_memory,
            non_blocking=data.non_blocking,
        )
    steps = len(loader) // training.accum_steps
    if training.max_steps > 0:
        steps = min(steps, training.max_steps)
    if steps == 0:
        raise DistlabError(
            f"each rank has only {len(loader)} batch(es) of {training.batch_size}, fewer than --accum-steps "
            f"{training.accum_steps}: use a smaller --batch-size or a bigger dataset"
        )
    global_batch = training.batch_size * runtime.world_size * training.accum_steps
    return Run(cfg, runtime, strategy, model, optimizer, precision, loader, test_set, parameters, steps, global_batch)


def train_step(run: Run, batches: Iterator, sums: MetricSums) -> torch.Tensor:
    """One optimizer step over ``accum_steps`` micro-batches; all but the last
    keep their gradients local. Returns the step's mean loss on this rank."""
    accum = run.cfg.training.accum_steps
    step_loss = torch.zeros((), dtype=torch.float64, device=run.runtime.device)
    for micro in range(accum):
        inputs, targets = next(batches)
        with nullcontext() if micro == accum - 1 else run.strategy.no_sync(run.model):
            with run.precision.autocast():
                logits = run.model(inputs)
            losses, correct = loss_and_correct(logits, targets)
            run.precision.backward(losses.mean() / accum)
        sums.add(losses, correct)
        step_loss += losses.detach().mean().double() / accum
    if run.cfg.training.max_grad_norm > 0:
        run.precision.unscale(run.optimizer)
        run.strategy.clip_grad_norm_(run.model, run.cfg.training.max_grad_norm)
    run.precision.step(run.optimizer)
    run.optimizer.zero_grad(set_to_none=True)
    return step_loss


@contextmanager
def observed_step(run: Run) -> Iterator[dict[str, Any]]:
    """Measure this rank's memory over the optimizer step run inside: the peak and
    what it was made of, and the parameters, gradients and optimizer state held
    at the moment the optimizer steps (storage bytes; on CUDA also the allocator's peak)."""
    report: dict[str, Any] = {}

    def at_optimizer_step(*_) -> None:
        report.update(state_bytes(run.strategy, run.model, run.optimizer))

    handle = run.optimizer.register_step_pre_hook(at_optimizer_step)
    try:
        with MemoryTracker(lambda: run.strategy.state_tensors(run.model, run.optimizer), run.model) as tracker:
            yield report
    finally:
        handle.remove()
    report.update(peak=tracker.peak_bytes, peak_by_category=tracker.peak_by_category)
    if tracker.cuda_max_allocated is not None:
        report["cuda_max_allocated"] = tracker.cuda_max_allocated


class EpochBatches:
    """One epoch of the loader's batches: skips those a resumed run already
    trained on, times the waits, and shows the first to ``on_first``."""

    def __init__(self, loader, skip: int = 0, on_first=None):
        self.batches, self.wait_s = iter(loader), 0.0
        for _ in range(skip):  # the same order as before the interruption: skip what was seen
            next(self.batches)
        self.on_first = on_first if skip == 0 else None

    def __iter__(self):
        return self

    def __next__(self):
        asked = time.perf_counter()
        batch = next(self.batches)
        self.wait_s += time.perf_counter() - asked
        if self.on_first is not None:
            self.on_first(batch[0])
            self.on_first = None
        return batch


def train_epoch(
    run: Run, state: TrainState, data_check: DataOrderCheck, tolerance: FaultTolerance | None = None
) -> dict[str, Any]:
    """The rest of epoch ``state.epoch``, then its record (reduced over ranks once);
    ``tolerance`` checkpoints after the steps it is due."""
    cfg, runtime, steps = run.cfg, run.runtime, run.steps_per_epoch
    log_every = cfg.output.log_every if cfg.output.log_every != 0 else max(1, steps // 10)
    run.loader.set_epoch(state.epoch)
    run.model.train()
    sums = MetricSums(runtime.device)
    step_losses = torch.zeros(steps, dtype=torch.float64, device=runtime.device)
    first = state.step_in_epoch
    if first:
        restore_epoch_progress(state.epoch_progress, sums, step_losses, runtime)

    def check_order(inputs: torch.Tensor) -> None:
        for problem in data_check.check_first_batch(state.epoch, inputs):
            runtime.log(f"distlab: warning: {problem}")

    batches = EpochBatches(run.loader, skip=first * cfg.training.accum_steps, on_first=check_order)
    start = time.perf_counter()
    observe = min(OBSERVED_STEP, steps * cfg.training.epochs - 1)
    for step in range(first, steps):
        started = time.perf_counter()
        with observed_step(run) if state.global_step == observe else nullcontext() as memory:
            step_losses[step] = train_step(run, batches, sums)
        if memory is not None:
            state.memory = memory
        # No synchronize here: on a GPU the host runs a step or two ahead, which is what lets
        # non_blocking copies overlap; in steady state the host's step time is the GPU's.
        state.step_times_s.append(time.perf_counter() - started)
        state.step_in_epoch, state.global_step = step + 1, state.global_step + 1
        if tolerance is not None:
            tolerance.after_step(state, lambda: epoch_progress(sums, step_losses, step + 1, runtime.world_size))
        if log_every > 0 and ((step + 1) % log_every == 0 or step + 1 == steps):
            elapsed = time.perf_counter() - start
            runtime.log(
                f"  epoch {state.epoch + 1}/{cfg.training.epochs} step {step + 1}/{steps} | loss "
                f"{sums.loss:.4f} | {(step + 1 - first) * run.global_batch / elapsed:,.0f} samples/s"
            )
    synchronize(runtime.device)
    epoch_time = time.perf_counter() - start
    sums.all_reduce()
    dist.all_reduce(step_losses)  # one collective an epoch, not one a step
    test = evaluate(run.model, run.test_set, runtime, cfg.eval_batch_size(), run.precision)
    return {
        "epoch": state.epoch + 1,
        "train_loss": sums.loss,
        "train_accuracy": sums.accuracy,
        "test_loss": test["loss"],
        "test_accuracy": test["accuracy"],
        "epoch_time_s": epoch_time,
        "data_wait_s": batches.wait_s,  # rank 0's time blocked in next(loader)
        "samples_per_s": (steps - first) * run.global_batch / epoch_time,
        "steps": steps,
        "step_loss": (step_losses / runtime.world_size).tolist(),
    }


@dataclass
class TrainResult:
    """What :func:`train` hands back: the wrapped model, where the run ended, its size."""

    model: nn.Module
    state: TrainState
    parameters: int
    fault_tolerance: dict[str, Any] = field(default_factory=dict)
    """Restarts, the step this attempt resumed from, and the steps each resume lost."""

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.state.history


def train(cfg: TrainConfig, runtime: Runtime, state: TrainState | None = None) -> TrainResult:
    """Train from ``state`` (a fresh run by default, or what ``--resume`` finds) to the last epoch."""
    run = build_run(cfg, runtime)
    state = state or TrainState()
    tolerance = FaultTolerance(run)
    runtime.log(
        f"distlab: {cfg.parallel.strategy} | {cfg.model.name} ({run.parameters:,} parameters) | "
        f"{cfg.data.dataset} | {runtime.describe()} | global batch {run.global_batch} | "
        f"{run.steps_per_epoch} steps/epoch"
    )
    tolerance.resume(state)
    data_check = DataOrderCheck(run.loader)
    while state.epoch < cfg.training.epochs:
        record = train_epoch(run, state, data_check, tolerance)
        state.history.append(record)
        state.epoch, state.step_in_epoch, state.epoch_progress = state.epoch + 1, 0, {}
        runtime.log(
            f"epoch {record['epoch']}/{cfg.training.epochs} | train loss {record['train_loss']:.4f} | "
            f"test loss {record['test_loss']:.4f} acc {100 * record['test_accuracy']:.2f}% | "
            f"{record['epoch_time_s']:.1f}s, {record['samples_per_s']:,.0f} samples/s"
        )
    require_compiled(run.model, f"--compile with --strategy {cfg.parallel.strategy}")
    tolerance.at_end(state)
    return TrainResult(run.model, state, run.parameters, tolerance.log.summary())


def slowest_median_step_s(result: TrainResult, runtime: Runtime, skip: int = 3) -> float | None:
    """Median wall time of the optimizer steps after the first ``skip``, the slowest rank's."""
    times = result.state.step_times_s[skip:]
    (slowest,) = runtime.reduce([statistics.median(times) if times else float("nan")], "max")
    return None if math.isnan(slowest) else slowest


def train_and_record(cfg: TrainConfig, runtime: Runtime) -> None:
    """Train, then write the result (and the model, with ``--save-model``) on rank 0."""
    started = time.perf_counter()
    result = train(cfg, runtime)
    total_time = time.perf_counter() - started
    memory = gather_per_rank(result.state.memory, runtime)
    metrics = {
        "memory": {"ranks": memory},
        "epochs": result.history,
        "total_time_s": total_time,
        "parameters": result.parameters,
        "optimizer_steps": result.state.global_step,
        "step_time_median_s": slowest_median_step_s(result, runtime),
        "fault_tolerance": result.fault_tolerance,
    }
    name = cfg.run_name(runtime.world_size, runtime.device.type)
    state = full_state_dict(result.model, rank0_only=True) if cfg.checkpoint.save_model else None  # every rank joins
    path = finish_run(runtime, cfg.output.out, name, "train", cfg.to_dict(), metrics)
    if path is not None and state is not None:
        torch.save(state, path.with_suffix(".pt"))


@entry_point(TrainConfig, "distlab.train")
def main(cfg: TrainConfig) -> None:
    # Every rank refuses a job of the wrong size before it connects: a rank that refused after the group was
    # made could leave while a slower peer was still connecting, and that peer then said so too (a second line).
    make_strategy(cfg.parallel).check_world_size(launched_world_size())
    with distributed(cfg.parallel.device, cfg.parallel.backend, cfg.parallel.timeout_s) as runtime:
        # A function, so that the wrapped model, which holds the process group, is gone before the group is.
        train_and_record(cfg, runtime)


if __name__ == "__main__":
    run_main(main)
