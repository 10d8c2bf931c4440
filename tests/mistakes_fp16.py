"""Typical wrong answers to the fp16 chapter's exercise, each with the mistake its check must name."""

import torch
import torch.distributed as dist


def _unscaled_grads(loss, optimizer, scale, multiply=True):
    (loss * scale if multiply else loss).backward()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for grad in grads:
        grad /= scale
    return grads


def _back_off_or_grow(scaler, found_inf, optimizer, halve=True):
    if found_inf:
        scaler["scale"] *= 0.5 if halve else 1.0
        scaler["clean_steps"] = 0
        return
    optimizer.step()
    scaler["clean_steps"] += 1
    if scaler["clean_steps"] == scaler["growth_interval"]:
        scaler["scale"] *= 2.0
        scaler["clean_steps"] = 0


def step_with_local_found_inf(loss, optimizer, scaler):
    grads = _unscaled_grads(loss, optimizer, scaler["scale"])
    found_inf = any(not torch.isfinite(g).all() for g in grads)  # this rank's shard only
    _back_off_or_grow(scaler, found_inf, optimizer)


def step_without_inf_check(loss, optimizer, scaler):
    _unscaled_grads(loss, optimizer, scaler["scale"])
    _back_off_or_grow(scaler, False, optimizer)


def step_with_scaled_gradients(loss, optimizer, scaler):
    (loss * scaler["scale"]).backward()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    found_inf = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    _back_off_or_grow(scaler, found_inf.item() > 0, optimizer)


def step_that_never_backs_off(loss, optimizer, scaler):
    grads = _unscaled_grads(loss, optimizer, scaler["scale"])
    found_inf = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    _back_off_or_grow(scaler, found_inf.item() > 0, optimizer, halve=False)


def step_with_unscaled_loss(loss, optimizer, scaler):
    grads = _unscaled_grads(loss, optimizer, scaler["scale"], multiply=False)
    found_inf = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    _back_off_or_grow(scaler, found_inf.item() > 0, optimizer)


def step_that_keeps_counting_after_a_skip(loss, optimizer, scaler):
    grads = _unscaled_grads(loss, optimizer, scaler["scale"])
    found_inf = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    if found_inf.item():
        scaler["scale"] *= 0.5  # the count of clean steps is left where it was
        return
    optimizer.step()
    scaler["clean_steps"] += 1
    if scaler["clean_steps"] >= scaler["growth_interval"]:
        scaler["scale"] *= 2.0
        scaler["clean_steps"] = 0


MISTAKES = [
    ("loss_scaled_step", step_with_local_found_inf, "local_found_inf", "while rank 1's shard held an inf"),
    ("loss_scaled_step", step_without_inf_check, "stepped_on_inf", "the optimizer stepped with this rank's inf"),
    ("loss_scaled_step", step_with_scaled_gradients, "not_unscaled", "it moved 16,384 times too far"),
    ("loss_scaled_step", step_that_never_backs_off, "scale_not_backed_off", "it stayed 32,768 after a skipped step"),
    ("loss_scaled_step", step_with_unscaled_loss, "loss_not_scaled", "32,768 times too little"),
    ("loss_scaled_step", step_that_keeps_counting_after_a_skip, "count_not_restarted", "after a skipped step"),
]
