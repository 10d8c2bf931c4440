"""Train the course's MNIST CNN with DDP (torch's DistributedDataParallel) on every GPU of a machine, or on CPU ranks.

    torchrun --standalone --nproc_per_node=2 ddp_train.py --dataset mnist --epochs 5 --out ddp.json
    torchrun --standalone --nproc_per_node=2 ddp_train.py --dataset mnist --epochs 8 --resume --out ddp.json
    torchrun --standalone --nproc_per_node=2 ddp_train.py --device cuda --backend gloo --out ddp.json  # 1 GPU, shared

Each rank holds the whole model and trains on its own shard of the data. During backward DDP all-reduces the
gradients in buckets, so every rank takes the same optimizer step and the replicas stay identical. Rank 0 saves a
checkpoint after every epoch (--resume continues from it) and writes a JSON summary, with the environment it ran
in, to --out. Without --device it runs on the GPUs only where each rank has one of its own; with --backend gloo,
ranks share the GPUs there are.
"""

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before init_process_group: see main)
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from distlab.models import build_model


def default_device() -> str:
    """cuda only where every rank on this machine can have a GPU of its own (torchrun sets LOCAL_WORLD_SIZE),
    else cpu: a run told nothing never takes a GPU that does not exist. Ranks share a GPU only when asked to,
    with --device cuda --backend gloo."""
    return "cuda" if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)) else "cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="mnist", choices=["mnist", "synthetic"])
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--samples", type=int, default=8192, help="synthetic: training samples (test: an eighth)")
    p.add_argument("--epochs", type=int, default=1, help="the last epoch (a resumed run continues up to it)")
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--max-steps", type=int, default=0, help="optimizer steps per epoch at most (0: all)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "fp16", "bf16"],
        help="auto: the fastest the GPU has (bf16 from Ampere on, fp16 on a T4); fp16: a T4's path on any GPU; "
        "a CPU computes in fp32",
    )
    p.add_argument(
        "--device",
        default=default_device(),
        choices=["cuda", "cpu"],
        help="default: cuda if this machine has a GPU for every rank, else cpu",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: nccl on cuda, gloo on cpu; gloo also lets more ranks than GPUs share them",
    )
    p.add_argument("--checkpoint", default="ddp_checkpoint.pt", help="written after every epoch")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint")
    p.add_argument("--out", default="ddp_train.json")
    return p.parse_args(argv)


def device_and_backend(args) -> tuple[torch.device, str]:
    """This rank's device and the job's backend. NCCL drives one GPU per rank: rank r on cuda:r. gloo lets more
    ranks than GPUs share them, rank r on GPU r mod the count (two ranks on one GPU both compute on cuda:0)."""
    backend = args.backend if args.backend != "auto" else ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cpu":
        if backend == "nccl":
            raise SystemExit("ddp_train.py: nccl moves CUDA tensors only: use --backend gloo with --device cpu")
        return torch.device("cpu"), backend
    gpus, ranks = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpus == 0:
        raise SystemExit("ddp_train.py: --device cuda, but this machine has no CUDA GPU: use --device cpu")
    if backend == "nccl" and ranks > gpus:
        raise SystemExit(
            f"ddp_train.py: NCCL needs one GPU per rank, and {ranks} ranks have {gpus} GPU(s): "
            "pass --backend gloo to let them share, or --device cpu"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % gpus), backend


def compute_dtype(device: torch.device, precision: str) -> torch.dtype:
    if device.type != "cuda" or precision == "fp32":
        return torch.float32  # asked for, or a CPU, which has no fast half-precision matmuls
    if precision != "auto":
        return {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    # bf16 keeps fp32's range (no loss scaling) but needs Ampere (8.0) or newer; a T4 (7.5) has fp16 tensor cores.
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def synthetic(args, n: int, split: int) -> TensorDataset:
    """distlab.train's --dataset synthetic, recipe for recipe, so the two compare sample for sample."""
    # MNIST's shape: each class a fixed random template plus noise, so it can be learned
    templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(args.seed))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + 1 + split)
    labels = torch.randint(10, (n,), generator=gen)
    return TensorDataset(templates[labels] + torch.randn(n, 1, 28, 28, generator=gen), labels)


