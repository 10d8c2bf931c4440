"""The troubleshooting page's exercises: a decision every rank must share, and counts from uneven ranks.

Both are one collective long, and both are where real scripts hang or report a wrong number: a rank that
skips a step the others take, and an evaluation whose ranks saw different numbers of samples.
"""

from __future__ import annotations

import torch

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
)
