"""Shared test helpers: real gloo ranks on the CPU, and a tiny MNIST on disk."""

from __future__ import annotations

import os
import socket
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world_size: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # 2-core machines: several ranks must not fight over threads
    from distlab.runtime import distributed

    with distributed("cpu", timeout_s=120) as runtime:
        value = fn(runtime, *args)
    torch.save(value, Path(out_dir) / f"rank{rank}.pt")
    # The group is destroyed and the result saved. Skip interpreter shutdown:
    # once in a few hundred runs a gloo thread still being destructed there
    # aborts the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, tmp_path: Path, *args):
    """Run ``fn(runtime, *args)`` on ``world_size`` real gloo ranks; return
    each rank's return value, in rank order. ``fn`` must be importable
    (a module-level function in a test file)."""
    out_dir = tmp_path / f"ranks-{fn.__name__}-{world_size}-{free_port()}"
    out_dir.mkdir(parents=True)
    mp.spawn(_rank_entry, args=(world_size, free_port(), fn, args, str(out_dir)), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _write_idx(path: Path, array: torch.Tensor) -> None:
    """IDX as MNIST ships it: magic (ubyte, ndim), big-endian dims, raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.dim()) + struct.pack(f">{array.dim()}I", *array.shape)
    path.write_bytes(header + array.to(torch.uint8).numpy().tobytes())


def write_tiny_mnist(root: Path, train_size: int = 96, test_size: int = 40, seed: int = 0) -> Path:
    """MNIST-format files torchvision's real MNIST class reads (no download):
    digits drawn as class-dependent bright bars so a model can learn them."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for prefix, n in (("train", train_size), ("t10k", test_size)):
        labels = torch.arange(n) % 10
        images = torch.randint(0, 60, (n, 28, 28), generator=gen)
        for i, label in enumerate(labels.tolist()):
            images[i, 2 + 2 * label : 4 + 2 * label, 4:24] = 255
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root


@pytest.fixture
def tiny_mnist(tmp_path: Path) -> Path:
    return write_tiny_mnist(tmp_path / "data")
