"""Typical wrong answers to the practice chapter's accumulation exercise, each with the mistake its check must name."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _token_losses(model, x, y, reduction):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction=reduction)


def mean_of_micro_means(model, micro_batches):  # nanoGPT's loss / accumulation_steps, right for equal counts only
    last = len(micro_batches) - 1
    for micro, (x, y) in enumerate(micro_batches):
        model.require_backward_grad_sync = micro == last
        (_token_losses(model, x, y, "mean") / len(micro_batches)).backward()


def local_tokens_only(model, micro_batches):  # the rank's own tokens: no all-reduce of the count
    tokens = sum(int((y != -100).sum()) for _, y in micro_batches)
    last = len(micro_batches) - 1
    for micro, (x, y) in enumerate(micro_batches):
        model.require_backward_grad_sync = micro == last
        (_token_losses(model, x, y, "sum") / tokens).backward()


def ddp_average_forgotten(model, micro_batches):  # the step's tokens, but DDP divides by N again
    tokens = torch.tensor(float(sum(int((y != -100).sum()) for _, y in micro_batches)))
    dist.all_reduce(tokens)
    last = len(micro_batches) - 1
    for micro, (x, y) in enumerate(micro_batches):
        model.require_backward_grad_sync = micro == last
        (_token_losses(model, x, y, "sum") / tokens).backward()


def synced_every_micro_step(model, micro_batches):  # right numbers, k all-reduces: no no_sync
    tokens = torch.tensor(float(sum(int((y != -100).sum()) for _, y in micro_batches)))
    dist.all_reduce(tokens)
    for x, y in micro_batches:
        (_token_losses(model, x, y, "sum") * dist.get_world_size() / tokens).backward()


def no_sync_on_every_micro_step(model, micro_batches):  # the last backward inside no_sync too
    tokens = torch.tensor(float(sum(int((y != -100).sum()) for _, y in micro_batches)))
    dist.all_reduce(tokens)
    with model.no_sync():
        for x, y in micro_batches:
            (_token_losses(model, x, y, "sum") * dist.get_world_size() / tokens).backward()


MISTAKES = [
    (
        "token_weighted_accumulation",
        mean_of_micro_means,
        "mean_of_micro_means",
        "mean over micro-batches of each one's mean loss; tokens per micro-batch rank 0: 8 + 11",
    ),
    (
        "token_weighted_accumulation",
        local_tokens_only,
        "local_tokens_only",
        "each rank's mean loss over its own tokens",
    ),
    (
        "token_weighted_accumulation",
        ddp_average_forgotten,
        "ddp_average_forgotten",
        "the whole batch's gradient divided by 2",
    ),
    ("token_weighted_accumulation", synced_every_micro_step, "synced_every_micro_step", "all-reduced 2 times in 2"),
    ("token_weighted_accumulation", no_sync_on_every_micro_step, "never_synced", "DDP all-reduced no gradient"),
]
