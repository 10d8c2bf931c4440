"""Typical wrong answers to the ZeRO chapter's exercises, each with the mistake its check must name."""

import torch
import torch.distributed as dist

from distlab.parallel.flat_param import _single_tensor_collectives, all_gather_flat, reduce_scatter_flat

CACHE = []


def zero1_steps_whole_buffer(flat_params, flat_grad, momentum, lr, beta):
    if momentum is None:
        momentum = torch.zeros_like(flat_params)
    momentum = beta * momentum + flat_grad
    flat_params -= lr * momentum
    return momentum


def zero1_ring_shard(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice((rank + 1) % n * size, ((rank + 1) % n + 1) * size)
    momentum = flat_grad[mine] if momentum is None else beta * momentum + flat_grad[mine]
    flat_params.copy_(all_gather_flat(flat_params[mine] - lr * momentum, flat_params.numel()))
    return momentum


def zero1_without_all_gather(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    momentum = flat_grad[mine] if momentum is None else beta * momentum + flat_grad[mine]
    flat_params[mine] -= lr * momentum
    return momentum


def zero1_new_tensor(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    momentum = flat_grad[mine] if momentum is None else beta * momentum + flat_grad[mine]
    flat_params = all_gather_flat(flat_params[mine] - lr * momentum, flat_params.numel())
    return momentum


def zero1_all_reduces_zeroed_buffer(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    momentum = flat_grad[mine] if momentum is None else beta * momentum + flat_grad[mine]
    stepped = flat_params[mine] - lr * momentum
    flat_params.zero_()  # the other shards arrive by the sum: right values, twice the all-gather's bytes
    flat_params[mine] = stepped
    dist.all_reduce(flat_params)
    return momentum


def shard_summed(grad):
    n = dist.get_world_size()
    size = -(-grad.numel() // n)
    flat = torch.zeros(size * n)
    flat[: grad.numel()] = grad
    return reduce_scatter_flat(flat, size)


def shard_ring_offset(grad):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = -(-grad.numel() // n)
    flat = torch.zeros(size * n)
    flat[: grad.numel()] = grad / n
    dist.all_reduce(flat)
    segment = (rank + 1) % n
    return flat[segment * size : (segment + 1) * size].clone()


def shard_whole_all_reduced(grad):
    grad = grad / dist.get_world_size()
    dist.all_reduce(grad)
    return grad


def shard_no_padding(grad):
    n = dist.get_world_size()
    return reduce_scatter_flat(grad / n, grad.numel() // n)


def shard_by_all_reduce(grad):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = -(-grad.numel() // n)
    flat = torch.zeros(size * n)
    flat[: grad.numel()] = grad / n
    dist.all_reduce(flat)
    return flat[rank * size : (rank + 1) * size].clone()


def shard_into_whole_buffer(grad):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = -(-grad.numel() // n)
    flat = torch.zeros(size * n)
    flat[: grad.numel()] = grad / n
    out = torch.zeros(size * n)
    _single_tensor_collectives()[1](out[rank * size : (rank + 1) * size], flat)
    return out[rank * size : (rank + 1) * size]


def unit_keeps_gathered(shard, loss_fn):
    n = dist.get_world_size()
    full = all_gather_flat(shard, shard.numel() * n).requires_grad_(True)
    CACHE.append(full)  # "saves gathering it again next time"
    loss_fn(full).backward()
    return reduce_scatter_flat(full.grad / n, shard.numel())


def unit_summed(shard, loss_fn):
    full = all_gather_flat(shard, shard.numel() * dist.get_world_size()).requires_grad_(True)
    loss_fn(full).backward()
    return reduce_scatter_flat(full.grad, shard.numel())


def unit_on_its_shard(shard, loss_fn):
    shard = shard.clone().requires_grad_(True)
    loss_fn(shard).backward()
    return shard.grad / dist.get_world_size()


def unit_returns_view_of_whole_gradient(shard, loss_fn):
    rank, n = dist.get_rank(), dist.get_world_size()
    full = all_gather_flat(shard, shard.numel() * n).requires_grad_(True)
    loss_fn(full).backward()
    grad = full.grad / n
    out = torch.zeros_like(grad)
    mine = out[rank * shard.numel() : (rank + 1) * shard.numel()]
    _single_tensor_collectives()[1](mine, grad)
    return mine


def unit_all_reduced(shard, loss_fn):
    full = all_gather_flat(shard, shard.numel() * dist.get_world_size()).requires_grad_(True)
    loss_fn(full).backward()
    grad = full.grad / dist.get_world_size()
    dist.all_reduce(grad)
    return grad


def _bytes(num_params, strategy, world_size, precision, per_value, divides, padded=True, counter=4):
    shard = -(-num_params // world_size) if padded else num_params / world_size
    whole = num_params if strategy == "ddp" or not padded else shard * world_size
    return {
        term: per_value[i] * (shard if term in divides[strategy] else whole) + (counter if i == 2 else 0)
        for i, term in enumerate(("parameters", "gradients", "optimizer_state"))
    }


STAGES = {
    "ddp": (),
    "zero1": ("optimizer_state",),
    "zero2": ("gradients", "optimizer_state"),
    "zero3": ("parameters", "gradients", "optimizer_state"),
}


def bytes_no_master_copy(num_params, strategy, world_size, precision):
    per_value = (4, 4, 8) if precision == "fp32" else (2, 2, 8)
    return _bytes(num_params, strategy, world_size, precision, per_value, STAGES)


def bytes_zero1_shards_everything(num_params, strategy, world_size, precision):
    per_value = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    stages = {**STAGES, "zero1": STAGES["zero3"]}
    return _bytes(num_params, strategy, world_size, precision, per_value, stages)


def bytes_zero2_divides_parameters(num_params, strategy, world_size, precision):
    per_value = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    stages = {**STAGES, "zero2": ("parameters", "optimizer_state")}
    return _bytes(num_params, strategy, world_size, precision, per_value, stages)


def bytes_without_padding(num_params, strategy, world_size, precision):
    per_value = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    return _bytes(num_params, strategy, world_size, precision, per_value, STAGES, padded=False)


def bytes_without_step_counter(num_params, strategy, world_size, precision):
    per_value = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    return _bytes(num_params, strategy, world_size, precision, per_value, STAGES, counter=0)


# The answers a fourth review wrote and graded (Z1-Z6): each wrong one must be named for what it did


def zero1_divides_again(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    momentum = (torch.zeros(size) if momentum is None else momentum) * beta + flat_grad[mine] / n
    flat_params.copy_(all_gather_flat(flat_params[mine] - lr * momentum, flat_params.numel()))
    return momentum


def zero1_reduce_scatters_again(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    summed = reduce_scatter_flat(flat_grad.clone(), size)
    momentum = (torch.zeros(size) if momentum is None else momentum) * beta + summed
    flat_params.copy_(all_gather_flat(flat_params[mine] - lr * momentum, flat_params.numel()))
    return momentum


def zero1_broadcast_from_owners(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    momentum = (torch.zeros(size) if momentum is None else momentum) * beta + flat_grad[mine]
    flat_params[mine] -= lr * momentum
    for owner in range(n):
        dist.broadcast(flat_params[owner * size : (owner + 1) * size], src=owner)
    return momentum


def zero1_momentum_late(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    momentum = torch.zeros(size) if momentum is None else momentum
    stepped = flat_params[mine] - lr * (beta * momentum)
    momentum = beta * momentum + flat_grad[mine]
    flat_params.copy_(all_gather_flat(stepped, flat_params.numel()))
    return momentum


def zero1_gathers_before_stepping(flat_params, flat_grad, momentum, lr, beta):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    momentum = (torch.zeros(size) if momentum is None else momentum) * beta + flat_grad[mine]
    flat_params.copy_(all_gather_flat(flat_params[mine].clone(), flat_params.numel()))
    return momentum


def unit_autograd_all_gather(shard, loss_fn):
    import torch.distributed.nn.functional as dnn

    leaf = shard.detach().requires_grad_(True)
    loss_fn(torch.cat(dnn.all_gather(leaf))).backward()
    return leaf.grad / dist.get_world_size()


def unit_all_reduce_then_clone(shard, loss_fn):
    rank, n = dist.get_rank(), dist.get_world_size()
    full = all_gather_flat(shard, shard.numel() * n).requires_grad_(True)
    loss_fn(full).backward()
    grad = full.grad / n
    dist.all_reduce(grad)
    return grad[rank * shard.numel() : (rank + 1) * shard.numel()].clone()


# The answers a fifth review wrote and graded (its section 4: W9-W12 and W18 wrong, W10 and V4 right)


def zero1_ema_momentum(flat_params, flat_grad, momentum, lr, beta):  # W9: Adam's first moment, not SGD's momentum
    rank, n = dist.get_rank(), dist.get_world_size()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    momentum = torch.zeros(size) if momentum is None else momentum
    momentum = beta * momentum + (1 - beta) * flat_grad[mine]
    flat_params.copy_(all_gather_flat(flat_params[mine] - lr * momentum, flat_params.numel()))
    return momentum


def shard_divides_callers_grad(grad):  # W10: divides the caller's tensor in place, as the library does
    n = dist.get_world_size()
    grad /= n
    size = -(-grad.numel() // n)
    flat = torch.zeros(size * n)
    flat[: grad.numel()] = grad
    return reduce_scatter_flat(flat, size)


def unit_frees_data_after_forward(shard, loss_fn):  # W11: "ZeRO-3 frees the parameter after forward"
    n = dist.get_world_size()
    full = all_gather_flat(shard, shard.numel() * n).requires_grad_(True)
    loss = loss_fn(full)
    full.data = torch.empty(0)
    loss.backward()
    return reduce_scatter_flat(full.grad / n, shard.numel())


def unit_frees_storage_after_forward(shard, loss_fn):  # W11b: as ShardedUnit.free does, never gathered again
    n = dist.get_world_size()
    full = all_gather_flat(shard, shard.numel() * n).requires_grad_(True)
    loss = loss_fn(full)
    full.untyped_storage().resize_(0)
    loss.backward()
    return reduce_scatter_flat(full.grad / n, shard.numel())


def unit_gathered_without_grad(shard, loss_fn):  # W12: requires_grad_ forgotten on the gathered buffer
    n = dist.get_world_size()
    full = all_gather_flat(shard, shard.numel() * n)
    loss_fn(full).backward()
    return reduce_scatter_flat(full.grad / n, shard.numel())


def unit_list_collectives(shard, loss_fn):  # V4: the list forms of the two collectives
    n = dist.get_world_size()
    pieces = [torch.empty_like(shard) for _ in range(n)]
    dist.all_gather(pieces, shard)
    full = torch.cat(pieces).requires_grad_(True)
    loss_fn(full).backward()
    out = torch.empty_like(shard)
    dist.reduce_scatter(out, list((full.grad / n).chunk(n)))
    return out


def unit_frees_then_gathers_again(shard, loss_fn):  # right: freed after forward, gathered again in place
    n = dist.get_world_size()
    full = all_gather_flat(shard, shard.numel() * n).requires_grad_(True)
    loss = loss_fn(full)
    full.untyped_storage().resize_(0)  # what ShardedUnit.free does after forward
    full.untyped_storage().resize_(shard.numel() * n * full.element_size())  # and its pre-backward hook, before
    dist.all_gather_into_tensor(full.detach(), shard)
    loss.backward()
    return reduce_scatter_flat(full.grad / n, shard.numel())


def bytes_zero1_shards_everything_without_counter(num_params, strategy, world_size, precision):
    per_value = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    stages = {**STAGES, "zero1": STAGES["zero3"]}
    return _bytes(num_params, strategy, world_size, precision, per_value, stages, counter=0)


def bytes_stage_table(num_params, strategy, world_size, precision):  # W18: the page's table, Ψ/N exactly
    per_value = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    return {
        term: per_value[i] * (num_params / world_size if term in STAGES[strategy] else num_params)
        for i, term in enumerate(("parameters", "gradients", "optimizer_state"))
    }


# Right answers written otherwise than the course's: each must pass (tests/test_grader_names.py)
ALTERNATIVES = [
    ("zero1_step", zero1_broadcast_from_owners),
    ("zero3_unit", unit_autograd_all_gather),
    ("zero2_shard_gradient", shard_divides_callers_grad),
    ("zero3_unit", unit_list_collectives),
    ("zero3_unit", unit_frees_then_gathers_again),
    ("zero_bytes_per_rank", bytes_without_step_counter),  # the stage table, padded: passes with a note (H9)
]


MISTAKES = [
    ("zero1_step", zero1_steps_whole_buffer, "state_not_sharded", "keeps the momentum of its own shard only"),
    ("zero1_step", zero1_ring_shard, "wrong_shard", "it is shard 1's"),
    ("zero1_step", zero1_without_all_gather, "no_all_gather", "still hold the values before the step"),
    ("zero1_step", zero1_new_tensor, "not_in_place", "its own shard 0"),
    ("zero1_step", zero1_all_reduces_zeroed_buffer, "all_reduced", "2(n-1)/n = 1.33 times the buffer's bytes"),
    ("zero1_step", zero1_divides_again, "divided_again", "divided by 3: flat_grad was divided by 3 once more"),
    ("zero1_step", zero1_reduce_scatters_again, "summed_again", "3 times this shard's momentum: a reduce-scatter"),
    ("zero1_step", zero1_momentum_late, "momentum_late", "did not move at step 1 and moved by lr * beta * m at step 2"),
    ("zero1_step", zero1_gathers_before_stepping, "not_stepped", "flat_params was written at each step"),
    ("zero3_unit", unit_all_reduce_then_clone, "all_reduced", "it called dist.all_reduce"),
    ("zero2_shard_gradient", shard_summed, "summed", "the sum over the 3 ranks"),
    ("zero2_shard_gradient", shard_ring_offset, "wrong_shard", "it is shard 1"),
    ("zero2_shard_gradient", shard_whole_all_reduced, "whole_gradient", "it holds 11 values, the whole gradient's"),
    ("zero2_shard_gradient", shard_no_padding, "no_padding", "pad the flat buffer with zeros"),
    ("zero2_shard_gradient", shard_by_all_reduce, "all_reduced", "it called dist.all_reduce"),
    ("zero2_shard_gradient", shard_into_whole_buffer, "gradient_kept", "a view of a buffer of 12 values"),
    ("zero3_unit", unit_keeps_gathered, "gathered_kept", "still alive after your function returned"),
    ("zero3_unit", unit_summed, "summed", "the sum over the 3 ranks"),
    ("zero3_unit", unit_on_its_shard, "not_gathered", "loss_fn takes the unit's whole flat parameter"),
    ("zero3_unit", unit_returns_view_of_whole_gradient, "gradient_kept", "a view of a buffer of 12 values"),
    ("zero3_unit", unit_all_reduced, "whole_gradient", "the whole gradient's"),
    ("zero_bytes_per_rank", bytes_no_master_copy, "no_master_copy", "optimizer_state at Ψ=1,000,000, N=1"),
    ("zero_bytes_per_rank", bytes_zero1_shards_everything, "sharded_too_early", "case 'zero1, fp32'"),
    ("zero_bytes_per_rank", bytes_zero2_divides_parameters, "zero2_wrong_term", "parameters at Ψ=1,000,000, N=3"),
    ("zero_bytes_per_rank", bytes_without_padding, "no_padding", "ceil(Ψ/N)·N = 1,000,002 values"),
    ("zero1_step", zero1_ema_momentum, "ema_momentum", "(1 - beta) = 0.1 times this shard's momentum"),
    ("zero3_unit", unit_frees_data_after_forward, "freed_before_backward", "holds 0 of its 12 values when backward"),
    ("zero3_unit", unit_frees_storage_after_forward, "freed_before_backward", "holds 0 of its 12 values when"),
    ("zero3_unit", unit_gathered_without_grad, "gathered_without_grad", "does not require grad"),
    ("zero_bytes_per_rank", bytes_zero1_shards_everything_without_counter, "sharded_too_early", "case 'zero1, fp32'"),
    ("zero_bytes_per_rank", bytes_stage_table, "no_padding", "4,000,000 bytes, expected 4,000,008"),
]
