"""The training configuration, and the command line generated from it.

Each field's ``help`` is its documentation and its ``--help`` text: one
source, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from .models import MODEL_NAMES
from .strategies import STRATEGY_NAMES


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    """Everything one training run depends on."""

    strategy: str = _opt("ddp", "how the model is wrapped: single (1 rank), ddp (torch DDP), fsdp (FSDP2 fully_shard), or the course's own naive_ddp / bucketed_ddp (distlab.mini_ddp)", choices=list(STRATEGY_NAMES))
    model: str = _opt("cnn", "cnn (the reference notes' MNIST CNN), resnet18, or a GPT preset", choices=MODEL_NAMES)
    dataset: str = _opt("synthetic", "mnist, cifar10 (torchvision, downloaded into --data-dir when online) or synthetic (offline, same shapes)", choices=["mnist", "cifar10", "synthetic"])
    device: str = _opt("auto", "auto (cuda if present), cpu, or cuda; the backend follows: nccl on cuda, gloo on cpu", choices=["auto", "cpu", "cuda"])
    backend: str = _opt("auto", "override the backend: gloo also lets several ranks share one GPU", choices=["auto", "gloo", "nccl"])
    epochs: int = _opt(1, "passes over the training set")
    batch_size: int = _opt(128, "samples per rank per micro-step; the global batch is batch_size x ranks x accum_steps")
    accum_steps: int = _opt(1, "micro-steps per optimizer step; all but the last skip gradient sync (no_sync)")
    lr: float = _opt(1e-3, "learning rate")
    optimizer: str = _opt("adam", "adam, adamw or sgd (momentum 0.9)", choices=["adam", "adamw", "sgd"])
    precision: str = _opt("fp32", "fp32, fp16 (autocast + GradScaler; use this on T4) or bf16 (autocast)", choices=["fp32", "fp16", "bf16"])
    fsdp_reshard_after_forward: bool = _opt(True, "fsdp: free gathered parameters after forward (FULL_SHARD); --no-... keeps them until backward (SHARD_GRAD_OP)")
    fsdp_param_dtype: str = _opt("none", "fsdp: MixedPrecisionPolicy parameter dtype (gradients reduced in fp32)", choices=["none", "bf16", "fp16"])
    ddp_bucket_cap_mb: float = _opt(25.0, "ddp and bucketed_ddp: gradient bucket size in MB")
    loader: str = _opt("dataloader", "dataloader (DistributedSampler + DataLoader) or device (whole dataset resident on the device)", choices=["dataloader", "device"])
    num_workers: int = _opt(2, "dataloader: worker processes per rank (keep <= 2 per rank on Kaggle's 4 vCPUs)")
    pin_memory: bool = _opt(True, "dataloader: page-locked host batches (only with --device cuda)")
    non_blocking: bool = _opt(True, "dataloader: asynchronous host-to-device copies")
    max_steps: int = _opt(0, "stop each epoch after this many optimizer steps (0: the whole epoch)")
    synthetic_size: int = _opt(8192, "synthetic: training samples (test set: one eighth)")
    seq_len: int = _opt(64, "GPT models: tokens per sample")
    eval_batch_size: int = _opt(512, "samples per rank per evaluation batch")
    seed: int = _opt(0, "seeds the weights (identical on every rank) and the data order")
    data_dir: str = _opt("./data", "where mnist/cifar10 live or are downloaded to")
    download: bool = _opt(True, "rank 0 downloads mnist/cifar10 into --data-dir when they are missing")
    out: str = _opt("results", "directory for the result JSON (written by rank 0)")
    run_name: str = _opt("", "result file name without .json (default: strategy-model-dataset-ranks-device)")
    log_every: int = _opt(0, "rank 0 prints progress every this many steps (0: about ten times an epoch; -1: never)")
    timeout_s: float = _opt(300.0, "seconds a collective may wait for a peer before the run fails")
    save_model: bool = _opt(False, "also write the full state dict next to the result file")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --standalone --nproc_per_node=N -m distlab.train",
        description="Train one model with one strategy and write a result JSON with provenance.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        default = f.default if f.default is not MISSING else None
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=meta["help"])
        else:
            parser.add_argument(flag, type=type(default), default=default, help=meta["help"], choices=meta.get("choices"))
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    return TrainConfig(**vars(build_parser().parse_args(argv)))
