"""Train the course's CNN or a GPT with FSDP2 (torch's fully_shard) on every GPU of a machine, or on CPU ranks.

    torchrun --standalone --nproc_per_node=2 fsdp_train.py --model cnn --dataset mnist --epochs 5 --out fsdp.json
    torchrun --standalone --nproc_per_node=2 fsdp_train.py --model gpt-xl --n-layer 30 --checkpoint-activations \
        --batch-size 1 --max-steps 10 --out gpt.json

Each rank stores 1/N of every parameter, gradient and Adam moment. Before a unit's forward (and again before
its backward) the ranks all-gather its parameters; after its backward they reduce-scatter its gradients, so
each rank steps only its own shard. `--wrap ddp` replicates the model instead: the baseline to compare with.
`--prefetch-depth 2` keeps two units' all-gathers in flight instead of FSDP2's one; `--cpu-offload` keeps the
shards, gradients and Adam state in pinned host memory and steps Adam on the CPU. `--adapter-rank 8` freezes the
GPT and trains rank-8 adapters beside each block's linear layers (LoRA), and counts the bytes one step sends.
On GPUs, `--memory-snapshot DIR` records CUDA's allocator over the last epoch's first step and writes one
snapshot a rank to DIR (open it on pytorch.org/memory_viz).
Rank 0 writes a JSON summary, with the environment it ran in, to --out. Without --device it runs on the GPUs
only where each rank has one of its own; `--device cuda --backend gloo` lets ranks share the GPUs there are.
"""

import argparse
import gc
import json
import os
import pickle
import platform
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distlab.comm.traffic import TrafficCounter
from distlab.measure.allocator import read_snapshot
from distlab.models import GPT, GPT_PRESETS, build_model
from distlab.predict.traffic import expected_bytes_per_step


def default_device() -> str:
    """cuda only where every rank on this machine can have a GPU of its own (torchrun sets LOCAL_WORLD_SIZE),
    else cpu: a run told nothing never takes a GPU that does not exist. Ranks share a GPU only when asked to,
    with --device cuda --backend gloo."""
    return "cuda" if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)) else "cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", choices=["cnn", *GPT_PRESETS])
    p.add_argument("--n-layer", type=int, default=0, help="GPT: blocks (0: the preset's)")
    p.add_argument("--dataset", default="mnist", choices=["mnist", "synthetic"], help="a GPT always reads tokens")
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--samples", type=int, default=8192, help="synthetic: training samples (test: an eighth)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--max-steps", type=int, default=0, help="optimizer steps per epoch at most (0: all)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute each unit's insides in backward")
    p.add_argument("--wrap", default="fsdp", choices=["fsdp", "ddp"])
    p.add_argument(
        "--prefetch-depth",
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="fsdp: units each one all-gathers ahead, forward and backward (0: FSDP2's own, one ahead)",
    )
    p.add_argument("--cpu-offload", action="store_true", help="fsdp: state in host memory, Adam on the CPU")
    p.add_argument(
        "--adapter-rank",
        type=int,
        default=0,
        help="GPT: freeze it and train rank-R adapters beside each block's linear layers (0: off); the first step's "
        "bytes are counted, and predicted for collectives in one dtype (--precision fp32)",
    )
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
    p.add_argument("--memory-snapshot", default="", help="cuda: a snapshot of the allocator a rank, written here")
    p.add_argument("--out", default="fsdp_train.json")
    args = p.parse_args(argv)
    if args.adapter_rank < 0:
        p.error(f"--adapter-rank is an adapter's width: 1 or more, or 0 for none, not {args.adapter_rank}")
    if args.adapter_rank and args.model == "cnn":
        p.error("--adapter-rank adapts a GPT's blocks: pass a GPT preset to --model")
    if args.memory_snapshot and args.device == "cpu":
        p.error("--memory-snapshot records CUDA's allocator: use --device cuda, or leave it out")
    return args