def load_data(args) -> tuple:
    if args.dataset == "synthetic":
        return synthetic(args, args.samples, 0), synthetic(args, max(args.samples // 8, 64), 1)
    from torchvision import datasets, transforms  # only MNIST needs torchvision

    if dist.get_rank() == 0:  # one download, not N processes writing the same files
        for train in (True, False):
            datasets.MNIST(args.data_dir, train=train, download=True)
    dist.barrier()
    normalize = transforms.Normalize((0.1307,), (0.3081,))  # MNIST's mean and std: inputs of zero mean, unit spread
    to_tensor = transforms.Compose([transforms.ToTensor(), normalize])
    return tuple(datasets.MNIST(args.data_dir, train=train, transform=to_tensor) for train in (True, False))


def build(args, device: torch.device):
    """The model, wrapped, and its parameter count."""
    torch.manual_seed(args.seed)  # reproducible; DDP itself makes the replicas equal, broadcasting rank 0's weights
    model = build_model("cnn", device=device)
    parameters = sum(p.numel() for p in model.parameters())
    # device_ids names the one GPU this process drives; on CPU there is none to name.
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None), parameters


def loss_and_correct(logits: torch.Tensor, targets: torch.Tensor):
    """Per-sample cross-entropy (in fp32 whatever the compute dtype) and hits."""
    return F.cross_entropy(logits.float(), targets, reduction="none"), logits.argmax(-1) == targets


@torch.no_grad()
def evaluate(model, dataset, args, device, autocast) -> tuple[float, float]:
    # Rank r takes samples r, r + N, r + 2N, ...: each test sample exactly once. A DistributedSampler would pad the
    # shards to equal length with repeated samples, counting those twice. Unequal shards are safe because the
    # bare replica (model.module) runs no collective in forward; DDP's forward may broadcast buffers, which a rank
    # with fewer batches would never join.
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=args.batch_size)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with autocast:
            losses, correct = loss_and_correct(model.module(x), y)
        sums += torch.stack([losses.sum().double(), correct.sum().double(), sums.new_tensor(len(y))])
    dist.all_reduce(sums)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def save_checkpoint(path: str, model, optimizer, scaler, epoch: int) -> None:
    if dist.get_rank() == 0:  # the replicas are identical: one writer, or N processes clobber one file
        # model.module: keys without DDP's "module." prefix, so the file loads into a plain model too
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
        torch.save({**state, "scaler": scaler.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)  # a crash while writing leaves the previous checkpoint whole
    # Every rank moves on only once the file is whole: a job that fails later, on any rank, resumes from this epoch.
    dist.barrier()


def load_checkpoint(path: str, model, optimizer, scaler, device: torch.device) -> int:
    # Every rank reads it: each holds its own optimizer state. map_location puts the tensors on this rank's
    # device; without it, everything saved from cuda:0 would load onto cuda:0 in every process.
    state = torch.load(path, map_location=device, weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    return state["epoch"]


def environment(device: torch.device) -> dict:
    """What a reader needs to trust or redo the numbers: versions, hardware, the command."""
    cuda, cpuinfo = device.type == "cuda", Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "device": str(device),
        "device_name": gpus[device.index].name if cuda else cpu,
        "device_memory_bytes": gpus[device.index].total_memory if cuda else None,
        "gpus": [gpu.name for gpu in gpus],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "command": " ".join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def train(args, device: torch.device) -> None:
    rank, world, cuda = dist.get_rank(), dist.get_world_size(), device.type == "cuda"
    train_set, test_set = load_data(args)
    dtype = compute_dtype(device, args.precision)
    model, parameters = build(args, device)
    # fused: one kernel, and no temporary copy of the whole state (foreach Adam briefly makes one).
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=cuda)
    # fp16 gradients underflow without loss scaling. They are all-reduced before the scaler looks at them, so
    # every rank finds the same overflow and skips the same steps.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    first = load_checkpoint(args.checkpoint, model, optimizer, scaler, device) if args.resume else 0
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    # drop_last: every step a whole batch, as distlab.train takes them (MNIST's 30,000 images a rank leave 48)
    loader = DataLoader(
        train_set, args.batch_size, sampler=sampler, num_workers=args.num_workers, pin_memory=cuda, drop_last=True
    )
    steps = min(len(loader), args.max_steps or len(loader))
    if rank == 0:  # N processes would print the same lines
        print(f"ddp | cnn: {parameters:,} parameters | {world} x {device.type}, {dist.get_backend()} | {dtype} | "
              f"epochs {first + 1}-{args.epochs}", flush=True)  # fmt: skip
    history = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for epoch in range(first, args.epochs):
        # A new shuffle each epoch, the same on every rank, so the shards never overlap. Seeded by the epoch's
        # number: a resumed run sees exactly the order an uninterrupted one would have.
        sampler.set_epoch(epoch)
        model.train()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, targets
        step_loss = torch.zeros(steps, dtype=torch.float64, device=device)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for step, (x, y) in zip(range(steps), loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                losses, correct = loss_and_correct(model(x), y)
            scaler.scale(losses.mean()).backward()  # DDP all-reduces (averages) the gradients during backward
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step_loss[step] = losses.detach().mean()  # no .item(): it would stall the GPU every step
            sums += torch.stack([losses.detach().sum().double(), correct.sum().double(), sums.new_tensor(y.numel())])
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        dist.all_reduce(sums)  # one collective an epoch, not one a step
        dist.all_reduce(step_loss)
        test_loss, test_accuracy = evaluate(model, test_set, args, device, autocast)
        save_checkpoint(args.checkpoint, model, optimizer, scaler, epoch + 1)
        history.append(
            {
                "epoch": epoch + 1,
                "epoch_time_s": seconds,
                "samples_per_s": steps * args.batch_size * world / seconds,
                "train_loss": (sums[0] / sums[2]).item(),
                "train_accuracy": (sums[1] / sums[2]).item(),
                "test_loss": test_loss,
                "test_accuracy": test_accuracy,
                "step_loss": (step_loss / world).tolist(),
            }
        )
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {history[-1]['train_loss']:.4f} | test loss {test_loss:.4f} "
                  f"acc {100 * test_accuracy:.2f}% | {seconds:.1f} s", flush=True)  # fmt: skip
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else -1], device=device)
    ranks = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(ranks, mine)
    if rank == 0:
        memory = [{"cuda_max_allocated": int(r[0]) if cuda else None} for r in ranks]
        metrics = {"parameters": parameters, "compute_dtype": str(dtype), "epochs": history, "memory": memory}
        record = {"schema": "distlab.result/1", "kind": "ddp_train", "config": vars(args), "metrics": metrics}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**record, "environment": environment(device)}, indent=2) + "\n")
        print(f"wrote {Path(args.out).name}", flush=True)


def main() -> None:
    args = parse_args()
    device, backend = device_and_backend(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every process would start a context on GPU 0
    # torch.distributed.nn's functions take the default group as a default argument, which Python fixes when the
    # module is imported. Imported after this line (DDP's first use imports it), they would keep the group alive
    # after destroy_process_group, and its gloo threads could then abort the process as it exits: it is imported
    # above, while there is no group yet.
    # NCCL carries CUDA tensors only. Its group gets a gloo leg for CPU tensors: with fp16 the scaler's overflow
    # flag, and the gradient norm, of shards kept on the CPU (FSDP2's offload) are all-reduced as CPU tensors.
    cuda = backend == "nccl"
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else backend, device_id=device if cuda else None)
    try:
        train(args, device)  # the model, which holds the group, is gone when train returns
    finally:
        dist.destroy_process_group()  # even after an error: no rank leaves its peers waiting on a dead group


if __name__ == "__main__":
    main()
