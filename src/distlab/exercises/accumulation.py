"""The practice chapter's exercise on gradient accumulation: the micro-steps of one optimizer step under torch DDP,
over padded sequences of unequal lengths, left with the gradient one process gets on the whole large batch.

Every rank draws every rank's micro-batches from one seeded generator, so each computes alone the whole batch's
gradient (the mean loss over its tokens), and the gradient of each typical mistake: each is the same per-micro-batch
summed losses, weighted otherwise. DDP's own all-reduces are not calls of ``torch.distributed`` from Python, so
they are counted by :class:`~distlab.comm.traffic.TrafficCounter`, in gradient-sized all-reduces.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ..comm.traffic import TrafficCounter
from .catalog import Exercise
from .trial import Trial

PAD = -100
CASES = ((2, 2, 6, 1), (3, 1, 8, 2), (2, 3, 5, 3))
"""(micro-batches per rank, sequences per micro-batch, padded length, seed)."""


def per_token_model(seed: int) -> nn.Module:
    """A per-token classifier, the same weights on every rank: (B, T, 6) features to (B, T, 5) logits."""
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / 2)
    return model


def step_batches(world: int, micro: int, sequences: int, length: int, seed: int) -> list[list[tuple]]:
    """Every rank's micro-batches of one step: (inputs, targets), each sequence of a random length from 1 to
    ``length``, the rest padding (target PAD)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    step = []
    for _ in range(world):
        mine = []
        for _ in range(micro):
            x = torch.randn(sequences, length, 6, generator=generator)
            y = torch.randint(5, (sequences, length), generator=generator)
            real = torch.randint(1, length + 1, (sequences, 1), generator=generator)
            mine.append((x, y.masked_fill(torch.arange(length) >= real, PAD)))
        step.append(mine)
    return step


def _tokens(targets: torch.Tensor) -> int:
    return int((targets != PAD).sum())


