"""One training loop for every strategy.

    torchrun --standalone --nproc_per_node=2 -m distlab.train --strategy ddp --model cnn --dataset mnist

Read it top to bottom: build data and model, let the strategy wrap the model,
then the same epoch loop for single, ddp and fsdp. Accumulation micro-steps
run inside ``strategy.no_sync``; evaluation runs on every rank and reduces
its counts.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .checks import DataOrderCheck
from .config import TrainConfig, parse_config
from .data import DeviceResidentLoader, SampledLoader, eval_loader, load_datasets
from .models import GPT_PRESETS, build_model, count_parameters, model_input_kind
from .results import write_result
from .runtime import DistlabError, Runtime, distributed, run_main
from .strategies import Strategy, full_state_dict, make_strategy

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Precision:
    """Autocast and, for fp16, a gradient scaler; fp32 makes both no-ops."""

    def __init__(self, precision: str, device: torch.device, sharded: bool):
        self.dtype = DTYPES.get(precision)
        self.device_type = device.type
        use_scaler = precision == "fp16"
        if sharded:
            # Each rank sees only its gradient shard, so inf/nan checks must agree across ranks.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device.type, enabled=use_scaler)
        else:
            self.scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def make_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.optimizer](params, lr=cfg.lr)


def make_strategy_from(cfg: TrainConfig) -> Strategy:
    return make_strategy(
        cfg.strategy,
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        reshard_after_forward=cfg.fsdp_reshard_after_forward,
        fsdp_param_dtype=DTYPES.get(cfg.fsdp_param_dtype),
    )


def loss_and_hits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target cross-entropy and correctness, for class labels (B,) and token targets (B, T) alike."""
    losses = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="none")
    return losses.view(targets.shape), logits.argmax(-1) == targets


