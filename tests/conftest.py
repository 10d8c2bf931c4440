"""Fixtures shared by the tests, and the tiers; the helpers themselves live in distlab.testing and distlab.jobs.

The README's command (``python -m pytest``) runs the default tier: every test that checks a value. The other
tiers are markers (pyproject.toml says what each proves): ``slow``, ``stress`` and ``kaggle`` run in CI on every
change and here with ``-m``; ``gpu`` on a GPU machine (tests/test_gpu.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from distlab.data import write_tiny_mnist
from distlab.testing import RankPool

GPU_TIER = ("gpu", "gpu and quick")
"""The GPU tier's two sizes (the files of GPU_FILES): everything, and the quick selection."""
GPU_FILES = ("test_gpu.py", "test_gpu_labs.py", "test_gpu_fp16.py", "test_gpu_compile.py")
"""The files ``pytest -m gpu`` collects; scripts/gpu_check.py names the same."""
OTHER_TIERS = ("slow", "stress", "kaggle")
"""The tiers CI runs beside the default one, in the order the end of a default run names them."""


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """``pytest -m gpu`` (or ``-m "gpu and quick"``) collects :data:`GPU_FILES` alone: the other files import the
    book's stack (Jupyter, Playwright, Accelerate), which a GPU image need not have (tests/gpu-requirements.txt
    lists what the tier needs)."""
    if config.getoption("markexpr") in GPU_TIER and collection_path.suffix == ".py":
        return collection_path.name.startswith("test_") and collection_path.name not in GPU_FILES
    return None


_LEFT_OUT = pytest.StashKey[Counter]()


def pytest_configure(config) -> None:
    config.stash[_LEFT_OUT] = Counter()


def pytest_deselected(items) -> None:
    """Count what the marker expression left out, by tier, for the line at the end of the run."""
    for item in items:
        tier = next((name for name in OTHER_TIERS if item.get_closest_marker(name)), None)
        if tier:
            item.config.stash[_LEFT_OUT][tier] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The default tier's last line: what the other tiers hold, that CI runs them, and how to run them here."""
    left_out = config.stash[_LEFT_OUT]
    if not left_out:
        return
    counts = ", ".join(f"{left_out[tier]} {tier}" for tier in OTHER_TIERS if left_out[tier])
    terminalreporter.write_line(
        f"Not run here: {sum(left_out.values())} tests of the other tiers ({counts}); CI runs every tier on every "
        'change. Here: python -m pytest -m slow (or -m stress, -m kaggle, or -m "not gpu" for all of them); '
        "a GPU machine: python scripts/gpu_check.py"
    )


@pytest.fixture
def tiny_mnist(tmp_path: Path) -> Path:
    return write_tiny_mnist(tmp_path / "data")


@pytest.fixture(scope="session")
def ranks2():
    """Two gloo ranks started once for the session: ``ranks2.run(fn, *args)`` runs ``fn(runtime, *args)`` on
    both and returns each rank's value (:class:`distlab.testing.RankPool`)."""
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks3():
    """Three gloo ranks started once for the session (uneven shards), as :func:`ranks2`."""
    with RankPool(3) as pool:
        yield pool