def _weighted_gradient(model: nn.Module, step, weight) -> dict[str, torch.Tensor]:
    """The gradient of sum over ranks r and micro-batches m of weight(r, m) * (the micro-batch's summed loss)."""
    model = copy.deepcopy(model)
    total = 0.0
    for r, mine in enumerate(step):
        for m, (x, y) in enumerate(mine):
            summed = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=PAD, reduction="sum")
            total = total + weight(r, m) * summed
    total.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _mistaken_gradients(model: nn.Module, step, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """What each typical normalisation leaves in the gradients after DDP's average over the N ranks."""
    n, k = len(step), len(step[0])
    counts = [[_tokens(y) for _, y in mine] for mine in step]
    everything = sum(map(sum, counts))
    return {
        "mean_of_micro_means": _weighted_gradient(model, step, lambda r, m: 1 / (n * k * counts[r][m])),
        "local_tokens_only": _weighted_gradient(model, step, lambda r, m: 1 / (n * sum(counts[r]))),
        "ddp_average_forgotten": _weighted_gradient(model, step, lambda r, m: 1 / (n * everything)),
        "never_synced": _weighted_gradient(model, step, lambda r, m: (r == rank) * n / everything),
    }


def _gradient_all_reduces(counted: TrafficCounter, model: nn.Module) -> int:
    """How many times DDP all-reduced the whole gradient: the all-reduced bytes in gradient-sized units (a token
    count's all-reduce is a few bytes)."""
    n = counted.world_size
    gradient = 2 * (n - 1) / n * sum(p.numel() * p.element_size() for p in model.parameters())
    return round(counted.bytes_sent.get("all_reduce", 0.0) / gradient)


def _describe(step, rank: int) -> str:
    counts = [[_tokens(y) for _, y in mine] for mine in step]
    said = "; ".join(f"rank {r}: " + " + ".join(map(str, c)) for r, c in enumerate(counts))
    return f"tokens per micro-batch {said} (rank {rank} is this one)"


def token_weighted_trial(t: Trial, fn) -> None:
    n = t.world_size
    for micro, sequences, length, seed in CASES:
        with t.case(f"{micro} micro-batches of {sequences} sequence(s) padded to {length}, seed {seed}"):
            plain = per_token_model(seed)
            step = step_batches(n, micro, sequences, length, seed)
            x, y = (torch.cat(parts) for parts in zip(*(batch for mine in step for batch in mine)))
            whole = _weighted_gradient(plain, [[(x, y)]], lambda r, m: 1 / _tokens(y))  # one process, every token
            model = DDP(copy.deepcopy(plain).to(t.device))
            mine = [(a.to(t.device), b.to(t.device)) for a, b in step[t.rank]]
            with TrafficCounter(n) as counted:
                t.call(fn, model, mine)
            syncs = _gradient_all_reduces(counted, plain)
            wrong = _mistaken_gradients(plain, step, t.rank)
            for name, p in model.module.named_parameters():
                what = f"gradient of {name}"
                if p.grad is None:
                    t.fail(what, "it is None: run forward and backward on every micro-batch", "no_backward")
                got = p.grad.detach().cpu()
                if n > 1 and syncs == 0 and _close(got, wrong["never_synced"][name]):
                    t.fail(what, "it is this rank's own: DDP all-reduced no gradient", "never_synced")
                for mistake, it_is in _looks_like(n).items():
                    if _close(got, wrong[mistake][name]) and not _close(got, whole[name]):
                        t.fail(what, f"it is {it_is}; {_describe(step, t.rank)}", mistake)
                t.expect_close(got, whole[name], what)
            if syncs > 1:
                said = f"the gradients were all-reduced {syncs} times in {micro} micro-steps; once is enough"
                t.fail("number of gradient all-reduces", said, "synced_every_micro_step")
    t.note(
        "one gradient all-reduce a step, and the loss divided by the step's tokens on every rank: the gradient "
        "one process gets on the whole batch, whatever the lengths."
    )


def _looks_like(n: int) -> dict[str, str]:
    """What each normalisation mistake's gradient is, in words."""
    return {
        "mean_of_micro_means": "the gradient of the mean over micro-batches of each one's mean loss",
        "local_tokens_only": "the average over ranks of each rank's mean loss over its own tokens",
        "ddp_average_forgotten": f"the whole batch's gradient divided by {n}",
    }


def _close(got: torch.Tensor, wrong: torch.Tensor) -> bool:
    return got.shape == wrong.shape and torch.allclose(got.double(), wrong.double(), atol=1e-6, rtol=1e-4)


MISTAKES = {
    "mean_of_micro_means": "each micro-batch's mean loss divided by the number of micro-batches weighs a token of "
    "a short micro-batch more than one of a long micro-batch. Sum the token losses (reduction='sum') and divide by "
    "the tokens of the whole step, counted on every rank: (L1 + L2 + ...) / (n1 + n2 + ...).",
    "local_tokens_only": "you divided by this rank's own tokens. DDP then averages the ranks' means, which weighs a "
    "token of a rank with few tokens more: all-reduce the token count, and divide by the step's tokens on every rank.",
    "ddp_average_forgotten": "the gradient is 1/N of the right one. DDP's all-reduce averages over the N ranks, "
    "dividing the sum by N once more: multiply the loss by dist.get_world_size() before backward.",
    "never_synced": "no gradient was all-reduced, so each rank kept its own. Skip the synchronisation on every "
    "micro-step but the last: model.no_sync() (or require_backward_grad_sync = False) only before the last.",
    "synced_every_micro_step": "the gradients are right, but DDP all-reduced them after every micro-step. Run every "
    "micro-step but the last inside model.no_sync() (or set model.require_backward_grad_sync = (micro == last)).",
    "no_backward": "a parameter has no gradient: call backward on every micro-batch's loss.",
}

EXERCISES = (
    Exercise(
        name="token_weighted_accumulation",
        page="practice",
        task="`model` is a per-token classifier wrapped in torch DDP; `micro_batches` are this rank's (inputs, "
        "targets) of one optimizer step, targets -100 at padding. Run forward and backward on each so that every "
        "gradient is that of the whole step's mean cross-entropy per token, over every micro-batch of every rank, "
        "with DDP all-reducing the gradients once.",
        signature="def token_weighted_accumulation(model, micro_batches) -> None:",
        solution="accumulation.token_weighted_accumulation",
        library="distlab.parallel.accumulation.token_weighted_micro_steps",
        trial=token_weighted_trial,
        ranks=2,
        min_ranks=2,
        min_ranks_why="one rank has no other rank's tokens to weigh",
        mistakes=MISTAKES,
    ),
)
