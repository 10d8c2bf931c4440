"""Datasets and loaders, the same for one rank or many.

Two ways to feed a rank:

* :class:`SampledLoader`: the reference pipeline, a ``DataLoader`` over a
  map-style dataset with a ``DistributedSampler`` (workers, ``pin_memory``,
  ``non_blocking`` copies).
* :class:`DeviceResidentLoader`: the whole dataset as tensors on the device,
  reshuffled each epoch and split across ranks exactly as the sampler would.

Both have ``set_epoch`` and yield ``(inputs, targets)`` already on the device.

:class:`DataOrderCheck`, which the loop runs, catches the two classic DDP data mistakes while the job runs
(no ``DistributedSampler``; no ``set_epoch``).
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .errors import DistlabError
from .runtime import Runtime

IMAGE_SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
# Per-channel mean and std of the training sets (the usual published values).
NORMALISATION = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


class SyntheticImages(Dataset):
    """Images of MNIST or CIFAR-10 shape that a model can learn: each class is
    a fixed random template, each sample that template plus noise."""

    def __init__(
        self,
        shape: tuple[int, ...],
        num_samples: int,
        num_classes: int = 10,
        seed: int = 0,
        noise: float = 1.0,
        split_seed: int = 0,
    ):
        templates = torch.randn((num_classes, *shape), generator=torch.Generator().manual_seed(seed))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 1 + split_seed)
        self.targets = torch.randint(num_classes, (num_samples,), generator=gen)
        self.data = templates[self.targets] + noise * torch.randn((num_samples, *shape), generator=gen)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.data[index], self.targets[index]


class SyntheticTokens(Dataset):
    """Token sequences for the GPT models: arithmetic progressions modulo the
    vocabulary, so the next token follows from the context."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab_size, (num_samples, 1), generator=gen)
        stride = torch.randint(1, 8, (num_samples, 1), generator=gen)
        tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
        self.data, self.targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.data[index], self.targets[index]


@dataclass(frozen=True)
class DataSpec:
    """What a dataset looks like to a model."""

    kind: str
    """``image`` or ``tokens``."""
    shape: tuple[int, ...]
    """One input's shape."""
    num_classes: int
    """Classes (images) or vocabulary size (tokens)."""


def _torchvision_dataset(name: str, root: str, train: bool, download: bool):
    from torchvision import datasets, transforms

    mean, std = NORMALISATION[name]
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    cls = {"mnist": datasets.MNIST, "cifar10": datasets.CIFAR10}[name]
    return cls(root, train=train, transform=transform, download=download)


def _fetch_or_explain(name: str, root: str, runtime: Runtime, download: bool) -> None:
    """Make sure the files are under ``root``: rank 0 downloads if it may and
    can, and every rank learns the outcome, so all stop with the same message."""
    problem = "" if download else "downloads are off"
    if runtime.is_main and download:
        try:
            for train in (True, False):
                _torchvision_dataset(name, root, train, download=True)
        except Exception as err:  # URLError, socket errors, checksum errors...
            problem = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    box = [problem]
    if runtime.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        where = f"{name} is not in {os.path.abspath(root)} and was not downloaded ({box[0]})"
        if os.path.isdir("/kaggle"):  # a notebook sets the flags; the learner's fix is the kernel's settings
            raise DistlabError(f"{where}: on Kaggle, turn Settings > Internet on (it needs a phone-verified account) "
                               "and run the cell again")  # fmt: skip
        raise DistlabError(f"{where}; put the files there (--data-dir), or train offline with --dataset synthetic")


