"""Gradient accumulation over micro-batches of unequal token counts, normalised by the whole step's tokens.

A step of k micro-batches on N ranks is one step on the large batch only if its loss is the large batch's: the
sum of every token's loss, on every micro-batch and every rank, divided by the number of those tokens,
(L1 + L2 + ...) / (n1 + n2 + ...). The mean of each micro-batch's mean, divided by k (nanoGPT's and
:func:`distlab.train.train_step`'s ``losses.mean() / accum``), is that only when every micro-batch holds as many
tokens; so is DDP's average over the ranks of each rank's own mean. The training loop's batches always do (every
sample is one label, or ``seq_len`` tokens with none masked, and the loader drops the last incomplete batch);
padded sequences of different lengths do not, and this is the loop for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100
"""The target of a padding position: ``F.cross_entropy``'s default ``ignore_index``, so it adds no loss."""


def token_weighted_micro_steps(
    model: nn.Module,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    no_sync: Callable[[], AbstractContextManager],
) -> torch.Tensor:
    """Forward and backward over this rank's ``micro_batches`` of one optimizer step, leaving in every gradient
    that of the step's mean loss per token over every micro-batch of every rank; returns this rank's share of
    that loss (the ranks' shares sum to it).

    ``micro_batches`` are (inputs, targets), targets :data:`IGNORE_INDEX` at padding. ``no_sync()`` keeps a
    backward's gradients on the rank (torch DDP's ``model.no_sync``; a strategy's ``lambda: strategy.no_sync(model)``,
    FSDP2's ``set_requires_gradient_sync(False)``): only the last micro-step synchronises. The one extra
    collective is an all-reduce of a single number, the step's tokens, before the first backward."""
    tokens = torch.tensor(  # on the batches' device: a plain NCCL group reduces only CUDA tensors
        sum(int((targets != IGNORE_INDEX).sum()) for _, targets in micro_batches),
        dtype=torch.float64,
        device=micro_batches[0][1].device,
    )
    dist.all_reduce(tokens)  # every micro-batch's tokens, on every rank
    # The synchronisation averages over the N ranks; times N, their mean of the sums is the sum.
    scale = dist.get_world_size() / tokens.item()
    share = torch.zeros((), dtype=torch.float64)
    last = len(micro_batches) - 1
    for micro, (inputs, targets) in enumerate(micro_batches):
        with nullcontext() if micro == last else no_sync():
            logits = model(inputs)
            summed = F.cross_entropy(
                logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            (summed * scale).backward()
        share += summed.detach().double().cpu() / tokens
    return share
