"""The data-mistake detectors fire on the two classic mistakes and stay quiet
on correct code. Real gloo ranks, real DataLoaders."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distlab.data import DataOrderCheck, fingerprint
from distlab.testing import run_ranks

DATASET = TensorDataset(torch.arange(64, dtype=torch.float32).view(64, 1), torch.zeros(64))


def _problems_over_epochs(loader, epochs: int, set_epoch: bool, inspect_loader: bool) -> list[list[str]]:
    check = DataOrderCheck(loader if inspect_loader else None)
    found = []
    for epoch in range(epochs):
        if set_epoch:
            loader.sampler.set_epoch(epoch)
        inputs, _ = next(iter(loader))
        found.append(check.check_first_batch(epoch, inputs))
    return found


def every_scenario(runtime):
    torch.manual_seed(0)  # the same seed on every rank, as for identical initial weights
    no_sampler = DataLoader(DATASET, batch_size=4, shuffle=True)

    def sharded():
        return DataLoader(DATASET, batch_size=4, sampler=DistributedSampler(DATASET, seed=0))

    return {
        "no_sampler": _problems_over_epochs(no_sampler, 1, set_epoch=False, inspect_loader=True),
        "no_sampler_data_only": _problems_over_epochs(
            DataLoader(DATASET, batch_size=4, shuffle=False), 1, set_epoch=False, inspect_loader=False
        ),
        "no_set_epoch": _problems_over_epochs(sharded(), 3, set_epoch=False, inspect_loader=True),
        "no_set_epoch_data_only": _problems_over_epochs(sharded(), 3, set_epoch=False, inspect_loader=False),
        "correct": _problems_over_epochs(sharded(), 3, set_epoch=True, inspect_loader=True),
        "correct_data_only": _problems_over_epochs(sharded(), 3, set_epoch=True, inspect_loader=False),
    }


def test_detectors_fire_on_the_mistakes_and_only_on_them(tmp_path):
    ranks = run_ranks(every_scenario, 2, tmp_path)
    assert ranks[0] == ranks[1], "every rank must see the same verdict"
    found = ranks[0]
    assert any("DistributedSampler" in p and "RandomSampler" in p for p in found["no_sampler"][0])
    assert any("ranks 0 and 1 got the same first batch" in p for p in found["no_sampler"][0])
    assert any("ranks 0 and 1 got the same first batch" in p for p in found["no_sampler_data_only"][0])
    for key in ("no_set_epoch", "no_set_epoch_data_only"):
        assert found[key][0] == [], key
        assert all(any("set_epoch" in p for p in epoch) for epoch in found[key][1:]), key
    assert found["correct"] == [[], [], []]
    assert found["correct_data_only"] == [[], [], []]


def test_fingerprint_tells_batches_apart():
    a = torch.arange(12.0).view(3, 4)
    assert fingerprint(a) == fingerprint(a.clone())
    assert fingerprint(a) != fingerprint(a.flip(0))
    assert fingerprint(a.t()) == fingerprint(a.t().contiguous())
