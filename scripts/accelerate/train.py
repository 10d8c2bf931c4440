"""Train one of the course's models with Hugging Face Accelerate.

    accelerate launch --config_file scripts/accelerate/config_ddp.yaml scripts/accelerate/train.py
    accelerate launch --config_file scripts/accelerate/config_fsdp.yaml scripts/accelerate/train.py --model gpt-tiny

The config file decides how the model is wrapped (DDP or FSDP2), how many
processes run and in which precision; the script is the same for all of them.
Its flags are a subset of ``distlab.train``'s and mean the same, so both can
train one model on the same data from the same seed (tests/test_accelerate.py
checks that they end with the same weights).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed.nn  # noqa: F401  before the process group exists (distlab.runtime.GROUP_AS_DEFAULT_ARGUMENT)
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType
from torch.utils.data import DataLoader

from distlab.config import TrainConfig
from distlab.data import DataSpec, load_datasets
from distlab.models import GPT_PRESETS, build_model, model_input_kind
from distlab.parallel.materialize import materialize
from distlab.runtime import Runtime
from distlab.train import loss_and_correct, optimizer_factory

FLAGS = {
    "model": str,
    "dataset": str,
    "data_dir": str,
    "synthetic_size": int,
    "num_workers": int,
    "epochs": int,
    "batch_size": int,
    "accum_steps": int,
    "max_steps": int,
    "lr": float,
    "optimizer": str,
    "seed": int,
    "device": str,
}


def parse_config(argv: list[str] | None = None) -> tuple[TrainConfig, str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind in FLAGS.items():
        # No defaults here: a flag left out takes distlab.train's default.
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=argparse.SUPPRESS, help="as for distlab.train"
        )
    parser.add_argument("--save", default="", help="write the trained model's full state dict to this file")
    args = vars(parser.parse_args(argv))
    save = args.pop("save")
    return TrainConfig.from_flags(**args), save


def make_model(cfg: TrainConfig, spec: DataSpec) -> torch.nn.Module:
    image_size = spec.shape[-1] if spec.kind == "image" else 0
    meta = build_model(cfg.model.name, spec.shape[0], spec.num_classes, image_size, device="meta")
    # distlab.train's initialisation, so both start from the same weights;
    # prepare() moves them to the device.
    model = materialize(meta, torch.device("cpu"), cfg.training.seed)
    # FSDP's TRANSFORMER_BASED_WRAP shards each module whose class the model
    # lists here (the Hugging Face convention). distlab's models name their
    # units themselves: listing their classes makes Accelerate shard the same
    # blocks (GPT) or layers (CNN) that distlab.train --strategy fsdp does.
    model._no_split_modules = sorted({type(unit).__name__ for unit in model.shard_units()})
    return model


def main() -> None:
    cfg, save = parse_config()
    training = cfg.training
    accelerator = Accelerator(
        # Without a GPU the launcher still starts every process, but only
        # cpu=True makes them join one gloo group: otherwise each trains alone.
        cpu=cfg.parallel.device == "cpu" or not torch.cuda.is_available(),
        gradient_accumulation_steps=training.accum_steps,
        # Accelerate shards a loader by dealing out whole batches: process r
        # gets batches r, r + n, r + 2n, ... of one shuffled order, where
        # distlab's DistributedSampler deals out single samples. The processes
        # see different batches, but each step's n batches together are the
        # same samples, and DDP averages the gradient over all of them. The
        # seedable sampler shuffles with randperm seeded by seed + epoch, the
        # very order DistributedSampler draws; the default sampler would not.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=training.seed),
    )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and (
        accelerator.distributed_type != DistributedType.FSDP
    ):
        # Accelerate turns FSDP on only on accelerator devices (CUDA, XPU, ...);
        # on CPU processes it would train with DDP and let the run pass for FSDP.
        if accelerator.is_main_process:
            print(
                f"accelerate: the config asks for FSDP, but on {accelerator.device.type} Accelerate runs "
                f"{accelerator.distributed_type.value} instead: run it on GPUs, "
                "or distlab.train --strategy fsdp on CPU",
                file=sys.stderr,
            )
        raise SystemExit(2)
    train(accelerator, cfg, save)
    # The prepared model holds the process group: train() has dropped it, free_memory() drops the accelerator's
    # own references (and collects FSDP's reference cycles), so the group goes now, not at interpreter shutdown.
    accelerator.free_memory()
    accelerator.end_training()  # destroys the process group


def train(accelerator: Accelerator, cfg: TrainConfig, save: str) -> None:
    data, training = cfg.data, cfg.training
    # load_datasets wants distlab's view of the job; Accelerate knows it.
    runtime = Runtime(
        accelerator.process_index,
        accelerator.local_process_index,
        accelerator.num_processes,
        accelerator.device,
        str(accelerator.state.backend),
    )
    kind = model_input_kind(cfg.model.name)
    vocab = GPT_PRESETS[cfg.model.name].vocab_size if kind == "tokens" else 0
    train_set, test_set, spec = load_datasets(
        data.dataset, data.data_dir, runtime, data.synthetic_size, kind, vocab, cfg.model.seq_len, training.seed
    )
    model = make_model(cfg, spec)
    optimizer = optimizer_factory(cfg)(model.parameters())
    train_loader = DataLoader(
        train_set, batch_size=training.batch_size, shuffle=True, drop_last=True, num_workers=data.num_workers
    )
    test_loader = DataLoader(test_set, batch_size=cfg.eval_batch_size())
    # One call for all four: under FSDP2 the optimizer must learn the sharded
    # parameters that replace the model's own.
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    accelerator.print(
        f"accelerate: {accelerator.distributed_type.value}, {accelerator.num_processes} process(es), "
        f"backend {accelerator.state.backend}, device {accelerator.device.type}, "
        f"model wrapped as {type(model).__name__}"
    )

    steps = len(train_loader) // training.accum_steps
    if training.max_steps > 0:
        steps = min(steps, training.max_steps)
    for epoch in range(training.epochs):
        train_loader.set_epoch(epoch)
        model.train()
        batches = iter(train_loader)
        for step in range(steps):
            for _ in range(training.accum_steps):
                # All but the last micro-batch of a step skip the gradient
                # all-reduce, and the optimizer only steps on the last one.
                with accelerator.accumulate(model):
                    inputs, targets = next(batches)
                    losses, _ = loss_and_correct(model(inputs), targets)
                    accelerator.backward(losses.mean())  # divided by accum_steps inside
                    optimizer.step()
                    optimizer.zero_grad()
            if step % 10 == 0 or step == steps - 1:
                loss = accelerator.reduce(losses.detach().mean(), reduction="mean")
                accelerator.print(f"epoch {epoch + 1} step {step + 1}/{steps} loss {loss.item():.4f}")

        model.eval()
        correct = total = 0
        with torch.no_grad():
            for inputs, targets in test_loader:
                _, right = loss_and_correct(model(inputs), targets)
                # The last batch is padded so every process runs it; this drops the padding.
                right = accelerator.gather_for_metrics(right)
                correct, total = correct + right.sum().item(), total + right.numel()
        accelerator.print(f"epoch {epoch + 1}: test accuracy {correct / total:.4f} on {total} samples")

    state = accelerator.get_state_dict(model)  # under FSDP a collective: every process takes part
    if save and accelerator.is_main_process:
        torch.save({key: value.detach().cpu() for key, value in state.items()}, save)


if __name__ == "__main__":
    main()
