"""One DDP step of the lab's CNN in torch's profiler on every rank, then DDP's compression hooks timed.

    torchrun --standalone --nproc_per_node=2 profile_ddp.py --device cuda --out results/profile-ddp

Each rank writes its trace (trace-rank<r>.json: open it in Perfetto, ui.perfetto.dev). Rank 0 reads its own with
the course's reader and prints where its kept steps went; then it times the same training under each of DDP's
gradient hooks and prints each one's step time and loss. Without --device it runs on the GPUs only where each
rank has one of its own; `--device cuda --backend gloo` lets ranks share the GPUs there are.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule

from distlab.measure.profile import read_steps, step_time
from distlab.models import build_model


def default_device() -> str:
    """cuda only where every rank on this machine can have a GPU of its own (torchrun sets LOCAL_WORLD_SIZE),
    else cpu: a run told nothing never takes a GPU that does not exist. Ranks share a GPU only when asked to,
    with --device cuda --backend gloo."""
    return "cuda" if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)) else "cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=default_device(), choices=["cpu", "cuda"])
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: nccl on cuda, gloo on cpu; gloo also lets more ranks than GPUs share them",
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps a hook (after 5 untimed)")
    p.add_argument("--out", default="profile-ddp", help="a folder for the traces")
    return p.parse_args(argv)


def device_and_backend(args) -> tuple[torch.device, str]:
    """This rank's device and the job's backend. NCCL drives one GPU per rank: rank r on cuda:r. gloo lets more
    ranks than GPUs share them, rank r on GPU r mod the count (two ranks on one GPU both compute on cuda:0)."""
    backend = args.backend if args.backend != "auto" else ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cpu":
        if backend == "nccl":
            raise SystemExit("profile_ddp.py: nccl moves CUDA tensors only: use --backend gloo with --device cpu")
        return torch.device("cpu"), backend
    gpus, ranks = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpus == 0:
        raise SystemExit("profile_ddp.py: --device cuda, but this machine has no CUDA GPU: use --device cpu")
    if backend == "nccl" and ranks > gpus:
        raise SystemExit(
            f"profile_ddp.py: NCCL needs one GPU per rank, and {ranks} ranks have {gpus} GPU(s): "
            "pass --backend gloo to let them share, or --device cpu"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % gpus), backend


def main() -> None:
    args = parse_args()
    device, backend = device_and_backend(args)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    else:  # the profiler's engine (Kineto) marks each start and stop, and on a machine without a GPU says
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # "gpuGetDeviceCount failed": none of it matters on a CPU
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)

    # The task: ten classes by how bright an image is on average, which the CNN learns within a few steps, so a
    # hook's effect on the loss shows; each rank its own batches, the same in every run.
    data = torch.Generator().manual_seed(100 + rank)
    images = [torch.randn(128, 1, 28, 28, generator=data) for _ in range(8)]
    batches = [(x.to(device), (x.mean(dim=(1, 2, 3)) * 40).clamp(-4.99, 4.99).add(5).long().to(device)) for x in images]

    def synchronize():
        if cuda:  # the GPU runs behind the host: a step has ended when its kernels have
            torch.cuda.synchronize(device)

    def trained(hook=None):
        torch.manual_seed(0)  # the same starting weights in every run
        model = DDP(build_model("cnn", device=device), device_ids=[device.index] if backend == "nccl" else None)
        if hook is not None:
            model.register_comm_hook(None, hook)  # replaces the all-reduce of every bucket
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    def step(model, optimizer, i):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # the buckets' all-reduces (or hooks) run in here
        optimizer.step()
        return loss.detach()

    # 1. The profiler: skip a step, warm up one, keep three; each rank writes its trace.
    model, optimizer = trained()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    trace = os.path.join(args.out, f"trace-rank{rank}.json")
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3)) as prof:
        for i in range(5):
            step(model, optimizer, i)
            synchronize()
            prof.step()
    prof.export_chrome_trace(trace)
    if rank == 0:
        kept = [step_time(s) for s in read_steps(trace)]
        median = {key: statistics.median(k[key] for k in kept) for key in kept[0]}
        print(f"profiled, rank 0, medians of {len(kept)} steps (ms): step {median['step_ms']:.1f}, compute "
              f"{median['compute_ms']:.1f}, communication {median['communication_ms']:.1f}, of it under compute "
              f"{median['overlapped_ms']:.1f}, exposed {median['exposed_ms']:.1f}", flush=True)  # fmt: skip

    # 2. The hooks: the same training under each, every step timed to its end.
    hooks = {"fp32 (no hook)": None, "fp16_compress_hook": default_hooks.fp16_compress_hook}
    if not cuda or torch.cuda.is_bf16_supported(including_emulation=False):
        hooks["bf16_compress_hook"] = default_hooks.bf16_compress_hook
    elif rank == 0:
        print("bf16_compress_hook: left out, this GPU has no native bf16 (a T4 has none)", flush=True)
    for name, hook in hooks.items():
        model, optimizer = trained(hook)
        times, losses = [], []
        for i in range(5 + args.steps):
            started = time.perf_counter()
            losses.append(step(model, optimizer, i))
            synchronize()
            times.append(time.perf_counter() - started)
        mean_loss = torch.stack(losses).double()
        dist.all_reduce(mean_loss)  # the ranks' mean loss at each step
        mean_loss = (mean_loss / world).tolist()
        timed = sorted(times[5:])
        if rank == 0:
            print(f"{name}: step {statistics.median(timed) * 1e3:.1f} ms median of {len(timed)} "
                  f"({timed[0] * 1e3:.1f} to {timed[-1] * 1e3:.1f}); loss {mean_loss[0]:.4f} -> "
                  f"{mean_loss[-1]:.4f}", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
