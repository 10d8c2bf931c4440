"""The low-precision comparison has one home, distlab.models.relative_update_error: the FSDP2 chapter and
tests/test_equivalence.py import it instead of each writing it out (architecture review 5, B11)."""

from __future__ import annotations

import pathlib

import torch

from distlab.models import relative_update_error

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_error_is_a_fraction_of_the_reference_update_over_every_tensor():
    initial = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    reference = {"w": torch.full((2, 2), 3.0), "b": torch.full((2,), 4.0)}  # update norm: sqrt(4*9 + 2*16) = sqrt(68)
    state = {"w": torch.full((2, 2), 3.0), "b": torch.tensor([4.0, 4.0 + 68**0.5 / 10])}
    assert relative_update_error(reference, reference, initial) == 0
    assert relative_update_error(initial, reference, initial) == 1
    assert abs(relative_update_error(state, reference, initial) - 0.1) < 1e-6


def test_the_chapter_and_the_equivalence_tests_import_the_one_definition():
    page = (ROOT / "book" / "fsdp2_in_practice.md").read_text()
    tests = (ROOT / "tests" / "test_equivalence.py").read_text()
    assert "def relative_update_error" not in page and "def _relative_update_error" not in tests
    assert "from distlab.models import build_model, relative_update_error" in page
    assert "from distlab.models import relative_update_error" in tests