def device_and_backend(args) -> tuple[torch.device, str]:
    """This rank's device and the job's backend. NCCL drives one GPU per rank: rank r on cuda:r. gloo lets more
    ranks than GPUs share them, rank r on GPU r mod the count (two ranks on one GPU both compute on cuda:0)."""
    backend = args.backend if args.backend != "auto" else ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cpu":
        if backend == "nccl":
            raise SystemExit("fsdp_train.py: nccl moves CUDA tensors only: use --backend gloo with --device cpu")
        return torch.device("cpu"), backend
    gpus, ranks = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpus == 0:
        raise SystemExit("fsdp_train.py: --device cuda, but this machine has no CUDA GPU: use --device cpu")
    if backend == "nccl" and ranks > gpus:
        raise SystemExit(
            f"fsdp_train.py: NCCL needs one GPU per rank, and {ranks} ranks have {gpus} GPU(s): "
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
    if args.model == "cnn":  # MNIST's shape: each class a fixed random template plus noise, so it can be learned
        templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(args.seed))
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + 1 + split)
        labels = torch.randint(10, (n,), generator=gen)
        return TensorDataset(templates[labels] + torch.randn(n, 1, 28, 28, generator=gen), labels)
    cfg, gen = GPT_PRESETS[args.model], torch.Generator().manual_seed(args.seed + split)
    start, stride = torch.randint(cfg.vocab_size, (n, 1), generator=gen), torch.randint(1, 8, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size  # the next token follows from the last
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def load_data(args) -> tuple:
    if args.model != "cnn" or args.dataset == "synthetic":
        return synthetic(args, args.samples, 0), synthetic(args, max(args.samples // 8, 64), 1)
    from torchvision import datasets, transforms  # only MNIST needs torchvision

    if dist.get_rank() == 0:  # one download, not N processes writing the same files
        for train in (True, False):
            datasets.MNIST(args.data_dir, train=train, download=True)
    dist.barrier()
    normalize = transforms.Normalize((0.1307,), (0.3081,))  # MNIST's mean and std: inputs of zero mean, unit spread
    to_tensor = transforms.Compose([transforms.ToTensor(), normalize])
    return tuple(datasets.MNIST(args.data_dir, train=train, transform=to_tensor) for train in (True, False))


class LowRankAdapter(torch.nn.Module):
    """A frozen linear layer and a trainable rank-r path beside it (LoRA): x -> base(x) + up(down(x)). `up` starts
    at zero, so the adapted model starts as the base model computes."""

    def __init__(self, base: torch.nn.Linear, rank: int):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = torch.nn.Linear(base.in_features, rank, bias=False)
        self.up = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def add_adapters(model, rank: int) -> None:
    """Freeze every parameter, then put an adapter beside each linear layer of each unit (a GPT's blocks)."""
    model.requires_grad_(False)
    linears = [(parent, name, child) for unit in model.shard_units() for parent in unit.modules()
               for name, child in parent.named_children() if isinstance(child, torch.nn.Linear)]  # fmt: skip
    for parent, name, linear in linears:
        setattr(parent, name, LowRankAdapter(linear, rank))


def build(args, device: torch.device, dtype: torch.dtype):
    """The model, wrapped, and its parameter count."""
    torch.manual_seed(args.seed)  # every rank builds the same weights; fully_shard then keeps each rank's slice
    if args.model == "cnn":
        model = build_model("cnn", device=device)
    else:  # built where it trains: its fp32 weights are only 4 of the 16 bytes a value DDP would need there
        with torch.device(device):
            preset = GPT_PRESETS[args.model]
            model = GPT(replace(preset, n_layer=args.n_layer or preset.n_layer))
            if args.adapter_rank:  # after the base's weights, so that they are the same with or without adapters
                add_adapters(model, args.adapter_rank)
    parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # a tied weight once
    if args.checkpoint_activations:  # keep only each unit's input in forward: one more forward, far less memory
        for unit in model.shard_units():
            unit.forward = partial(checkpoint, unit.forward, use_reentrant=False)
    if args.wrap == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None), parameters
    if device.type == "cuda" and dist.get_backend() == "gloo":  # ranks sharing a GPU: the mesh is the group itself
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")  # (some torch releases would add NCCL ranks on it)
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # Gather and compute in `dtype` (half the all-gather bytes on a GPU); reduce gradients and step in fp32.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # Pinned host memory lets the copies to and from the GPU overlap; pinning needs a GPU driver.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if args.cpu_offload else OffloadPolicy()
    units = list(model.shard_units())
    for unit in units:  # one all-gather and one reduce-scatter per unit, overlapping others' compute
        fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=offload)
    root = fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)  # the rest: embeddings, head
    for index, unit in enumerate(units if args.prefetch_depth else []):  # the default already runs one unit ahead
        unit.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + args.prefetch_depth])
        unit.set_modules_to_backward_prefetch(units[max(0, index - args.prefetch_depth) : index][::-1])
    return root, parameters


