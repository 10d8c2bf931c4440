"""What the grader says of the answers a fourth review wrote: each wrong one named for what it did, each right
one passing, on every rank count the grader chooses. The wrong answers are cases of tests/mistakes_*.py (graded
by tests/test_exercises.py); the right ones written otherwise than the course's are their ``ALTERNATIVES``."""

from __future__ import annotations

import importlib

import pytest
import torch

from distlab import runtime
from distlab.comm.collectives import segment_bounds
from distlab.exercises import grade, grader
from distlab.exercises.catalog import CHAPTERS, all_exercises, get
from distlab.exercises.ring import _chunk_bounds
from distlab.exercises.trace import sent_elsewhere
from mistakes_ring import all_reduce_receives_from_the_right, reduce_scatter_with_chunk
from test_exercises import STUCK_TIMEOUT_S

ALTERNATIVES = [
    case for chapter in CHAPTERS for case in getattr(importlib.import_module(f"mistakes_{chapter}"), "ALTERNATIVES", [])
]
RINGS = ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")


@pytest.mark.parametrize("exercise, right", ALTERNATIVES, ids=[f"{e}-{f.__name__}" for e, f in ALTERNATIVES])
def test_a_right_answer_written_otherwise_passes(exercise, right):
    verdict = grade(exercise, right)
    assert verdict.passed, verdict.message


def test_two_ranks_cannot_tell_a_rings_mistakes_from_a_right_answer():
    """Why a ring is never checked on two ranks alone: there every length is cut by torch.chunk as by
    segment_bounds, and rank + 1 is rank - 1."""
    assert all(segment_bounds(length, 2) == _chunk_bounds(length, 2) for length in range(1, 200))
    assert all((rank + 1) % 2 == (rank - 1) % 2 for rank in range(2))
    assert segment_bounds(10, 3) != _chunk_bounds(10, 3)  # three ranks tell them apart (ring.LENGTHS holds 10)
    for name in RINGS:
        assert get(name).min_ranks == 3 and get(name).ranks >= 3


@pytest.mark.parametrize("gpus", (0, 1, 2, 3, 4, 8))
def test_auto_never_checks_on_fewer_ranks_than_the_exercises(monkeypatch, gpus):
    monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
    for exercise in all_exercises().values():
        placement = grader._placement(exercise, None, "auto")
        assert placement.ranks == exercise.ranks, (exercise.name, gpus, placement.reason)
        assert placement.device == ("cuda" if gpus >= exercise.ranks else "cpu"), (exercise.name, gpus)


def test_the_learners_own_cuda_takes_one_rank_per_gpu(monkeypatch):
    monkeypatch.setattr(runtime, "gpu_count", lambda: 2)  # Kaggle's two T4s
    placement = grader._placement(get("ring_all_reduce"), None, "cuda")
    assert (placement.ranks, placement.device, placement.backend) == (2, "cuda", "nccl")


@pytest.mark.parametrize("gpus, said", [(0, "no usable CUDA GPU"), (1, "has 1 for 3 ranks: leave device out")])
def test_cuda_the_machine_cannot_give_is_refused_in_the_words_check_takes(monkeypatch, gpus, said):
    monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
    verdict = grade("ring_all_reduce", get("ring_all_reduce").solution_function(), device="cuda")
    assert verdict.status == "refused" and said in verdict.message, verdict.message
    assert "--" not in verdict.message and "check on 3 gloo ranks on the CPU" in verdict.message, verdict.message


@pytest.mark.parametrize(
    "exercise, wrong, mistake",
    [
        # it deadlocks on three ranks, named once the grader's timeout expires: slow, as every such grading is
        pytest.param("ring_all_reduce", all_reduce_receives_from_the_right, "wrong_peer", marks=pytest.mark.slow),
        ("ring_reduce_scatter", reduce_scatter_with_chunk, "cut_differently"),
    ],
)
def test_a_ring_asked_for_on_two_ranks_is_checked_again_on_three(exercise, wrong, mistake):
    verdict = grade(exercise, wrong, ranks=2, timeout_s=STUCK_TIMEOUT_S)
    assert not verdict.passed and verdict.mistake == mistake, verdict.message
    assert verdict.ranks == 3 and verdict.device == "cpu"
    assert "It was right on the 2 gloo ranks asked for, but on 2 gloo ranks, rank + 1 and rank - 1" in verdict.message
    assert verdict.message.splitlines()[1].startswith("  It was right"), verdict.message  # said before the details


def test_a_right_ring_on_two_ranks_says_it_was_checked_on_three_too():
    verdict = grade("ring_all_reduce", get("ring_all_reduce").solution_function(), ranks=2)
    assert verdict.passed and verdict.ranks == 2, verdict.message
    assert "Also right on 3 gloo ranks on the CPU" in verdict.message, verdict.message


def test_a_send_to_a_rank_that_receives_from_another_is_named_from_the_trace():
    """The send side of a wrong peer (the receive side is a real run in tests/mistakes_ring.py): rank 0 blocks in
    a send to rank 1, which waits for rank 2, which sends to rank 1's other neighbour."""
    traces = [
        [{"op": "send", "peer": 1, "n": 1}],
        [{"op": "recv", "peer": 2, "n": 1}],
        [{"op": "send", "peer": 0, "n": 1}],
    ]
    assert sent_elsewhere(traces, 0, traces[0][0]) == "; rank 1 receives from rank 2, not from rank 0"
    assert sent_elsewhere(traces, 1, traces[1][0]) == "; rank 2 sent to rank 0, not to rank 1"
    matched = [[{"op": "send", "peer": 1, "n": 1}], [{"op": "recv", "peer": 0, "n": 1}]]
    assert sent_elsewhere(matched, 1, matched[1][0]) == ""


def test_a_tensor_changed_in_flight_is_seen_by_its_version_not_by_the_wire():
    """torch's collectives leave a tensor's version alone; the learner's in-place ops bump it (what the checks of
    changed_in_flight, not_in_place and momentum_late rest on)."""
    grad = torch.ones(3)
    version = grad._version
    grad /= 3
    assert grad._version != version
    view = torch.zeros(6)[2:4]
    base_version = view._base._version
    view += 1
    assert view._base._version != base_version  # a view's += is its tensor's write
