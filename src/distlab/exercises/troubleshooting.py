"""The troubleshooting page's exercises: a decision every rank must share, counts from uneven ranks, and the
collective a hung job's ranks disagreed on, read from their Flight Recorder dumps.

The first two are one collective long, and both are where real scripts hang or report a wrong number: a rank
that skips a step the others take, and an evaluation whose ranks saw different numbers of samples. The third
reads what two hung gloo ranks recorded.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..measure.flight_recorder import Call, first_mismatch
from .catalog import Exercise
from .trial import Trial

SKIP_CASES = {
    "no rank saw a bad batch": (),
    "rank 1 saw one": (1,),
    "ranks 0 and 2 saw one": (0, 2),
    "every rank saw one": (0, 1, 2, 3),
}
UNEVEN = {  # rank -> (correct, seen): the last rank's shard is the short one, as a sampler without padding leaves it
    "uneven shards": lambda rank, n: (40 + 7 * rank, 50 + 10 * rank) if rank < n - 1 else (9, 13),
    "one rank saw nothing": lambda rank, n: (0, 0) if rank == n - 1 else (30 + rank, 40),
}


def agree_trial(t: Trial, fn) -> None:
    for label, bad_ranks in SKIP_CASES.items():
        with t.case(label):
            mine = t.rank in bad_ranks
            got = t.call(fn, mine)
            if not isinstance(got, bool | int) and not (isinstance(got, torch.Tensor) and got.numel() == 1):
                t.fail("answer", f"expected True or False, got {type(got).__name__}", "not_a_bool")
            got, expected = bool(got), any(rank in bad_ranks for rank in range(t.world_size))
            if got != expected:
                everyone = all(rank in bad_ranks for rank in range(t.world_size))
                fits = [
                    name for name, answer in (("local_decision", mine), ("needs_every_rank", everyone)) if got == answer
                ]
                mistake = fits[0] if fits else None  # a rank without a bad batch cannot tell the two apart
                said, should = ("skip" if got else "keep"), ("skip" if expected else "keep")
                bad = list(bad_ranks) or "none"
                detail = f"it said {said} where every rank must {should} (bad batches on ranks {bad})"
                t.fail("answer", detail, mistake, certain=len(fits) == 1)


def accuracy_trial(t: Trial, fn) -> None:
    n = t.world_size
    for label, counts in UNEVEN.items():
        with t.case(label):
            per_rank = [counts(rank, n) for rank in range(n)]
            correct, seen = per_rank[t.rank]
            got = t.call(fn, correct, seen)
            expected = sum(c for c, _ in per_rank) / sum(s for _, s in per_rank)
            try:
                value = float(got)
            except (TypeError, ValueError):
                t.fail("accuracy", f"expected a number, got {type(got).__name__}", "not_a_number")
            if abs(value - expected) > 1e-6:
                mean_of_ratios = sum(c / s if s else 0.0 for c, s in per_rank) / n
                local = correct / seen if seen else float("nan")
                mistake = (
                    "averaged_ratios" if abs(value - mean_of_ratios) < 1e-6
                    else "local_accuracy" if abs(value - local) < 1e-6
                    else None
                )  # fmt: skip
                t.fail("accuracy", f"got {value:.6f}, expected {expected:.6f} (ranks' counts {per_rank})", mistake)


def _calls(rank: int, *made: tuple) -> list[Call]:
    """(sequence, collective, sizes, where) -> the rank's calls, as ``flight_recorder.read_dump`` reads them."""
    return [Call(rank, "0", sequence, collective, sizes, where) for sequence, collective, sizes, where in made]


START = (1, "barrier", (), "hangs.py:71 in main")
STEP = "failures.py:47 in skip"
# What two gloo ranks recorded in `python -m distlab.demos.hangs --case mismatch` and `--case skip`: the dumps are
# tests/flight-recorder/, and tests/test_flight_recorder.py holds these equal to their reading.
MISMATCH_DUMPS = {
    0: _calls(0, START, (2, "all_reduce", ((4,),), "failures.py:56 in mismatch")),
    1: _calls(1, START, (2, "broadcast", ((4,),), "failures.py:58 in mismatch")),
}
SKIP_DUMPS = {
    0: _calls(0, START, *[(sequence, "all_reduce", ((4,),), STEP) for sequence in (2, 3, 4)]),
    1: _calls(
        1,
        START,
        (2, "all_reduce", ((4,),), STEP),
        (3, "all_reduce", ((4,),), STEP),
        (4, "barrier", (), "failures.py:49 in skip"),
    ),
}


def _resized(dumps: dict[int, list[Call]], rank: int, sequence: int, sizes: tuple) -> dict[int, list[Call]]:
    return {
        r: [
            replace(c, collective="all_reduce", sizes=sizes) if (r, c.sequence) == (rank, sequence) else c
            for c in calls
        ]
        for r, calls in dumps.items()
    }


