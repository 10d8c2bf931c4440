"""torch DDP's options, each shown on a run, and when DDP trains what one process would.

    torchrun --standalone --nproc_per_node=2 -m distlab.demos.ddp_knobs --out results
    torchrun --standalone --nproc_per_node=2 -m distlab.demos.ddp_knobs --uneven-without-join --timeout-s 3

Each demonstration is one function of the runtime that returns what it measured: BatchNorm against one
process on the whole batch; a layer that forward never uses; gradients as views into the buckets; buffer
sync; the compression hooks; uneven inputs under ``Join``. The second command runs uneven inputs without
``Join``: it can only end when the collective timeout does.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from ..bench.harness import round_robin, summarize_times
from ..cli import BenchConfig, entry_point, finish_run, option
from ..comm.traffic import TrafficCounter
from ..errors import DistlabError, collective_site, run_main
from ..models import ATOL, RTOL
from ..parallel.replicated import TorchDDP
from ..runtime import Runtime, distributed


def seeded(build, *args) -> nn.Module:
    """``build(*args)`` with the same initial weights on every rank, the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build(*args)


def bn_net(norm: type[nn.Module] = nn.BatchNorm2d) -> nn.Sequential:
    """Two convolutions, each followed by ``norm``: BatchNorm makes every sample's output depend on its batch."""
    return nn.Sequential(
        *(nn.Conv2d(1, 8, 3), norm(8), nn.ReLU(), nn.Conv2d(8, 16, 3), norm(16), nn.ReLU()),
        *(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)),
    )


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


class WithUnusedHead(nn.Module):
    """Linear layers and, optionally, a second head that forward never calls (a multi-task model on one task)."""

    def __init__(self, unused: bool = True, depth: int = 16, width: int = 64):
        super().__init__()
        self.body = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())))
        self.head, self.unused = nn.Linear(width, 10), nn.Linear(width, 10) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum); its gradient is summed over the ranks too, since every rank's loss used the sum."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    backward = forward


class AllReducedBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that normalises with the mean and variance of the whole global batch, summed over the ranks
    in one all-reduce: what SyncBatchNorm computes, written with a collective gloo runs on a CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        c, count = x.shape[1], torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        sums = _SumOverRanks.apply(torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), count]))
        n = sums[-1]
        mean = sums[:c] / n
        var = sums[c : 2 * c] / n - mean * mean  # biased: what BatchNorm normalises with
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)  # unbiased: what BatchNorm tracks
            self.num_batches_tracked += 1
        per_channel = lambda t: t.view(1, c, 1, 1)
        x_hat = (x - per_channel(mean)) * torch.rsqrt(per_channel(var) + self.eps)
        return x_hat * per_channel(self.weight) + per_channel(self.bias)


def batches(runtime: Runtime, count: int, n: int, shape: tuple[int, ...], seed: int = 1) -> list[tuple]:
    """``count`` batches of ``n`` samples and labels, the same on every rank that passes the same seed."""
    gen = torch.Generator().manual_seed(seed)
    made = [
        (torch.randn(n, *shape, generator=gen) + 0.5, torch.randint(0, 10, (n,), generator=gen)) for _ in range(count)
    ]
    return [(x.to(runtime.device), y.to(runtime.device)) for x, y in made]


def global_batches(runtime: Runtime, cfg, shape: tuple[int, ...]) -> tuple[list[tuple], slice]:
    """The global batches of ``cfg.steps`` steps, and the slice of each that is this rank's."""
    mine = slice(runtime.rank * cfg.batch_size, (runtime.rank + 1) * cfg.batch_size)
    return batches(runtime, cfg.steps, cfg.batch_size * runtime.world_size, shape), mine


