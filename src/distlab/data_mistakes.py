"""Run the two classic DDP data mistakes and watch the check catch them.

    torchrun --standalone --nproc_per_node=2 -m distlab.data_mistakes --out results

Three ways to build the training loader, each iterated for a few epochs on
every rank: a plain shuffled ``DataLoader`` (no sampler), a
``DistributedSampler`` without ``set_epoch``, and the correct one. The
dataset holds each sample's own index, so the script can count exactly which
samples each rank saw, and :class:`distlab.checks.DataOrderCheck` reports
what it detects from the batches alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .checks import DataOrderCheck
from .results import write_result
from .runtime import distributed, run_main


def loaders(dataset, batch_size: int) -> dict[str, tuple[DataLoader, bool]]:
    """Scenario name -> (loader, whether the loop calls set_epoch)."""
    return {
        "no sampler": (DataLoader(dataset, batch_size=batch_size, shuffle=True), False),
        "sampler, no set_epoch": (DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, seed=0)), False),
        "sampler + set_epoch": (DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, seed=0)), True),
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
                problems += check.first_batch(epoch, indices)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="torchrun --standalone --nproc_per_node=N -m distlab.data_mistakes", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000, help="dataset size")
    parser.add_argument("--batch-size", type=int, default=50, help="samples per rank per step")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per scenario")
    parser.add_argument("--out", default="results", help="directory for the result JSON")
    args = parser.parse_args(argv)
    with distributed("cpu") as runtime:
        torch.manual_seed(0)  # the same seed on every rank, as scripts that want identical initial weights do
        dataset = TensorDataset(torch.arange(args.samples))
        report = {name: run_scenario(loader, set_epoch, args.epochs) for name, (loader, set_epoch) in loaders(dataset, args.batch_size).items()}
        for name, row in report.items():
            runtime.log(f"{name:<22} each rank {row['samples_per_rank_per_epoch']:>5} samples/epoch, distinct over ranks {row['distinct_samples_per_epoch']:>5} of {args.samples}, "
                        f"seen by every rank {row['seen_by_every_rank']:>5}, epochs repeating the last order {row['epochs_repeating_previous_order']}/{args.epochs - 1}")
            for problem in row["problems"]:
                runtime.log(f"    check: {problem}")
        if runtime.is_main:
            path = write_result(Path(args.out) / f"data-mistakes-{runtime.world_size}xcpu.json", "data_mistakes", vars(args), report, runtime.device, world_size=runtime.world_size, backend=runtime.backend)
            runtime.log(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
