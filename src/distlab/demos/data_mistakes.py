"""Run the two classic DDP data mistakes and watch the check catch them.

    torchrun --standalone --nproc_per_node=2 -m distlab.demos.data_mistakes --out results

Three ways to build the training loader, each iterated for a few epochs on
every rank: a plain shuffled ``DataLoader`` (no sampler), a
``DistributedSampler`` without ``set_epoch``, and the correct one. The
dataset holds each sample's own index, so the script can count exactly which
samples each rank saw, and :class:`distlab.data.DataOrderCheck` reports
what it detects from the batches alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ..cli import ResultConfig, entry_point, finish_run, option
from ..data import DataOrderCheck
from ..errors import run_main
from ..runtime import distributed


def loaders(dataset, batch_size: int) -> dict[str, tuple[DataLoader, bool]]:
    """Scenario name -> (loader, whether the loop calls set_epoch)."""
    # The same shuffle seed on every rank, as in scripts that seed everything for identical initial weights.
    same_seed_everywhere = torch.Generator().manual_seed(0)
    return {
        "no sampler": (DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=same_seed_everywhere), False),
        "sampler, no set_epoch": (
            DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, seed=0)),
            False,
        ),
        "sampler + set_epoch": (
            DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, seed=0)),
            True,
        ),
    }


def run_scenario(loader: DataLoader, calls_set_epoch: bool, epochs: int) -> dict:
    check = DataOrderCheck(loader)
    orders, problems = [], []
    for epoch in range(epochs):
        if calls_set_epoch:
            loader.sampler.set_epoch(epoch)
        order = []
        for step, (indices,) in enumerate(loader):
            if step == 0:
                problems += check.check_first_batch(epoch, indices)
            order += indices.tolist()
        orders.append(order)
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, orders)
    seen = [set(rank_orders[0]) for rank_orders in every_rank]  # first epoch, per rank
    shared = set.intersection(*seen)
    return {
        "samples_per_rank_per_epoch": len(orders[0]),
        "distinct_samples_per_epoch": len(set.union(*seen)),
        "seen_by_every_rank": len(shared),
        "epochs_repeating_previous_order": sum(orders[e] == orders[e - 1] for e in range(1, epochs)),
        "problems": list(dict.fromkeys(problems)),
    }


@dataclass
class DataMistakesConfig(ResultConfig):
    """Run the two classic DDP data mistakes and watch the check catch them."""

    samples: int = option(1000, "dataset size")
    batch_size: int = option(50, "samples per rank per step")
    epochs: int = option(3, "epochs per scenario")


@entry_point(DataMistakesConfig)
def main(cfg: DataMistakesConfig) -> None:
    with distributed("cpu") as runtime:
        dataset = TensorDataset(torch.arange(cfg.samples))
        report = {
            name: run_scenario(loader, set_epoch, cfg.epochs)
            for name, (loader, set_epoch) in loaders(dataset, cfg.batch_size).items()
        }
        for name, row in report.items():
            runtime.log(
                f"{name:<22} each rank {row['samples_per_rank_per_epoch']:>5} samples/epoch, distinct over "
                f"ranks {row['distinct_samples_per_epoch']:>5} of {cfg.samples}, "
                f"seen by every rank {row['seen_by_every_rank']:>5}, epochs repeating the last order "
                f"{row['epochs_repeating_previous_order']}/{cfg.epochs - 1}"
            )
            for problem in row["problems"]:
                runtime.log(f"    check: {problem}")
        finish_run(
            runtime,
            cfg.output.out,
            cfg.output.name or f"data-mistakes-{runtime.world_size}xcpu",
            "data_mistakes",
            asdict(cfg),
            report,
        )


if __name__ == "__main__":
    run_main(main)
