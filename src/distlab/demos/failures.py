"""When the ranks disagree: collectives that never match, run on purpose, each ending in a line per rank.

    torchrun --standalone --nproc_per_node=2 -m distlab.demos.failures --case skip --timeout-s 3
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 -m distlab.demos.failures --case mismatch

Every collective is a rendezvous: each rank must call the same one, in the same order, on tensors of the
same shape. Each case breaks that on rank 1 (or, for ``eval-rank0``, on every rank but 0):

* ``skip``: rank 1 skips step 2's all-reduce, as a loop that drops a bad batch on one rank does; then every
  rank meets at the barrier a script puts before saving. Rank 0's step 2 pairs with rank 1's step 3.
* ``mismatch``: rank 0 all-reduces where rank 1 broadcasts.
* ``shape``: rank 0 all-reduces 4 numbers, rank 1 8.
* ``eval-rank0``: FSDP2, and only rank 0 evaluates: its forward all-gathers each unit's shards from ranks
  that are not there.
* ``eval-rank0-ddp``: DDP, and only rank 0 evaluates, after a training step: fine for a model without
  buffers; with BatchNorm, the forward broadcasts its statistics to ranks that are not there.

Without TORCH_DISTRIBUTED_DEBUG the ranks wait until ``--timeout-s`` (gloo; NCCL's watchdog does the same),
then :func:`distlab.errors.run_main` writes one line per rank: which rank, which collective, torch's reason.
With TORCH_DISTRIBUTED_DEBUG=DETAIL torch compares every collective's name and shapes across the ranks
before running it, and stops at the first that differs. The bad command lines are in
:mod:`distlab.demos.bad_inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..cli import DeviceOptions, entry_point, option, section
from ..errors import DistlabError, collective_site, run_main
from ..runtime import Runtime, distributed

STEPS = 3


def skip(runtime: Runtime) -> None:
    """Three steps of an all-reduce of the step's number; rank 1 skips step 2. Rank 0 logs what each sum was."""
    for step in range(1, STEPS + 1):
        if runtime.rank == 1 and step == 2:
            continue  # e.g. `if not torch.isfinite(loss): continue` on the one rank whose batch went bad
        total = torch.full((4,), float(step), device=runtime.device)
        dist.all_reduce(total)
        runtime.log(f"step {step}: the all-reduce gave {total[0].item():g} on rank 0 (every rank's {step}: {2 * step})")
    dist.barrier()  # before rank 0 saves a checkpoint


def mismatch(runtime: Runtime) -> None:
    """Rank 0 all-reduces, rank 1 broadcasts: the same tensor, two different collectives."""
    tensor = torch.ones(4, device=runtime.device)
    if runtime.rank == 0:
        dist.all_reduce(tensor)
    else:
        dist.broadcast(tensor, src=0)
    dist.barrier()


def shape(runtime: Runtime) -> None:
    """Rank 0 all-reduces a tensor of 4 numbers, rank 1 one of 8."""
    tensor = torch.ones(4 if runtime.rank == 0 else 8, device=runtime.device)
    dist.all_reduce(tensor)
    dist.barrier()


EVAL_FIX = (
    "under FSDP every rank holds only a shard of the weights, so every rank must run evaluation's forward: "
    "evaluate on every rank and all-reduce the counts (distlab.train.evaluate), or gather the full state "
    "dict to rank 0 (distlab.parallel.full_state_dict(model, rank0_only=True)) and evaluate a plain copy there"
)


def eval_rank0(runtime: Runtime) -> None:
    """FSDP2 on the notes' CNN; rank 0 alone evaluates, as ``if rank == 0: evaluate(model)`` does."""
    from ..models import build_model  # imports torchvision: only the case that needs it pays
    from ..parallel.fsdp2 import FSDP2

    model = FSDP2().build(build_model("cnn", device="meta"), runtime, seed=0)
    images = torch.zeros(8, 1, 28, 28, device=runtime.device)
    model.eval()
    if runtime.is_main:
        with collective_site("evaluation's forward (FSDP all-gathers every unit's shards)", fix=EVAL_FIX):
            with torch.no_grad():
                model(images)
    with collective_site("the barrier after evaluation", fix=EVAL_FIX):
        dist.barrier()


DDP_EVAL_FIX = (
    "DDP's forward broadcasts rank 0's buffers (BatchNorm's statistics) in the first forward after a training "
    "step, a collective: evaluate on every rank, or evaluate model.module (the model without DDP's forward) on rank 0"
)


def eval_rank0_ddp(runtime: Runtime) -> None:
    """DDP: one training step on every rank, then rank 0 alone evaluates; a model without buffers, then one
    with BatchNorm."""
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(runtime.rank)).to(runtime.device)
    for name, norm in (("without buffers", nn.Identity), ("with BatchNorm", nn.BatchNorm1d)):
        model = DDP(nn.Sequential(nn.Linear(8, 16), norm(16), nn.ReLU(), nn.Linear(16, 2)).to(runtime.device))
        model(inputs).sum().backward()
        if runtime.is_main:
            model.eval()
            with collective_site(f"evaluation's forward, model {name}", fix=DDP_EVAL_FIX), torch.no_grad():
                model(inputs)
            runtime.log(f"DDP, model {name}: rank 0 evaluated alone")
        with collective_site(f"the barrier after evaluation, model {name}", fix=DDP_EVAL_FIX):
            dist.barrier()


CASES = {"skip": skip, "mismatch": mismatch, "shape": shape, "eval-rank0": eval_rank0, "eval-rank0-ddp": eval_rank0_ddp}


@dataclass
class FailuresConfig:
    """Ranks that call different collectives, run on purpose: each case ends with a line per rank."""

    case: str = option("skip", "which mistake rank 1 makes", choices=list(CASES))
    timeout_s: float = option(3.0, "seconds a collective may wait for its peers before the job fails")
    where: DeviceOptions = section(DeviceOptions)


@entry_point(FailuresConfig)
def main(cfg: FailuresConfig) -> None:
    with distributed(cfg.where.device, cfg.where.backend, cfg.timeout_s) as runtime:
        if runtime.world_size < 2:
            raise DistlabError("ranks can only disagree if there are several: run with torchrun --nproc_per_node=2")
        dist.barrier()  # every rank up before the clock of the case starts
        CASES[cfg.case](runtime)
        runtime.log(f"case {cfg.case}: every collective matched")


if __name__ == "__main__":
    run_main(main)