def train(model: nn.Module, data, part: slice, lr: float, spread: list | None = None) -> dict[str, torch.Tensor]:
    """Plain SGD on ``part`` of every batch; the state it ends with. ``spread`` collects, after every
    step, how far the ranks' weights are apart."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(model(x[part]), y[part]).backward()
        optimizer.step()
        if spread is not None:
            spread.append(rank_spread(torch.cat([p.detach().flatten() for p in model.parameters()])))
    module = model.module if isinstance(model, DDP) else model
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def rank_spread(tensor: torch.Tensor) -> float:
    """Largest difference between this tensor on any rank and on rank 0."""
    every = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(every, tensor.contiguous())
    return max((t - every[0]).abs().max().item() for t in every)


def difference(state: dict, reference: dict) -> dict:
    """How far a trained state is from the reference: weights and running statistics apart."""
    stats = [k for k in reference if "running_" in k]
    weights = [k for k in reference if k not in stats and "num_batches" not in k]
    worst = lambda keys: max(((state[k] - reference[k]).abs().max().item() for k in keys), default=0.0)
    return {
        "weights_max_abs_diff": worst(weights),
        "running_stats_max_abs_diff": worst(stats),
        "equal_within_tolerance": all(torch.allclose(state[k], reference[k], atol=ATOL, rtol=RTOL) for k in reference),
    }


def batch_norm(runtime: Runtime, cfg) -> dict:
    """DDP with b samples per rank against one process on the N*b samples together."""
    (data, mine), whole = global_batches(runtime, cfg, (1, 12, 12)), slice(None)
    no_bn = lambda: bn_net(nn.Identity)
    single = {net: train(seeded(net).to(runtime.device), data, whole, cfg.lr) for net in (no_bn, bn_net)}
    rows = {}
    for name, build in {
        "no BatchNorm": no_bn,
        "BatchNorm": bn_net,
        "BatchNorm, statistics all-reduced": lambda: bn_net(AllReducedBatchNorm2d),
        "SyncBatchNorm": lambda: nn.SyncBatchNorm.convert_sync_batchnorm(bn_net()),
    }.items():
        reference = single[no_bn if build is no_bn else bn_net]  # one process, with BatchNorm as it is
        try:
            rows[name] = difference(train(DDP(seeded(build).to(runtime.device)), data, mine, cfg.lr), reference)
        except ValueError as err:  # SyncBatchNorm on a CPU: DDP will not wrap it, and its forward will not run
            rows[name] = {"ddp_error": str(err)}
            try:
                seeded(build).to(runtime.device)(data[0][0][mine])
            except ValueError as err:
                rows[name]["forward_error"] = str(err)
    return rows


def unused_parameters(runtime: Runtime, cfg) -> dict:
    """A layer forward never calls: DDP's default, find_unused_parameters, static_graph; and their cost."""
    data, mine = global_batches(runtime, cfg, (64,))
    reference = train(seeded(WithUnusedHead).to(runtime.device), data, slice(None), cfg.lr)
    rows = {}
    for name in ("default", "find_unused_parameters", "static_graph"):
        options = {} if name == "default" else {name: True}
        model, spread = DDP(seeded(WithUnusedHead).to(runtime.device), **options), []
        try:
            rows[name] = difference(train(model, data, mine, cfg.lr, spread), reference)
            rows[name]["unused_grad_is_none"] = model.module.unused.weight.grad is None
        except RuntimeError as err:  # raised in the forward after the step that went wrong
            rows[name] = {"error": str(err).split(". ")[0] + ".", "steps_done": len(spread)}
        rows[name]["rank_spread_after_each_step"] = spread
    # The cost: find_unused_parameters walks the autograd graph at the end of every forward, static_graph only
    # in the first. Forward holds the walk, so it is timed on its own as well as within the whole step.
    x, y = data[0][0][mine], data[0][1][mine]
    timed = {"default (no unused layer)": DDP(seeded(WithUnusedHead, False).to(runtime.device))}
    for name in ("find_unused_parameters", "static_graph"):
        timed[name] = DDP(seeded(WithUnusedHead).to(runtime.device), **{name: True})
    forward_s: dict[str, list[float]] = {name: [] for name in timed}

    def step(name: str) -> None:
        started = time.perf_counter()
        logits = timed[name](x)
        forward_s[name].append(time.perf_counter() - started)
        F.cross_entropy(logits, y).backward()

    warmup = 3
    times = round_robin({name: partial(step, name) for name in timed}, runtime, cfg.repeats, warmup)
    # Variants take turns, so a forward and the default's in the same repetition saw the same machine:
    # their ratio, repetition by repetition, is steadier than either time.
    forward = {name: t[warmup:] for name, t in forward_s.items()}
    paired = lambda t: [a / b for a, b in zip(t, forward["default (no unused layer)"])]
    return {
        "runs": rows,
        "step_time": {name: summarize_times(t) for name, t in times.items()},
        "forward_time_rank0": {name: summarize_times(t) for name, t in forward.items()},
        "forward_ratio_to_default_rank0": {name: summarize_times(paired(t)) for name, t in forward.items()},
    }


