"""Typical wrong answers to the DDP chapter's exercises, each with the mistake its check must name."""

import torch
import torch.distributed as dist


def average_forgets_to_divide(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def average_trips_on_frozen(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def average_on_rank_zero_only(model):
    if dist.get_rank() == 0:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


def average_the_parameters(model):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


def average_a_copy(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad / dist.get_world_size())


def overlap_after_backward(model):
    def finish():
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()

    return finish


def overlap_blocking(model):
    def reduce_now(p):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(reduce_now)
    return lambda: None


def overlap_hooks_frozen(model):
    pending = []

    def launch(p):
        p.grad /= dist.get_world_size()
        pending.append(dist.all_reduce(p.grad, async_op=True))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(launch)

    def finish():
        for work in pending:
            work.wait()

    return finish


def overlap_forgets_to_divide(model):
    pending = []

    def launch(p):
        pending.append(dist.all_reduce(p.grad, async_op=True))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        for work in pending:
            work.wait()
        pending.clear()

    return finish


def overlap_never_waits(model):
    def launch(p):
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad, async_op=True)

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)
    return lambda: None


def overlap_tensor_hook(model):
    pending = []

    def reduce_in_hook(grad):
        grad = grad / dist.get_world_size()
        pending.append(dist.all_reduce(grad, async_op=True))
        return grad

    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(reduce_in_hook)

    def finish():
        for work in pending:
            work.wait()
        pending.clear()

    return finish


