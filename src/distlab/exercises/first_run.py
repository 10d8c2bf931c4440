"""The first-run page's exercise: the mean of a value over the ranks, as the training loop averages its
losses (one all-reduce, then a division by the world size).

Every rank's value is drawn from a generator seeded by the case and the rank, so every rank computes the mean
itself, with no collective of its own between the learner's calls.
"""

from __future__ import annotations

import torch

from .catalog import Exercise
from .trial import Trial

DELIVER_TO_ALL = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor"}
CASES = (("a scalar loss", ()), ("a vector of 5 per-class losses", (5,)), ("a 2 x 3 tensor", (2, 3)))


def rank_value(shape: tuple[int, ...], rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * len(shape) + sum(shape) + 7 * rank)
    return torch.rand(shape, generator=generator) * 4


def global_mean_trial(t: Trial, fn) -> None:
    n, r = t.world_size, t.rank
    for label, shape in CASES:
        with t.case(label):
            values = [rank_value(shape, rank) for rank in range(n)]
            mean = sum(values) / n
            value = values[r].clone().to(t.device)
            since = len(t.tracer.calls)
            got = t.call(fn, value)
            ops = t.tracer.ops(since)
            if not ops:
                t.fail(
                    "result", "your function called no collective: each rank only sees its own value", "no_collective"
                )
            if not isinstance(got, torch.Tensor):
                t.fail("result", f"it returned {type(got).__name__}, not a tensor", "not_a_tensor")
            result = got.detach().cpu()
            if "reduce" in ops and not set(ops) & DELIVER_TO_ALL:  # on every rank, the one that has the sum too
                right = result.shape == mean.shape and torch.allclose(result, mean)
                got_it = f"rank {r} has the mean" if right else f"rank {r} returned {_show(result)}, not {_show(mean)}"
                t.fail("result", f"it called dist.reduce, which leaves the sum on one rank only ({got_it}); "
                       "the ranks' results differ", "reduce_to_one_rank")  # fmt: skip
            if n > 1 and result.shape == mean.shape and torch.allclose(result, mean * n):
                t.fail("result", f"it is the sum over the {n} ranks ({_show(result)}), not the mean "
                       f"({_show(mean)})", "summed")  # fmt: skip
            t.expect_close(result, mean, "result", {"own_value": values[r]})
            if not torch.equal(value.cpu(), values[r]):
                t.fail("input", f"the tensor passed in now holds {_show(value.cpu())}, not {_show(values[r])}",
                       "changed_input")  # fmt: skip
    t.note(f"every rank returned the same ({' + '.join(f'x{k}' for k in range(n))}) / {n}, and kept its own x.")


def _show(x: torch.Tensor) -> str:
    flat = [f"{v:.4g}" for v in x.reshape(-1).tolist()[:3]]
    return flat[0] if x.dim() == 0 else "[" + ", ".join(flat) + (", ...]" if x.numel() > 3 else "]")


EXERCISES = (
    Exercise(
        name="global_mean",
        page="running",
        task="Return, on every rank, the mean over the ranks of `value` (a tensor of any shape): all-reduce a copy, "
        "then divide by the world size. Leave `value` itself as it was.",
        signature="def global_mean(value: torch.Tensor) -> torch.Tensor:",
        solution="first_run.global_mean",
        library="distlab.train.epoch_progress",
        trial=global_mean_trial,
        mistakes={
            "summed": "dist.all_reduce sums: divide the result by dist.get_world_size().",
            "reduce_to_one_rank": "dist.reduce(tensor, dst=0) delivers the sum to rank 0 only; the others' tensors "
            "are left undefined. dist.all_reduce gives every rank the sum.",
            "own_value": "each rank returned its own value: the all-reduce's result was not used. all_reduce "
            "returns nothing useful; it writes the sum into the tensor you pass it.",
            "no_collective": "call dist.all_reduce: without a collective no rank learns the others' values.",
            "changed_input": "dist.all_reduce works in place: reducing `value` itself overwrote the caller's tensor "
            "with the sum. Reduce a copy (`value.clone()`), as the training loop reduces its own sums tensor.",
            "not_a_tensor": "return a tensor of the same shape as `value`.",
        },
        pages=("labs/lab0_first_run",),
    ),
)
