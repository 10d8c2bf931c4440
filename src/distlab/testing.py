"""Helpers for tests and lab exercises: the tolerances the equivalence checks use, real gloo ranks on the CPU
(started by :mod:`distlab.jobs`, the process runner), torchrun as a subprocess, toy models every wrapper must
train alike, and a tiny MNIST written to disk in the format torchvision reads.

Functions run on ranks must be importable (module-level), because they are pickled to the ranks.
"""

from __future__ import annotations

import importlib
import json
import struct
import subprocess
from pathlib import Path

import torch
import torch.nn as nn

from .jobs import (
    RankPool,
    launcher_environment,
    run_job,
    run_ranks,  # noqa: F401 - the tests reach fresh ranks here, beside the pool's run_entry
    torchrun_command,
)
from .models import MnistCNN, reset_module

# float32 SGD over a few steps: only the order of additions differs between
# ranks and the single process, which stays at rounding level.
ATOL, RTOL = 1e-5, 1e-4
CNN_PARAMETERS = 405_898
"""Parameters of the reference notes' MNIST CNN (:class:`distlab.models.MnistCNN`)."""


def run_torchrun(nproc: int, target: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a torchrun job to completion, one thread per rank, capturing its output."""
    return run_job(torchrun_command(nproc, target, *args), timeout=timeout, env=launcher_environment(1))


def _entry_point(runtime, module: str, argv: list[str]) -> None:
    importlib.import_module(module).main(argv)


def run_entry(pool: RankPool, module: str, *argv) -> None:
    """``python -m module *argv`` as torchrun runs it, but in-process on the ranks of ``pool``: the entry point's
    ``main(argv)``, whose ``distributed()`` finds the pool's group and leaves it alone. For a test of what the
    entry point computes; what it does as a process (its exit code, its one line on stderr) is tested with
    :func:`run_torchrun`."""
    pool.run(_entry_point, module, [str(arg) for arg in argv])


def written_file(notebook: Path, filename: str) -> str:
    """What a lab notebook writes to ``filename`` with ``%%writefile``: the one cell that does, without the magic."""
    cells = ["".join(c["source"]) for c in json.loads(Path(notebook).read_text())["cells"] if c["cell_type"] == "code"]
    written = [source for source in cells if source.startswith(f"%%writefile {filename}\n")]
    assert len(written) == 1, f"{Path(notebook).name} must write {filename} in exactly one cell"
    return written[0].split("\n", 1)[1]


def assert_same_state(actual: dict, expected: dict, atol: float = ATOL, rtol: float = RTOL, label: str = "") -> None:
    """Two state dicts hold the same keys and, within tolerance, the same tensors."""
    assert actual.keys() == expected.keys(), f"{label}: keys differ: {sorted(set(actual) ^ set(expected))}"
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], atol=atol, rtol=rtol, msg=lambda m, key=key: f"{label} {key}: {m}"
        )


def _write_idx(path: Path, array: torch.Tensor) -> None:
    """IDX as MNIST ships it: magic (ubyte, ndim), big-endian dims, raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.dim()) + struct.pack(f">{array.dim()}I", *array.shape)
    path.write_bytes(header + array.to(torch.uint8).numpy().tobytes())


def write_tiny_mnist(root: Path, train_size: int = 96, test_size: int = 40, seed: int = 0) -> Path:
    """MNIST-format files torchvision's real MNIST class reads (no download):
    digits drawn as class-dependent bright bars so a model can learn them."""
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


class ToyWithFrozen(nn.Module):
    """Two linear layers whose first bias is frozen: a wrapper must neither
    reduce nor step what does not train. No size divides by 2, 3 or 4."""

    def __init__(self, in_features: int = 11, hidden: int = 7, classes: int = 5):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(in_features, hidden), nn.Linear(hidden, classes)
        self.fc1.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def shard_units(self) -> list[nn.Module]:
        return [self.fc1, self.fc2]

    def init_module(self, module: nn.Module) -> None:
        reset_module(module)


class ToyTied(nn.Module):
    """Input and output layers sharing one weight (as a GPT's embedding and
    head do): its gradient is the sum of both uses, reduced once."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))

    def shard_units(self) -> list[nn.Module]:
        return [self.mid]  # the tied pair stays in the root unit, so its weight is gathered once

    def init_module(self, module: nn.Module) -> None:
        reset_module(module)


class ToyWithUnusedLayer(nn.Module):
    """A layer that never takes part in the loss: its parameters get no gradient,
    which a data-parallel wrapper must name instead of waiting for them forever."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


TOY_MODELS = {
    "cnn": (lambda: MnistCNN(), (1, 28, 28), 10),
    "frozen": (lambda: ToyWithFrozen(), (11,), 5),
    "tied": (lambda: ToyTied(), (6,), 6),
}
"""Name -> (constructor, input shape, classes): the models every implementation must train alike."""