def _write_idx(path: Path, array: torch.Tensor) -> None:
    """IDX as MNIST ships it: magic (ubyte, ndim), big-endian dims, raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.dim()) + struct.pack(f">{array.dim()}I", *array.shape)
    path.write_bytes(header + array.to(torch.uint8).numpy().tobytes())


def write_tiny_mnist(root: Path, train_size: int = 96, test_size: int = 40, seed: int = 0) -> Path:
    """MNIST-format files under ``root`` (``root/MNIST/raw``) that torchvision's real MNIST class reads, for a
    machine without network (the labs' offline stand-in, the tests): digits drawn as class-dependent bright bars
    so a model can learn them."""
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for prefix, n in (("train", train_size), ("t10k", test_size)):
        labels = torch.arange(n) % 10
        images = torch.randint(0, 60, (n, 28, 28), generator=gen)
        for i, label in enumerate(labels.tolist()):
            images[i, 2 + 2 * label : 4 + 2 * label, 4:24] = 255
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return Path(root)


def load_datasets(
    name: str,
    root: str,
    runtime: Runtime,
    synthetic_size: int = 8192,
    model_kind: str = "image",
    vocab_size: int = 256,
    seq_len: int = 64,
    seed: int = 0,
    download: bool = True,
):
    """Return ``(train, test, spec)`` for ``mnist``, ``cifar10`` or ``synthetic``.

    ``synthetic`` takes the shape the model wants: MNIST-shaped images for
    the image models, token sequences for the GPT models.
    """
    if name == "synthetic":
        test_size = max(synthetic_size // 8, 64)
        if model_kind == "tokens":
            spec = DataSpec("tokens", (seq_len,), vocab_size)
            return (
                SyntheticTokens(vocab_size, seq_len, synthetic_size, seed),
                SyntheticTokens(vocab_size, seq_len, test_size, seed + 1),
                spec,
            )
        shape = IMAGE_SHAPES["mnist"]
        return (
            SyntheticImages(shape, synthetic_size, seed=seed),
            SyntheticImages(shape, test_size, seed=seed, split_seed=1),
            DataSpec("image", shape, 10),
        )
    if name not in IMAGE_SHAPES:
        raise DistlabError(f"unknown dataset {name!r}: use mnist, cifar10 or synthetic")
    if model_kind == "tokens":
        raise DistlabError(f"the GPT models read tokens, not {name} images: use --dataset synthetic")
    try:
        train, test = (_torchvision_dataset(name, root, t, download=False) for t in (True, False))
    except RuntimeError:
        _fetch_or_explain(name, root, runtime, download)
        train, test = (_torchvision_dataset(name, root, t, download=False) for t in (True, False))
    return train, test, DataSpec("image", IMAGE_SHAPES[name], 10)


def as_tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole dataset as two tensors, transformed exactly as the loader would."""
    if isinstance(dataset, (SyntheticImages, SyntheticTokens)):
        return dataset.data, dataset.targets
    data = getattr(dataset, "data", None)
    name = type(dataset).__name__.lower()
    if data is not None and name in NORMALISATION:
        mean, std = (torch.tensor(v).view(-1, 1, 1) for v in NORMALISATION[name])
        images = torch.as_tensor(data).float().div_(255)
        images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2)
        return ((images - mean) / std).contiguous(), torch.as_tensor(dataset.targets)
    pairs = [dataset[i] for i in range(len(dataset))]
    return torch.stack([p[0] for p in pairs]), torch.as_tensor([p[1] for p in pairs])


class SampledLoader:
    """A DataLoader fed by a DistributedSampler, moving batches to the device."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        runtime: Runtime,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        non_blocking: bool = False,
        drop_last: bool = True,
    ):
        self.sampler = DistributedSampler(
            dataset, num_replicas=runtime.world_size, rank=runtime.rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            num_workers=num_workers,
            pin_memory=pin_memory and runtime.device.type == "cuda",
            drop_last=drop_last,
            persistent_workers=num_workers > 0,
            # Its own generator for the workers' seeds: drawn from the global one, starting an
            # epoch would move the RNG that dropout uses, and a resumed run would draw differently.
            generator=torch.Generator().manual_seed(seed),
        )
        self.device, self.non_blocking = runtime.device, non_blocking

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for batch in self.loader:
            yield tuple(t.to(self.device, non_blocking=self.non_blocking) for t in batch)


def shard_indices(
    n: int, world_size: int, rank: int, seed: int, epoch: int, shuffle: bool = True, drop_last: bool = True
) -> torch.Tensor:
    """This rank's indices for one epoch: the same split DistributedSampler makes."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(n)
    if drop_last:
        per_rank = n // world_size
    else:
        per_rank = math.ceil(n / world_size)
        order = torch.cat([order, order[: per_rank * world_size - n]])
    return order[: per_rank * world_size][rank::world_size]


