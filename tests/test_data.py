"""Data: the sampler's split, the device-resident loader's split, evaluation
across ranks, and torchvision's real MNIST reading files the test wrote."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from distlab.data import DeviceResidentLoader, SyntheticImages, load_datasets, shard_indices
from distlab.errors import DistlabError
from distlab.runtime import Runtime, distributed

CPU = torch.device("cpu")


def _indices(n: int, world_size: int, epoch: int, drop_last: bool = False) -> list[list[int]]:
    dataset = TensorDataset(torch.arange(n))
    per_rank = []
    for rank in range(world_size):
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=3, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    return per_rank


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sampler_ranks_are_disjoint_and_cover_the_dataset(world_size):
    n = 120  # divisible by 2, 3 and 4: no padding
    per_rank = _indices(n, world_size, epoch=0)
    flat = [i for rank in per_rank for i in rank]
    assert len(flat) == len(set(flat)) == n
    assert set(flat) == set(range(n))


def test_sampler_pads_with_repeats_when_the_split_is_uneven():
    per_rank = _indices(10, 4, epoch=0)
    flat = [i for rank in per_rank for i in rank]
    assert set(flat) == set(range(10)) and len(flat) == 12  # two samples seen twice


def test_set_epoch_changes_the_order_and_no_set_epoch_repeats_it():
    assert _indices(100, 2, epoch=0) != _indices(100, 2, epoch=1)
    assert _indices(100, 2, epoch=1) == _indices(100, 2, epoch=1)


@pytest.mark.parametrize("n,world_size,drop_last", [(120, 2, True), (101, 3, True), (101, 4, False)])
def test_device_resident_split_equals_distributed_sampler(n, world_size, drop_last):
    for epoch in (0, 1):
        expected = _indices(n, world_size, epoch, drop_last)
        for rank in range(world_size):
            assert (
                shard_indices(n, world_size, rank, seed=3, epoch=epoch, drop_last=drop_last).tolist() == expected[rank]
            )


def test_device_resident_loader_yields_each_rank_its_shard():
    dataset = SyntheticImages((1, 28, 28), 64, seed=1)
    seen = []
    for rank in range(2):
        runtime = Runtime(rank=rank, local_rank=rank, world_size=2, device=CPU, backend="gloo")
        loader = DeviceResidentLoader(dataset, batch_size=8, runtime=runtime, seed=5)
        loader.set_epoch(2)
        batches = list(loader)
        assert len(batches) == len(loader) == 4
        for x, y in batches:
            matches = (dataset.data.view(64, -1)[None] == x.view(len(x), 1, -1)).all(-1)
            rows = matches.float().argmax(1)
            assert torch.equal(dataset.targets[rows], y)
            seen.extend(rows.tolist())
    assert sorted(seen) == list(range(64))


def evaluate_cnn(runtime, dataset_size: int):
    from distlab.models import build_model
    from distlab.train import evaluate

    torch.manual_seed(0)
    model = build_model("cnn")
    dataset = SyntheticImages((1, 28, 28), dataset_size, seed=2, noise=3.0)
    return evaluate(model, dataset, runtime, batch_size=16)


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_evaluation_equals_single_process(request, world_size):
    n = 101  # uneven over 2 and 3 ranks: padding must not be counted
    # one process: this one, in a one-rank group in memory; fork_rng puts back the generator evaluate_cnn reseeds
    with torch.random.fork_rng(), distributed("cpu") as runtime:
        single = evaluate_cnn(runtime, n)
    ranks = request.getfixturevalue(f"ranks{world_size}").run(evaluate_cnn, n)
    for result in ranks:
        assert result["samples"] == n
        assert result["accuracy"] == single["accuracy"]
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-6)
    assert 0.0 < single["accuracy"] < 1.0  # an untrained model: the count is not trivially all or nothing


def test_torchvision_mnist_reads_the_tiny_idx_files(tiny_mnist):
    with distributed("cpu") as runtime:
        train, test, spec = load_datasets("mnist", str(tiny_mnist), runtime, download=False)
    assert type(train).__name__ == "MNIST" and len(train) == 96 and len(test) == 40
    image, label = train[13]
    assert image.shape == (1, 28, 28) and label == 3
    assert spec.shape == (1, 28, 28) and spec.num_classes == 10


def test_missing_dataset_offline_says_what_to_do(tmp_path, monkeypatch):
    from torchvision.datasets import MNIST

    # A real download attempt against a port where nothing listens: offline, without the network.
    monkeypatch.setattr(MNIST, "mirrors", ["http://127.0.0.1:9/"])
    with distributed("cpu") as runtime, pytest.raises(DistlabError) as err:
        load_datasets("mnist", str(tmp_path / "nothing-here"), runtime, download=True)
    message = str(err.value)
    assert "\n" not in message
    assert str(tmp_path / "nothing-here") in message and "--dataset synthetic" in message
