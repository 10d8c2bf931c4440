"""The fp16 chapter's answer: one loss-scaled optimizer step on a rank that holds a shard of the gradients, as
torch's ShardedGradScaler takes it (scale, unscale, an inf found on any rank skips the step on every rank, back off
or grow the scale).

Written for reading: one scale for the whole model, the factors torch uses by default (halve after a skip, double
after ``growth_interval`` clean steps). :class:`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` does
the same for every optimizer, device and dtype.
"""

import torch
import torch.distributed as dist


def loss_scaled_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: dict) -> None:
    scale = scaler["scale"]
    (loss * scale).backward()  # every gradient scale times larger: small ones stay above fp16's smallest
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    found_inf = torch.zeros(1, device=grads[0].device)
    for grad in grads:
        grad /= scale  # unscale before the step (and before any clipping)
        found_inf += (~torch.isfinite(grad)).any()
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # an inf in any rank's shard is every rank's inf
    if found_inf.item() > 0:  # skip the step on every rank, try a smaller scale
        scaler["scale"] = scale * 0.5
        scaler["clean_steps"] = 0
        return
    optimizer.step()
    scaler["clean_steps"] += 1
    if scaler["clean_steps"] == scaler["growth_interval"]:  # long enough without an inf: try a larger scale
        scaler["scale"] = scale * 2.0
        scaler["clean_steps"] = 0
