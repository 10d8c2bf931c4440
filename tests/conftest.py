"""Fixtures shared by the tests; the helpers themselves live in distlab.testing."""

from __future__ import annotations

from pathlib import Path

import pytest

from distlab.testing import write_tiny_mnist


@pytest.fixture
def tiny_mnist(tmp_path: Path) -> Path:
    return write_tiny_mnist(tmp_path / "data")
