"""The practice chapter's answer on accumulation: the micro-steps of one optimizer step under torch DDP, the loss
divided by the whole step's tokens, and one gradient all-reduce. The library's version, for any strategy's
``no_sync``, is :func:`distlab.parallel.accumulation.token_weighted_micro_steps`.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def token_weighted_accumulation(model, micro_batches) -> None:
    device = micro_batches[0][1].device  # where the batches are: a plain NCCL group reduces only CUDA tensors
    tokens = torch.tensor(float(sum(int((y != -100).sum()) for _, y in micro_batches)), device=device)
    dist.all_reduce(tokens)  # the step's tokens: every micro-batch, every rank
    scale = dist.get_world_size() / tokens  # DDP divides the sum over ranks by N: multiply by N first
    last = len(micro_batches) - 1
    for micro, (x, y) in enumerate(micro_batches):
        model.require_backward_grad_sync = micro == last  # nanoGPT's idiom: what model.no_sync() switches off
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        (loss * scale).backward()
