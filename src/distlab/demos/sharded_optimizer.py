"""ZeRO-1 as an optimizer, run: the course's ``get_sharded_optimizer``, torch's ``ZeroRedundancyOptimizer`` and
a plain AdamW train copies of one GPT side by side, the gradients averaged over the ranks by hand.

    torchrun --standalone --nproc_per_node=2 -m distlab.demos.sharded_optimizer

It records, after every step, whether the three copies hold the same weights to the last bit, and, rank by rank,
the parameters each rank owns and the bytes of optimizer state it keeps under each optimizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..cli import ResultConfig, entry_point, finish_run, option
from ..errors import run_main
from ..models import GPT_PRESETS, build_model
from ..parallel.materialize import materialize
from ..parallel.sharded_optimizer import get_sharded_optimizer
from ..runtime import distributed

OPTIMIZERS = ("sharded", "torch", "plain")
"""The course's sharded optimizer, torch's ZeroRedundancyOptimizer, and AdamW over every parameter."""
ADAMW = dict(lr=1e-3, weight_decay=0.1)


def _make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sharded":
        return get_sharded_optimizer(params, torch.optim.AdamW, **ADAMW)
    if kind == "torch":
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **ADAMW)
    return torch.optim.AdamW(params, **ADAMW)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors this rank's optimizer keeps (torch's ZeroRedundancyOptimizer keeps them in ``.optim``)."""
    state = optimizer.optim.state if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer.state
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def _batch(model_name: str, batch: int, step: int, rank: int, device: torch.device):
    cfg = GPT_PRESETS[model_name]
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def run_all(runtime, model_name: str = "gpt-tiny", steps: int = 3, batch: int = 2) -> dict:
    """``steps`` AdamW steps of each optimizer on its own copy of ``model_name``: the losses, whether the weights
    agree bit for bit after each step, and what this rank owns and keeps."""
    models = {kind: materialize(build_model(model_name, device="meta"), runtime.device, seed=0) for kind in OPTIMIZERS}
    optimizers = {kind: _make_optimizer(kind, models[kind].parameters()) for kind in OPTIMIZERS}
    losses, same_as_torch, same_as_plain = [], [], []
    for step in range(steps):
        inputs, targets = _batch(model_name, batch, step, runtime.rank, runtime.device)
        for kind in OPTIMIZERS:
            logits = models[kind](inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            for param in models[kind].parameters():  # the caller's part: average the gradients over the ranks
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad.div_(runtime.world_size)
            optimizers[kind].step()
            optimizers[kind].zero_grad()
            if kind == "sharded":
                losses.append(loss.item())
        mine = list(models["sharded"].parameters())
        same_as_torch.append(all(map(torch.equal, mine, models["torch"].parameters())))
        same_as_plain.append(all(map(torch.equal, mine, models["plain"].parameters())))
    sharded = optimizers["sharded"]
    return {
        "losses": losses,
        "same_as_torch": same_as_torch,
        "same_as_plain": same_as_plain,
        "parameters": len(sharded.owner),
        "values": sum(sharded.values_owned),
        "owned_parameters": len(sharded.owned()),
        "owned_values": sharded.values_owned[runtime.rank],
        "state_bytes": {kind: state_bytes(optimizers[kind]) for kind in OPTIMIZERS},
    }


@dataclass
class ShardedOptimizerConfig(ResultConfig):
    """ZeRO-1 as an optimizer: the course's, torch's ZeroRedundancyOptimizer and plain AdamW, side by side."""

    model: str = option("gpt-tiny", "GPT preset to train", choices=list(GPT_PRESETS))
    steps: int = option(3, "AdamW steps")
    batch_size: int = option(2, "sequences per rank per step")


@entry_point(ShardedOptimizerConfig)
def main(cfg: ShardedOptimizerConfig) -> None:
    with distributed("cpu") as runtime:
        report = run_all(runtime, cfg.model, cfg.steps, cfg.batch_size)
        by_rank = [None] * runtime.world_size
        dist.all_gather_object(by_rank, report)
        runtime.log(f"{cfg.model}: {report['parameters']} parameters that train, {report['values']:,} values")
        for rank, mine in enumerate(by_rank):
            runtime.log(f"rank {rank}: owns {mine['owned_parameters']} parameters, {mine['owned_values']:,} values; "
                        f"optimizer state {mine['state_bytes']['sharded']:,} bytes (torch's ZeroRedundancyOptimizer "
                        f"{mine['state_bytes']['torch']:,}, plain AdamW {mine['state_bytes']['plain']:,})")  # fmt: skip
        runtime.log(f"same weights as torch's ZeroRedundancyOptimizer after each step: {report['same_as_torch']}; "
                    f"as plain AdamW: {report['same_as_plain']}")  # fmt: skip
        metrics = {**report, "by_rank": by_rank, "world_size": runtime.world_size}
        finish_run(
            runtime, cfg.output.out, cfg.output.name or "sharded-optimizer", "sharded_optimizer", asdict(cfg), metrics
        )


if __name__ == "__main__":
    run_main(main)