def gradient_views(runtime: Runtime, cfg) -> dict:
    """Bytes of gradients and buckets, each storage once, with and without ``gradient_as_bucket_view``."""
    (data, mine), rows = global_batches(runtime, cfg, (64,)), {}
    for view in (False, True):
        model, buckets = DDP(seeded(mlp).to(runtime.device), gradient_as_bucket_view=view), {}

        def keep_bucket(state, bucket, buckets=buckets):  # a comm hook sees the buffer DDP all-reduces
            storage = bucket.buffer().untyped_storage()
            buckets[storage.data_ptr()] = storage.nbytes()
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, keep_bucket)
        for _ in range(3):  # DDP rebuilds its buckets after the first step; gradients are views after it
            buckets.clear()
            model.zero_grad()
            model(data[0][0][mine]).sum().backward()
        grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()}
        rows[f"gradient_as_bucket_view={view}"] = {
            "gradient_bytes": sum(grads.values()),
            "bucket_bytes": sum(buckets.values()),
            "distinct_bytes": sum((grads | buckets).values()),
            "gradients_are_bucket_views": set(grads) <= set(buckets),
        }
    return rows


def buffer_sync(runtime: Runtime, cfg) -> dict:
    """BatchNorm's running statistics, trained on different data on each rank, with and without buffer sync."""
    data = batches(runtime, cfg.steps, cfg.batch_size, (1, 12, 12), seed=10 + runtime.rank)  # each rank its own
    data = [(x * (1 + runtime.rank), y) for x, y in data]  # and its own distribution
    rows = {}
    for on in (True, False):
        model = TorchDDP(broadcast_buffers=on).wrap(seeded(bn_net).to(runtime.device), runtime)  # either name
        train(model, data, slice(None), cfg.lr)
        after_training = rank_spread(model.module[1].running_mean)
        model.eval()  # evaluation: every rank on the same input
        with torch.no_grad():
            outputs = model(torch.ones(4, 1, 12, 12, device=runtime.device))
        rows[f"sync {'on' if on else 'off'}"] = {
            "running_mean_spread_after_training": after_training,
            "eval_output_spread": rank_spread(outputs),
            "eval_output_largest": outputs.abs().max().item(),
        }
    return rows


def comm_hooks(runtime: Runtime, cfg) -> dict:
    """Bytes each rank sends, and where the weights end, with gradients all-reduced in fp32, fp16 and bf16."""
    data, mine = global_batches(runtime, cfg, (64,))
    initial = {k: v.float() for k, v in seeded(mlp).state_dict().items()}
    rows, states = {}, {}
    for name, hook in {
        "fp32 (default)": None,
        "fp16_compress_hook": default_hooks.fp16_compress_hook,
        "bf16_compress_hook": default_hooks.bf16_compress_hook,
    }.items():
        model = DDP(seeded(mlp).to(runtime.device))
        if hook is not None:
            model.register_comm_hook(None, hook)
        with TrafficCounter(runtime.world_size) as counted:
            states[name] = train(model, data, mine, cfg.lr)
        rows[name] = {"all_reduce_bytes_per_step": counted.bytes_sent["all_reduce"] / cfg.steps}
        rows[name] |= difference(states[name], states["fp32 (default)"])
    rows["fp32 (default)"]["weights_moved"] = difference(states["fp32 (default)"], initial)["weights_max_abs_diff"]
    return rows


JOIN_FIX = (
    "the ranks ran different numbers of steps, so their collectives never matched: "
    "wrap the training loop in torch.distributed.algorithms.join.Join([model])"
)