@torch.no_grad()
def evaluate(model: nn.Module, dataset, runtime: Runtime, batch_size: int = 512, precision: Precision | None = None) -> dict[str, float]:
    """Loss and accuracy over the whole dataset, every rank on its own shard."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=runtime.device)
    for inputs, targets, real in eval_loader(dataset, batch_size, runtime):
        with precision.autocast() if precision else nullcontext():
            logits = model(inputs)
        losses, hits = loss_and_hits(logits, targets)
        mask = real.view(-1, *[1] * (targets.dim() - 1)).expand_as(targets)
        totals += torch.stack([losses[mask].sum().double(), hits[mask].sum().double(), mask.sum().double()])
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count, "samples": int(count)}


@dataclass
class TrainResult:
    """What :func:`train` hands back: the wrapped model and what it measured."""

    model: nn.Module
    history: list[dict[str, Any]] = field(default_factory=list)
    parameters: int = 0
    steps: int = 0


def train(cfg: TrainConfig, runtime: Runtime) -> TrainResult:
    strategy = make_strategy_from(cfg)
    strategy.check_world_size(runtime.world_size)
    if cfg.accum_steps < 1 or cfg.batch_size < 1:
        raise DistlabError("--batch-size and --accum-steps must be at least 1")

    kind = model_input_kind(cfg.model)
    vocab = GPT_PRESETS[cfg.model].vocab_size if kind == "tokens" else 0
    train_set, test_set, spec = load_datasets(cfg.dataset, cfg.data_dir, runtime, cfg.synthetic_size, kind, vocab, cfg.seq_len, cfg.seed, cfg.download)

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank: FSDP shards whatever each rank built
    image_size = spec.shape[-1] if spec.kind == "image" else 0
    model = build_model(cfg.model, spec.shape[0], spec.num_classes, image_size).to(runtime.device)
    n_params = count_parameters(model)
    model = strategy.wrap(model, runtime)
    optimizer = make_optimizer(cfg, model.parameters())
    precision = Precision(cfg.precision, runtime.device, sharded=cfg.strategy == "fsdp")

    if cfg.loader == "device":
        loader = DeviceResidentLoader(train_set, cfg.batch_size, runtime, seed=cfg.seed)
    else:
        loader = SampledLoader(train_set, cfg.batch_size, runtime, seed=cfg.seed, num_workers=cfg.num_workers, pin_memory=cfg.pin_memory, non_blocking=cfg.non_blocking)
    steps = len(loader) // cfg.accum_steps
    if cfg.max_steps > 0:
        steps = min(steps, cfg.max_steps)
    if steps == 0:
        raise DistlabError(f"each rank has only {len(loader)} batch(es) of {cfg.batch_size}, fewer than --accum-steps {cfg.accum_steps}: use a smaller --batch-size or a bigger dataset")
    log_every = cfg.log_every if cfg.log_every != 0 else max(1, steps // 10)

    global_batch = cfg.batch_size * runtime.world_size * cfg.accum_steps
    runtime.log(f"distlab: {cfg.strategy} | {cfg.model} ({n_params:,} parameters) | {cfg.dataset} | {runtime.describe()} | global batch {global_batch} | {steps} steps/epoch")

    result = TrainResult(model=model, parameters=n_params)
    data_check = DataOrderCheck(loader)
    for epoch in range(cfg.epochs):
        loader.set_epoch(epoch)
        model.train()
        totals = torch.zeros(3, dtype=torch.float64, device=runtime.device)
        step_losses = torch.zeros(steps, dtype=torch.float64, device=runtime.device)
        batches = iter(loader)
        data_wait = 0.0
        start = time.perf_counter()
        for step in range(steps):
            for micro in range(cfg.accum_steps):
                asked = time.perf_counter()
                inputs, targets = next(batches)
                data_wait += time.perf_counter() - asked
                if step == 0 and micro == 0:
                    for problem in data_check.first_batch(epoch, inputs):
                        runtime.log(f"distlab: warning: {problem}")
                is_last = micro == cfg.accum_steps - 1
                with nullcontext() if is_last else strategy.no_sync(model):
                    with precision.autocast():
                        logits = model(inputs)
                    losses, hits = loss_and_hits(logits, targets)
                    precision.scaler.scale(losses.mean() / cfg.accum_steps).backward()
                totals += torch.stack([losses.detach().sum().double(), hits.sum().double(), torch.tensor(targets.numel(), dtype=torch.float64, device=runtime.device)])
                step_losses[step] += losses.detach().mean().double() / cfg.accum_steps
            precision.scaler.step(optimizer)
            precision.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            result.steps += 1
            if log_every > 0 and ((step + 1) % log_every == 0 or step + 1 == steps):
                elapsed = time.perf_counter() - start
                runtime.log(f"  epoch {epoch + 1}/{cfg.epochs} step {step + 1}/{steps} | loss {totals[0].item() / totals[2].item():.4f} | {(step + 1) * global_batch / elapsed:,.0f} samples/s")
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        epoch_time = time.perf_counter() - start
        dist.all_reduce(totals)
        dist.all_reduce(step_losses)  # one collective an epoch, not one a step
        test = evaluate(model, test_set, runtime, cfg.eval_batch_size, precision)
        record = {
            "epoch": epoch + 1,
            "train_loss": totals[0].item() / totals[2].item(),
            "train_accuracy": totals[1].item() / totals[2].item(),
            "test_loss": test["loss"],
            "test_accuracy": test["accuracy"],
            "epoch_time_s": epoch_time,
            "data_wait_s": data_wait,  # rank 0's time blocked in next(loader)
            "samples_per_s": steps * global_batch / epoch_time,
            "steps": steps,
            "step_loss": (step_losses / runtime.world_size).tolist(),
        }
        result.history.append(record)
        runtime.log(f"epoch {epoch + 1}/{cfg.epochs} | train loss {record['train_loss']:.4f} | test loss {test['loss']:.4f} acc {100 * test['accuracy']:.2f}% | {epoch_time:.1f}s, {record['samples_per_s']:,.0f} samples/s")
    return result


def default_run_name(cfg: TrainConfig, runtime: Runtime) -> str:
    return cfg.run_name or f"{cfg.strategy}-{cfg.model}-{cfg.dataset}-{runtime.world_size}x{runtime.device.type}"


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    with distributed(cfg.device, cfg.backend, cfg.timeout_s) as runtime:
        started = time.perf_counter()
        result = train(cfg, runtime)
        total_time = time.perf_counter() - started
        state = full_state_dict(result.model) if cfg.save_model else None  # a collective under FSDP: every rank joins
        if runtime.is_main:
            path = Path(cfg.out) / f"{default_run_name(cfg, runtime)}.json"
            metrics = {"epochs": result.history, "total_time_s": total_time, "parameters": result.parameters, "optimizer_steps": result.steps}
            write_result(path, "train", cfg.to_dict(), metrics, runtime.device, world_size=runtime.world_size, backend=runtime.backend)
            if state is not None:
                torch.save(state, path.with_suffix(".pt"))
            runtime.log(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