def shard_ignores_rank(num_samples, world_size, rank, seed, epoch, drop_last):
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    return order[: num_samples // world_size]


def shard_without_padding(num_samples, world_size, rank, seed, epoch, drop_last):
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    return order[rank::world_size]


def shard_ignores_epoch(num_samples, world_size, rank, seed, epoch, drop_last):
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    per_rank = num_samples // world_size if drop_last else -(-num_samples // world_size)
    order = torch.cat([order, order[: per_rank * world_size - num_samples]])
    return order[: per_rank * world_size][rank::world_size]


def shard_with_global_rng(num_samples, world_size, rank, seed, epoch, drop_last):
    order = torch.randperm(num_samples)
    per_rank = num_samples // world_size if drop_last else -(-num_samples // world_size)
    order = torch.cat([order, order[: per_rank * world_size - num_samples]])
    return order[: per_rank * world_size][rank::world_size]


def shard_in_blocks(num_samples, world_size, rank, seed, epoch, drop_last):
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = num_samples // world_size if drop_last else -(-num_samples // world_size)
    order = torch.cat([order, order[: per_rank * world_size - num_samples]])
    return order[rank * per_rank : (rank + 1) * per_rank]


def shard_in_order(num_samples, world_size, rank, seed, epoch, drop_last):
    order = torch.arange(num_samples)
    per_rank = num_samples // world_size if drop_last else -(-num_samples // world_size)
    order = torch.cat([order, order[: per_rank * world_size - num_samples]])
    return order[: per_rank * world_size][rank::world_size]


# The answers a fourth review wrote and graded (D1-D5): each must be named for what it did


def average_twice(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            p.grad /= dist.get_world_size()


def average_a_bucket_never_copied_back(model):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


def overlap_divides_while_in_flight(model):
    n, pending = dist.get_world_size(), []

    def launch(p):
        pending.append(dist.all_reduce(p.grad, async_op=True))
        p.grad /= n  # the all-reduce is still reading and writing p.grad

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        for work in pending:
            work.wait()
        pending.clear()

    return finish


def overlap_waits_for_the_previous(model):
    n, pending = dist.get_world_size(), []

    def launch(p):
        if pending:
            pending[-1].wait()  # "one at a time"
        p.grad /= n
        pending.append(dist.all_reduce(p.grad, async_op=True))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        for work in pending:
            work.wait()
        pending.clear()

    return finish


def overlap_finish_waits_on_a_copy(model):
    n, state = dist.get_world_size(), {"pending": []}

    def launch(p):
        p.grad /= n
        state["pending"].append(dist.all_reduce(p.grad, async_op=True))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)
    waiting = list(state["pending"])  # copied now, while it is still empty

    def finish():
        for work in waiting:
            work.wait()
        state["pending"].clear()

    return finish


# Right answers written otherwise than the course's: each must pass (tests/test_grader_names.py)


def average_with_the_avg_op(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def overlap_divides_after_the_wait(model):
    n, pending = dist.get_world_size(), []

    def launch(p):
        pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        for p, work in pending:
            work.wait()
            p.grad /= n
        pending.clear()

    return finish


# The answers a fifth review wrote and graded (its section 4: W4-W8 wrong; S1, V2 and V3 right)


def average_async_never_waited(model):  # W4
    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, async_op=True)
            p.grad /= n


def overlap_hook_closes_over_the_loop_variable(model):  # W5: every hook reduces the last parameter
    n = dist.get_world_size()
    handles = []
    for p in model.parameters():
        if p.requires_grad:

            def hook(_):
                p.grad /= n
                handles.append(dist.all_reduce(p.grad, async_op=True))

            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for handle in handles:
            handle.wait()
        handles.clear()

    return finish


def overlap_forgets_to_return_finish(model):  # W6
    n = dist.get_world_size()
    handles = []

    def hook(p):
        p.grad /= n
        handles.append(dist.all_reduce(p.grad, async_op=True))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for handle in handles:
            handle.wait()
        handles.clear()


def shard_pads_with_the_last_indices(num_samples, world_size, rank, seed, epoch, drop_last):  # W7
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    if drop_last:
        per_rank = num_samples // world_size
    else:
        per_rank = -(-num_samples // world_size)
        padding = per_rank * world_size - num_samples
        order = torch.cat([order, order[num_samples - padding :]])
    return order[: per_rank * world_size][rank::world_size]


def shard_ignores_drop_last(num_samples, world_size, rank, seed, epoch, drop_last):  # W8: always pads
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = -(-num_samples // world_size)
    order = torch.cat([order, order[: per_rank * world_size - num_samples]])
    return order[rank::world_size]


def average_one_value_at_a_time(model):  # S1: right, and slow: one all-reduce per value
    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            flat = p.grad.view(-1)
            for i in range(flat.numel()):
                dist.all_reduce(flat[i : i + 1])
            p.grad /= n


def average_one_flat_buffer(model):  # V2: one flat buffer, one all-reduce, copied back
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def shard_asks_the_sampler(num_samples, world_size, rank, seed, epoch, drop_last):  # V3
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(num_samples), world_size, rank, shuffle=True, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


ALTERNATIVES = [
    ("average_gradients", average_with_the_avg_op),
    ("overlap_gradients", overlap_divides_after_the_wait),
    ("average_gradients", average_one_value_at_a_time),
    ("average_gradients", average_one_flat_buffer),
    ("shard_indices", shard_asks_the_sampler),
]


MISTAKES = [
    ("average_gradients", average_forgets_to_divide, "summed", "3 times the average"),
    ("average_gradients", average_trips_on_frozen, "frozen_none_grad", "fc1.bias"),
    ("average_gradients", average_on_rank_zero_only, "collective_mismatch", "rank 1: none"),
    ("average_gradients", average_the_parameters, "averaged_parameters", "the frozen one included"),
    ("average_gradients", average_a_copy, "local_gradient", "own micro-batch gradient"),
    ("overlap_gradients", overlap_after_backward, "after_backward", "no all-reduce started during backward"),
    ("overlap_gradients", overlap_blocking, "blocking", "waited for inside a hook"),
    ("overlap_gradients", overlap_hooks_frozen, "hooked_frozen", "requires_grad=False"),
    ("overlap_gradients", overlap_forgets_to_divide, "summed", "the sum"),
    ("overlap_gradients", overlap_never_waits, "never_waited", "without waiting for 3 of the 3 all-reduces"),
    ("overlap_gradients", overlap_tensor_hook, "reduced_a_copy", "own micro-batch gradient divided by 3"),
    ("average_gradients", average_twice, "averaged_twice", "(3 all-reduce(s) with ReduceOp.AVG, then divided by 3)"),
    ("average_gradients", average_a_bucket_never_copied_back, "local_gradient", "1 all-reduce(s) summed other tensors"),
    ("overlap_gradients", overlap_divides_while_in_flight, "changed_in_flight", "changed in place after their"),
    ("overlap_gradients", overlap_waits_for_the_previous, "blocking", "2 of its 3 all-reduces returned"),
    ("overlap_gradients", overlap_finish_waits_on_a_copy, "never_waited", "without waiting for 3 of the 3"),
    ("shard_indices", shard_ignores_rank, "same_on_every_rank", "every rank got the same"),
    ("shard_indices", shard_without_padding, "uneven_shards", "rank 2 got 3"),
    ("shard_indices", shard_ignores_epoch, "epoch_ignored", "epoch 0 and epoch 1"),
    ("shard_indices", shard_with_global_rng, "overlap_or_missing", "is on ranks"),
    ("shard_indices", shard_in_blocks, "contiguous_blocks", "consecutive positions"),
    ("shard_indices", shard_in_order, "not_shuffled", "nothing was shuffled"),
    ("average_gradients", average_async_never_waited, "not_waited", "3 of the 3 all-reduces started with async_op"),
    ("overlap_gradients", overlap_hook_closes_over_the_loop_variable, "same_tensor", "all 3 all-reduces carried the"),
    ("overlap_gradients", overlap_forgets_to_return_finish, "no_finish", "it is NoneType"),
    ("shard_indices", shard_pads_with_the_last_indices, "wrong_padding", "the first 11 positions are the seeded"),
    ("shard_indices", shard_ignores_drop_last, "drop_last_ignored", "which the sampler leaves out with drop_last"),
]