def uneven_inputs(runtime: Runtime, cfg, join: bool = True) -> dict:
    """Rank r has ``uneven_batches + r`` batches; after its loop each rank waits at a barrier, as a script
    does before rank 0 saves a checkpoint."""
    model = DDP(seeded(mlp).to(runtime.device))
    optimizer, mine = torch.optim.SGD(model.parameters(), lr=cfg.lr), cfg.uneven_batches + runtime.rank
    data = batches(runtime, mine, cfg.batch_size, (64,), seed=100 + runtime.rank)
    started, scales = time.perf_counter(), []
    uneven = dict(fix=JOIN_FIX, this_rank=f"{mine} batches")
    with Join([model]) if join else nullcontext():
        for step, (x, y) in enumerate(data):
            with collective_site(f"the gradient all-reduce of its batch {step + 1}", **uneven):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
            if step >= cfg.uneven_batches:  # the other ranks have joined: compare with this rank's own gradient
                alone = copy.deepcopy(model.module)
                alone.zero_grad(set_to_none=True)
                F.cross_entropy(alone(x), y).backward()
                scales.append((model.module[0].weight.grad.norm() / alone[0].weight.grad.norm()).item())
            optimizer.step()
    with collective_site("the barrier after its loop", **uneven):
        dist.barrier()  # every rank done before, say, rank 0 saves a checkpoint
    batches_done = torch.tensor([float(mine)], device=runtime.device)
    dist.all_reduce(batches_done)
    every_scale = [None] * runtime.world_size  # measured on the ranks that went on alone
    dist.all_gather_object(every_scale, scales)
    return {
        "batches_per_rank": list(range(cfg.uneven_batches, cfg.uneven_batches + runtime.world_size)),
        "batches_in_all": int(batches_done.item()),
        "seconds": time.perf_counter() - started,
        "gradient_scale_after_others_joined": every_scale,
    }


@dataclass
class DDPKnobsConfig(BenchConfig):
    """torch DDP's options, each on a run; and when DDP trains exactly what one process would."""

    steps: int = option(3, "SGD steps of every training comparison")
    batch_size: int = option(16, "samples per rank per step")
    lr: float = option(0.1, "SGD learning rate")
    repeats: int = option(60, "timed steps per variant for the cost of find_unused_parameters")
    uneven_batches: int = option(3, "batches of rank 0 in the uneven-inputs run; rank r has r more")
    uneven_without_join: bool = option(False, "run only the uneven inputs, without Join: ends when the timeout does")
    timeout_s: float = option(120.0, "seconds a collective may wait for its peers")
    demos: str = option(
        "",
        "the demos to run, comma-separated (default: all): batch_norm, unused_parameters, "
        "gradient_as_bucket_view, buffer_sync, comm_hooks, join",
    )


DEMOS = {"batch_norm": batch_norm, "unused_parameters": unused_parameters, "gradient_as_bucket_view": gradient_views}
DEMOS |= {"buffer_sync": buffer_sync, "comm_hooks": comm_hooks, "join": uneven_inputs}


@entry_point(DDPKnobsConfig)
def main(cfg: DDPKnobsConfig) -> None:
    with distributed(cfg.where.device, cfg.where.backend, cfg.timeout_s) as runtime:
        if runtime.world_size < 2:
            raise DistlabError("DDP's options show only across ranks: run with torchrun --nproc_per_node=2")
        if cfg.uneven_without_join:
            uneven_inputs(runtime, cfg, join=False)  # raises once the timeout has passed
        chosen = [name for name in cfg.demos.split(",") if name] or list(DEMOS)
        unknown = [name for name in chosen if name not in DEMOS]
        if unknown:
            raise DistlabError(f"unknown demo(s) {', '.join(unknown)}: choose from {', '.join(DEMOS)}")
        report = {}
        for name, demo in {name: DEMOS[name] for name in chosen}.items():
            started = time.perf_counter()
            report[name] = demo(runtime, cfg)
            runtime.log(f"{name:<24} {time.perf_counter() - started:5.1f} s")
        name = cfg.output.name or f"ddp-knobs-{runtime.world_size}x{runtime.device.type}"
        finish_run(runtime, cfg.output.out, name, "ddp_knobs", asdict(cfg), report)


if __name__ == "__main__":
    run_main(main)
