"""Fixtures shared by the tests; the helpers themselves live in distlab.testing."""

from __future__ import annotations

from pathlib import Path

import pytest

from distlab.testing import write_tiny_mnist

GPU_TIER = ("gpu", "gpu and quick")
"""The GPU tier's two sizes (tests/test_gpu.py): everything, and the quick selection."""


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """``pytest -m gpu`` (or ``-m "gpu and quick"``) collects tests/test_gpu.py alone: the other files import the
    book's stack (Jupyter,
    Playwright, Accelerate), which a GPU image need not have (tests/gpu-requirements.txt lists what the tier
    needs)."""
    if config.getoption("markexpr") in GPU_TIER and collection_path.suffix == ".py":
        return collection_path.name.startswith("test_") and collection_path.name != "test_gpu.py"
    return None


@pytest.fixture
def tiny_mnist(tmp_path: Path) -> Path:
    return write_tiny_mnist(tmp_path / "data")
