"""What the checks say of the answers a fifth review wrote (its section 4), beyond the mistake's name that
tests/test_exercises.py asserts: the note a right-but-for-bookkeeping answer gets, and the reading of evidence
that decides between two hints. The answers themselves are cases of tests/mistakes_*.py."""

from __future__ import annotations

import pytest
import torch

from distlab.exercises import grade
from distlab.exercises.zero import _UnitForward
from distlab.exercises.zero_memory import COUNTER_NOTE
from mistakes_zero import bytes_without_step_counter


def test_the_stage_table_without_the_step_counter_passes_with_a_note():
    verdict = grade("zero_bytes_per_rank", bytes_without_step_counter)
    assert verdict.passed, verdict.message
    assert COUNTER_NOTE in verdict.message and COUNTER_NOTE.startswith("right; the library also counts Adam's 4-byte")


def _unit(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(8.0).view(2, 4).requires_grad_(True)
    return ((_UnitForward.apply(flat, x, 2) - 1) ** 2).mean(), x


@pytest.mark.parametrize("free", ["data", "storage"])
def test_the_zero3_units_backward_reads_the_parameter_as_it_is_then(free):
    """A parameter freed between forward and backward fails in backward, however it was freed; gathered again in
    place, it gives the gradients plain autograd gives (the check compares them with those)."""
    values = torch.arange(12.0) / 7
    flat = values.clone().requires_grad_(True)
    loss, _ = _unit(flat)
    if free == "data":
        flat.data = torch.empty(0)
    else:
        flat.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="holds 0 of its 12 values when backward reads it"):
        loss.backward()

    flat = values.clone().requires_grad_(True)
    loss, x = _unit(flat)
    flat.untyped_storage().resize_(0)
    flat.untyped_storage().resize_(12 * 4)
    flat.detach().copy_(values)  # gathered again, as ShardedUnit's pre-backward hook does
    loss.backward()
    plain = values.clone().requires_grad_(True)
    x_plain = x.detach().clone().requires_grad_(True)
    weight, bias = plain[:8].view(2, 4), plain[8:10]
    ((x_plain @ weight.T + bias - 1) ** 2).mean().backward()
    assert torch.allclose(flat.grad, plain.grad) and torch.allclose(x.grad, x_plain.grad)