FLIGHT_RECORDS = {  # label -> (the dumps, the mistake a wrong answer to it most likely is)
    "rank 1 broadcast where rank 0 all-reduced (the mismatch case's dumps)": (MISMATCH_DUMPS, None),
    "rank 1 skipped an all-reduce (the skip case's dumps)": (SKIP_DUMPS, None),
    "every call matched (the skip case's first three)": ({r: calls[:3] for r, calls in SKIP_DUMPS.items()}, None),
    "rank 1 never reached its second collective (the mismatch case's, cut after rank 1's first call)": (
        {0: MISMATCH_DUMPS[0], 1: MISMATCH_DUMPS[1][:1]},
        "waiting_rank",
    ),
    "rank 0 never reached its second collective": ({0: MISMATCH_DUMPS[0][:1], 1: MISMATCH_DUMPS[1]}, "waiting_rank"),
    "rank 1 all-reduced 8 numbers where rank 0 all-reduced 4 (the shape case, whose abort leaves no dump)": (
        _resized(MISMATCH_DUMPS, 1, 2, ((8,),)),
        "ignored_sizes",
    ),
    "rank 0's ring buffer had dropped its two oldest calls (the skip case's)": (
        {0: SKIP_DUMPS[0][2:], 1: SKIP_DUMPS[1]},
        "by_position",
    ),
}


def _as_answer(got) -> tuple | None:
    if got is None:
        return None
    if not isinstance(got, tuple | list) or len(got) != 3:
        return ()  # not an answer
    rank, sequence, collective = got
    return int(rank), int(sequence), collective


def mismatch_trial(t: Trial, fn) -> None:
    for label, (dumps, likely) in FLIGHT_RECORDS.items():
        with t.case(label):
            got = _as_answer(t.call(fn, {rank: list(calls) for rank, calls in dumps.items()}))
            if got == ():
                t.fail("answer", "expected (rank, sequence, collective) or None", "not_an_answer")
            found = first_mismatch(dumps)
            expected = (found.rank, found.sequence, found.collective) if found else None
            if got != expected:
                waiting = found and found.collective is None and got and got[0] != found.rank
                held_by_all = max(min(call.sequence for call in calls) for calls in dumps.values())
                dropped = bool(got) and got[2] is None and got[1] < held_by_all  # a call a ring buffer let go
                mistake = "dropped_as_missing" if dropped else "waiting_rank" if waiting else likely
                t.fail("answer", f"got {got}, expected {expected}", mistake)


EXERCISES = (
    Exercise(
        name="agree_to_skip",
        page="troubleshooting",
        task="Each rank knows only whether its own batch was bad. Return True on every rank if any rank's batch "
        "was bad, False on every rank otherwise, so that all of them skip the step together or none does.",
        signature="def agree_to_skip(bad_batch: bool) -> bool:",
        solution="troubleshooting.agree_to_skip",
        library="torch.distributed.all_reduce with ReduceOp.MAX",
        trial=agree_trial,
        ranks=4,
        mistakes={
            "local_decision": "each rank decided from its own batch. The ranks then take different paths: the one "
            "that skips never calls the step's all-reduce and the others wait for it. Share the flag first.",
            "needs_every_rank": "you skip only when every rank saw a bad batch (a MIN or a product). One bad batch "
            "anywhere is enough: take the MAX, or check that the SUM is above 0.",
            "not_a_bool": "return a plain True or False (bool(tensor.item())).",
        },
    ),
    Exercise(
        name="global_accuracy",
        page="troubleshooting",
        task="Each rank evaluated its own shard: `correct` right answers out of `seen` samples, and the shards are "
        "not the same size. Return the accuracy over all samples, the same float on every rank.",
        signature="def global_accuracy(correct: int, seen: int) -> float:",
        solution="troubleshooting.global_accuracy",
        library="distlab.train.evaluate (it all-reduces its counts)",
        trial=accuracy_trial,
        ranks=3,
        mistakes={
            "averaged_ratios": "you averaged the ranks' accuracies. Ranks that saw fewer samples then weigh as much "
            "as the others: all-reduce the counts (correct and seen) and divide once.",
            "local_accuracy": "that is this rank's own accuracy; the others' samples are missing. "
            "All-reduce the counts.",
            "not_a_number": "return a Python float (tensor.item()).",
        },
    ),
    Exercise(
        name="mismatched_collective",
        page="troubleshooting",
        task="Given two hung ranks' Flight Recorder calls ({rank: [Call, ...]}, each Call with .sequence, "
        ".collective and .sizes), return (rank, sequence, collective) for the first sequence number at which the "
        "ranks' calls differ: the rank whose calls stop before it, with None for its collective, or else rank 1 "
        "and what it called (rank 0's call is the reference). None if every call matched.",
        signature="def mismatched_collective(dumps: dict[int, list]) -> tuple[int, int, str | None] | None:",
        solution="troubleshooting.mismatched_collective",
        library="distlab.measure.flight_recorder.first_mismatch",
        trial=mismatch_trial,
        ranks=1,
        mistakes={
            "by_position": "you paired the ranks' calls by their place in each list. A ring buffer keeps each rank's "
            "last N calls, not the same ones on every rank: pair them by call.sequence.",
            "dropped_as_missing": "you named a call older than the oldest one every rank still holds. A ring buffer "
            "drops a rank's oldest calls; such a call was not missed. Start at the highest first sequence number "
            "across the ranks.",
            "waiting_rank": "you named the rank that waits: its last call is the one nobody matched. Name the rank "
            "whose calls stop before that sequence number: it never got there (its collective is None).",
            "ignored_sizes": "the two ranks called the same collective on tensors of different sizes. "
            "Compare call.sizes as well as call.collective.",
            "not_an_answer": "return a tuple (rank, sequence, collective), or None when every call matched.",
        },
    ),
)