def loss_and_correct(logits: torch.Tensor, targets: torch.Tensor):
    """Per-target cross-entropy (in fp32 whatever the compute dtype) and hits, for labels and tokens alike."""
    losses = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="none")
    return losses.view(targets.shape), logits.argmax(-1) == targets


@torch.no_grad()
def evaluate(model, dataset, args, device, autocast) -> tuple[float, float]:
    # Every rank must call forward equally often (each call all-gathers), so the sampler pads the shards to
    # equal length; the padding is masked out, so each test sample counts exactly once.
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, shuffle=False))
    model.eval()
    sums, seen = torch.zeros(3, dtype=torch.float64, device=device), 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        real = torch.arange(seen, seen + len(y), device=device) * world + rank < len(dataset)
        seen += len(y)
        with autocast:
            losses, correct = loss_and_correct(model(x), y)
        mask = real.view(-1, *[1] * (y.dim() - 1)).expand_as(y)
        sums += torch.stack([losses[mask].sum().double(), correct[mask].sum().double(), mask.sum().double()])
    dist.all_reduce(sums)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def held_bytes(model, optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank stores (of a DTensor: its own shard)."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    storages = {}
    for t in tensors:  # a storage once, however many tensors view it (tied weights, padded shards)
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def unwrapped(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def named_values(model) -> dict[str, torch.Tensor]:
    """Each parameter's name (without DDP's `module.`) and the values this rank holds of it."""
    named = unwrapped(model).named_parameters()
    return {name: (p.to_local() if isinstance(p, DTensor) else p) for name, p in named}


def predicted_bytes(wrap: str, model, world: int) -> float:
    """What distlab.predict.traffic predicts one rank sends in a step, every collective in fp32. DDP all-reduces
    the trainable gradients only. FSDP2 gathers every parameter, frozen or not, before forward and again before
    backward, but the root's once (it stays gathered from forward into backward), and reduce-scatters the
    trainable gradients; it pads each parameter's first dimension to a multiple of the ranks."""
    params = list(unwrapped(model).parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    if wrap == "ddp":
        return expected_bytes_per_step("ddp", sum(p.numel() for p in params), world, trainable=trainable)

    def padded(group) -> int:
        return sum(-(-p.shape[0] // world) * world * (p.numel() // p.shape[0]) for p in group)

    in_units = {id(p) for unit in model.shard_units() for p in unit.parameters()}
    root = padded(p for p in params if id(p) not in in_units)
    values, trainable = padded(params), padded(p for p in params if p.requires_grad)
    return expected_bytes_per_step("fsdp", values, world, gathered_once=root, trainable=trainable)


def largest_changes(model, before: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """The largest change of any frozen value and of any adapter value since `before`, over every rank."""
    if isinstance(model, FSDPModule):  # evaluation left the root gathered (no backward came to free it)
        model.reshard()
    changes = torch.zeros(2, dtype=torch.float64, device=device)
    for name, values in named_values(model).items():
        if values.numel():
            change = (values.detach().cpu().double() - before[name].double()).abs().max()
            kind = int(name.endswith(("down.weight", "up.weight")))
            changes[kind] = torch.maximum(changes[kind], change.to(device))
    dist.all_reduce(changes, op=dist.ReduceOp.MAX)
    return {"frozen": changes[0].item(), "adapters": changes[1].item()}


SNAPSHOT_KEYS = ("reserved", "allocated", "requested", "cached", "largest_free", "streams")


def rank_memory(numbers: list[float], cuda: bool) -> dict:
    """One rank's memory record from the numbers it gathered (see train): its state's bytes; on a GPU the
    allocator's peaks, the device's used bytes, and the snapshot's numbers (None where none was taken)."""
    held, allocated, reserved, used, *at_snapshot = (int(n) for n in numbers)
    record = {"state_bytes": held, "cuda_max_allocated": allocated if cuda else None}
    if cuda:
        snapshot = dict(zip(SNAPSHOT_KEYS, at_snapshot)) if at_snapshot[0] >= 0 else None
        record |= {"cuda_max_reserved": reserved, "device_used": used, "snapshot": snapshot}
    return record


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


def adapter_metrics(args, model, world, device, traffic, with_gradients, before) -> dict:
    """What a run over a frozen base records: the bytes each rank counted in its first step against the
    prediction (None where FSDP gathers in 16 bits: the prediction is for one dtype), the parameters that had
    gradients, and how far the frozen and the adapter weights moved."""
    sent = torch.tensor([traffic.total_bytes], dtype=torch.float64, device=device)
    every = [torch.zeros_like(sent) for _ in range(world)]
    dist.all_gather(every, sent)
    one_dtype = args.wrap == "ddp" or compute_dtype(device, args.precision) == torch.float32
    counted = {
        "bytes_sent": [r.item() for r in every],
        "predicted_bytes": predicted_bytes(args.wrap, model, world) if one_dtype else None,
        "collectives": traffic.summary(),
        "bytes_by_device": dict(traffic.bytes_by_device),
    }
    changed = largest_changes(model, before, device)
    return {"adapter_rank": args.adapter_rank, "traffic": counted, "with_gradients": with_gradients,
            "largest_change": changed}  # fmt: skip


def train(args, device: torch.device) -> None:
    rank, world, cuda = dist.get_rank(), dist.get_world_size(), device.type == "cuda"
    train_set, test_set = load_data(args)
    dtype = compute_dtype(device, args.precision)
    model, parameters = build(args, device, dtype)
    # fused: one kernel, and no temporary copy of the whole state (foreach Adam briefly makes one). Offloaded
    # shards are stepped where they live, on the CPU, where fused Adam is not the fast path.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=cuda and not args.cpu_offload)
    # fp16 gradients underflow without loss scaling. Each rank sees only its shard, but the shards are DTensors,
    # whose overflow check GradScaler all-reduces: every rank skips the same steps.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    # drop_last: every step a whole batch, as distlab.train takes them (MNIST's 30,000 images a rank leave 48)
    loader = DataLoader(
        train_set, args.batch_size, sampler=sampler, num_workers=args.num_workers, pin_memory=cuda, drop_last=True
    )
    steps = min(len(loader), args.max_steps or len(loader))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if rank == 0:
        where = f"{world} x {device.type}, {dist.get_backend()}"
        print(f"{args.wrap} | {args.model}: {parameters:,} parameters | {where} | {dtype}", flush=True)
    # Adapters: the weights before (in host memory, out of the GPU's peak) and what the first step sends.
    before = {name: v.detach().cpu().clone() for name, v in named_values(model).items()} if args.adapter_rank else {}
    traffic, with_gradients = None, []
    history, held, allocator = [], 0, {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank, so the shards never overlap
        model.train()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, targets
        step_loss = torch.zeros(steps, dtype=torch.float64, device=device)
        batches = iter(loader)  # the workers start here, before the clock, as in distlab.train
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for step, (x, y) in zip(range(steps), batches):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            counted = bool(args.adapter_rank) and epoch == step == 0  # the counter slows its step: not a warm one
            recorded = bool(args.memory_snapshot) and epoch == args.epochs - 1 and step == 0  # a warm step
            if recorded:  # every allocation and free from here, with the Python stack that made it
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            with TrafficCounter(world) if counted else nullcontext() as counter:
                with autocast:
                    losses, correct = loss_and_correct(model(x), y)
                scaler.scale(losses.mean()).backward()
                if counted:
                    traffic = counter
                    with_gradients = [name for name, p in unwrapped(model).named_parameters() if p.grad is not None]
                scaler.step(optimizer)
            scaler.update()
            held = max(held, held_bytes(model, optimizer))  # the gradients exist from backward to zero_grad
            if recorded:  # before zero_grad: the snapshot shows the step's gradients still held
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                Path(args.memory_snapshot).mkdir(parents=True, exist_ok=True)
                (Path(args.memory_snapshot) / f"snapshot-rank{rank}.pickle").write_bytes(pickle.dumps(snapshot))
                allocator = read_snapshot(snapshot)
            optimizer.zero_grad(set_to_none=True)
            step_loss[step] = losses.detach().mean()
            sums += torch.stack([losses.detach().sum().double(), correct.sum().double(), sums.new_tensor(y.numel())])
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        dist.all_reduce(sums)  # one collective an epoch, not one a step
        dist.all_reduce(step_loss)
        test_loss, test_accuracy = evaluate(model, test_set, args, device, autocast)
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
    # On a GPU, each rank's memory as CUDA reports it: the allocator's peaks over the run, what the device shows
    # as used (nvidia-smi's number), and, with --memory-snapshot, the allocator's state at the snapshot.
    free, total = torch.cuda.mem_get_info(device) if cuda else (0, -1)
    cuda_numbers = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                    total - free] if cuda else [-1, -1, -1]  # fmt: skip
    at_snapshot = [allocator.get(key, -1) for key in SNAPSHOT_KEYS]
    mine = torch.tensor([held, *cuda_numbers, *at_snapshot], dtype=torch.float64, device=device)
    ranks = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(ranks, mine)
    adapters = adapter_metrics(args, model, world, device, traffic, with_gradients, before) if args.adapter_rank else {}
    if rank == 0:
        memory = [rank_memory(r.tolist(), cuda) for r in ranks]
        metrics = {"parameters": parameters, "trainable_parameters": trainable, "compute_dtype": str(dtype)}
        metrics |= {"epochs": history, "memory": memory, **adapters}
        record = {"schema": "distlab.result/1", "kind": "fsdp_train", "config": vars(args), "metrics": metrics}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**record, "environment": environment(device)}, indent=2) + "\n")
        print(f"wrote {Path(args.out).name}", flush=True)


def main() -> None:
    args = parse_args()
    device, backend = device_and_backend(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NCCL carries CUDA tensors only. Its group gets a gloo leg for CPU tensors: with fp16 the scaler's overflow
    # flag, and the gradient norm, of shards kept on the CPU (FSDP2's offload) are all-reduced as CPU tensors.
    cuda = backend == "nccl"
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else backend, device_id=device if cuda else None)
    try:
        train(args, device)
    except torch.OutOfMemoryError as err:  # one line, not a traceback through FSDP's internals
        print(f"fsdp_train.py: rank {dist.get_rank()} out of memory: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)  # torchrun then stops the other ranks
    finally:
        # fully_shard's modules and hooks form reference cycles, which hold the group: free them now, or the group
        # outlives destroy_process_group and goes at interpreter shutdown, where its gloo threads can abort the exit.
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