class DeviceResidentLoader:
    """The whole dataset on the device; each epoch a fresh shuffle, sharded by rank.

    No workers, no host-to-device copy per batch: indexing a device tensor is
    the whole input pipeline.
    """

    def __init__(self, dataset: Dataset, batch_size: int, runtime: Runtime, seed=0, shuffle=True, drop_last=True):
        inputs, targets = as_tensors(dataset)
        self.inputs, self.targets = inputs.to(runtime.device), targets.to(runtime.device)
        self.batch_size, self.runtime, self.seed = batch_size, runtime, seed
        self.shuffle, self.drop_last, self.epoch = shuffle, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        per_rank = len(
            shard_indices(
                len(self.targets), self.runtime.world_size, self.runtime.rank, self.seed, 0, False, self.drop_last
            )
        )
        return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rt = self.runtime
        mine = shard_indices(
            len(self.targets), rt.world_size, rt.rank, self.seed, self.epoch, self.shuffle, self.drop_last
        ).to(rt.device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            idx = mine[start : start + self.batch_size]
            yield self.inputs[idx], self.targets[idx]


class EvalShard(Dataset):
    """Rank ``rank``'s share of an evaluation set, padded so every rank runs
    the same number of batches (FSDP needs every rank in every forward); the
    third item marks real samples, so padding is never counted."""

    def __init__(self, dataset: Dataset, world_size: int, rank: int):
        self.dataset, self.world_size, self.rank = dataset, world_size, rank
        self.per_rank = math.ceil(len(dataset) / world_size)

    def __len__(self) -> int:
        return self.per_rank

    def __getitem__(self, i: int):
        position = i * self.world_size + self.rank
        x, y = self.dataset[position % len(self.dataset)]
        return x, y, position < len(self.dataset)


def eval_loader(
    dataset: Dataset, batch_size: int, runtime: Runtime, num_workers: int = 0
) -> Iterator[tuple[torch.Tensor, ...]]:
    shard = EvalShard(dataset, runtime.world_size, runtime.rank)
    for batch in DataLoader(shard, batch_size=batch_size, num_workers=num_workers):
        yield tuple(t.to(runtime.device) for t in batch)


# -- data-order checks ----------------------------------------------------------------------------------------
# Catch the two classic DDP data mistakes while the job runs.
#
# 1. No ``DistributedSampler``: every rank iterates the whole dataset, so with
#    the same seed every rank trains on the same batches (N GPUs, one GPU's
#    worth of distinct data).
# 2. No ``sampler.set_epoch(epoch)``: the sampler reshuffles with the same seed
#    each epoch, so every epoch visits the samples in the same order.
#
# :class:`DataOrderCheck` looks at the loader when it can (the type of its
# sampler, whether the sampler's epoch moved) and otherwise at the data
# itself: it fingerprints each rank's first batch of every epoch and compares
# the fingerprints across ranks and across epochs. Every rank gets the same
# list of problems, so every rank can act on it the same way.

SAME_BATCH_ON_RANKS = (
    "ranks {ranks} got the same first batch in epoch {epoch}: give each rank its own shard "
    "with DataLoader(dataset, sampler=DistributedSampler(dataset))"
)
NOT_DISTRIBUTED_SAMPLER = (
    "the DataLoader's sampler is a {kind}, not a DistributedSampler: every rank draws "
    "from the whole dataset instead of its 1/{world} shard"
)
SAME_ORDER_AS_LAST_EPOCH = (
    "epoch {epoch} starts with the same batch as epoch {previous} on every rank: call "
    "sampler.set_epoch(epoch) at the start of each epoch so the shuffle changes"
)


def fingerprint(batch: torch.Tensor) -> int:
    """A checksum of a batch's bytes (CRC32): equal batches, equal prints."""
    data = batch.detach().contiguous().cpu()
    return zlib.crc32(data.view(torch.uint8).numpy().tobytes()) if data.numel() else 0


class DataOrderCheck:
    """Call :meth:`check_first_batch` with the first batch of every epoch.

    ``loader`` (optional) lets the check inspect a ``DataLoader``'s sampler.
    With ``strict=True`` a problem raises :class:`DistlabError`; otherwise
    :meth:`check_first_batch` returns the problems for the caller to report.
    """

    def __init__(self, loader: Any = None, group=None, strict: bool = False):
        self.loader = loader
        self.group = group
        self.strict = strict
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self._previous: tuple[int, list[int], int | None] | None = None

    def check_first_batch(self, epoch: int, inputs: torch.Tensor) -> list[str]:
        prints = self._gather(fingerprint(inputs))
        sampler = getattr(self.loader, "sampler", None)
        sampler_epoch = getattr(sampler, "epoch", None)
        problems = []
        if self.world_size > 1:
            if sampler is not None and not isinstance(sampler, DistributedSampler) and self._previous is None:
                problems.append(NOT_DISTRIBUTED_SAMPLER.format(kind=type(sampler).__name__, world=self.world_size))
            duplicates = _ranks_sharing_a_value(prints)
            if duplicates:
                problems.append(SAME_BATCH_ON_RANKS.format(ranks=" and ".join(map(str, duplicates)), epoch=epoch))
        if self._previous is not None:
            previous_epoch, previous_prints, previous_sampler_epoch = self._previous
            same_data = previous_prints == prints
            sampler_stuck = (
                isinstance(sampler, DistributedSampler) and sampler.shuffle and sampler_epoch == previous_sampler_epoch
            )
            if same_data or sampler_stuck:
                problems.append(SAME_ORDER_AS_LAST_EPOCH.format(epoch=epoch, previous=previous_epoch))
        self._previous = (epoch, prints, sampler_epoch)
        if problems and self.strict:
            raise DistlabError(problems[0])
        return problems

    def _gather(self, value: int) -> list[int]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered


def _ranks_sharing_a_value(values: list[int]) -> list[int]:
    first_seen: dict[int, int] = {}
    for rank, value in enumerate(values):
        if value in first_seen:
            return [first_seen[value], rank]
        first_seen[value] = rank
    return []
