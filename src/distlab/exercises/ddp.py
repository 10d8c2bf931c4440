"""The DDP chapter's exercises: average the gradients after backward, overlap that with backward, and give
each rank its own slice of the data.

Every rank builds the same toy model (a frozen bias included) and every rank's micro-batch from seeded
generators, so each rank computes, alone, the gradient one process gets on the whole batch: the number DDP's
averaging must reproduce. The sampler's answer is ``torch.utils.data.DistributedSampler``'s, asked for every
rank's slice; the learner's function is pure there, so each rank also asks it for the other ranks' slices and
checks their union.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from ..models import ToyWithFrozen
from .catalog import Exercise
from .trial import Trial
from .verdict import ranks_said

COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor"}


def _setup(seed: int, samples: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The toy model every rank builds alike (rank 0's weights, as DDP's broadcast leaves them) and the
    global batch, from one generator."""
    generator = torch.Generator().manual_seed(seed)
    model = ToyWithFrozen()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / 2)
    x = torch.randn(samples, 11, generator=generator)
    y = torch.randint(5, (samples,), generator=generator)
    return model, x, y


def _gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters() if p.grad is not None}


def _all_reduces(t: Trial, since: int) -> list[dict]:
    return [c for c in t.tracer.calls[since:] if c["op"] == "all_reduce"]


def _like(got: torch.Tensor, wrong: torch.Tensor) -> bool:
    """``got`` is what a mistake gives, within the tolerance of the check itself: sums over ranks round apart from
    the one-process reference, most where a value nearly cancels (an absolute 1e-8 fails there)."""
    return got.shape == wrong.shape and torch.allclose(got.double(), wrong.double(), atol=1e-6, rtol=1e-4)


def _check_gradients(
    t: Trial, model, reference: dict, own: dict, since: int, before: dict | None = None, own_divided="local_gradient"
) -> None:
    """Every trainable gradient is the whole batch's; the frozen parameter still has none. ``own_divided`` names
    a gradient that is this rank's own divided by N: an all-reduce that summed some other tensor."""
    n = t.world_size
    for name, p in model.named_parameters():
        if before is not None and not torch.allclose(p.detach().cpu(), before[name], atol=1e-6, rtol=1e-5):
            ratio = (p.detach().cpu().abs().sum() / before[name].abs().sum()).item()
            t.fail(f"parameter {name}", f"it changed (now {ratio:.3g}x its size before your call); the "
                   "gradients should, not the weights", "averaged_parameters")  # fmt: skip
        what = f"gradient of {name}"
        if not p.requires_grad:
            if p.grad is not None:
                t.fail(f"gradient of the frozen {name}", "it is a tensor; it was None", "frozen_given_grad")
            continue
        if p.grad is None:
            t.fail(what, "it is None", "gradient_dropped")
        got = p.grad.detach().cpu()
        if n > 1 and _like(got, own[name]):
            every_parameter = [q.numel() * q.element_size() for q in model.parameters()]
            calls = _all_reduces(t, since)
            if [c.get("bytes") for c in calls] == every_parameter:
                t.fail(what, f"it is rank {t.rank}'s own gradient; the {len(calls)} all-reduces had the sizes of "
                       "every parameter, the frozen one included", "averaged_parameters")  # fmt: skip
            _own_gradient(t, model, what, calls, f"rank {t.rank}'s own micro-batch gradient", "local_gradient")
        if n > 1 and _like(got, own[name] / n):
            it_is = f"rank {t.rank}'s own micro-batch gradient divided by {n}"
            _own_gradient(t, model, what, _all_reduces(t, since), it_is, own_divided)
        if n > 1 and _like(got, n * reference[name]):
            t.fail(what, f"it is {n} times the average over the {n} ranks: the sum", "summed")
        if n > 1 and _like(got, reference[name] / n):
            averaging = [c for c in _all_reduces(t, since) if c.get("reduce_op") == "AVG"]
            how = f"{len(averaging)} all-reduce(s) with ReduceOp.AVG, then" if averaging else "averaged, then"
            t.fail(what, f"it is the average over the {n} ranks divided by {n} again ({how} divided by {n})",
                   "averaged_twice")  # fmt: skip
        t.expect_close(got, reference[name], what)


def _own_gradient(t: Trial, model, what: str, calls: list[dict], it_is: str, mistake: str) -> None:
    """A gradient still this rank's own: said "summed other tensors" only where the all-reduces' storages are
    not the gradients' own (a copy such as p.grad / n); else what the trace shows, unnamed."""
    grads = {q.grad.untyped_storage().data_ptr() for q in model.parameters() if q.grad is not None}
    if not calls:
        t.fail(what, f"it is {it_is}: no collective summed it", mistake)
    if any(c.get("storage") not in grads for c in calls):
        t.fail(what, f"it is {it_is}: its {len(calls)} all-reduce(s) summed other tensors", mistake)
    t.fail(what, f"it is {it_is}, though its {len(calls)} all-reduce(s) carried the gradients' own tensors", None)


GRADIENT_CASES = ((4, 11), (2, 12), (3, 13))
"""(samples per rank, seed)."""


def _waited(t: Trial, since: int) -> None:
    """Every all-reduce started with async_op=True was waited for before the function returned: whether it had
    finished by then cannot be read from the values (on an idle machine gloo often has)."""
    started = [c for c in _all_reduces(t, since) if c.get("watched")]
    unwaited = [c for c in started if not c.get("waited")]
    if unwaited:
        why = f"{len(unwaited)} of the {len(started)} all-reduces started with async_op=True were never waited for,"
        t.fail("handling of the async all-reduces", f"{why} so each gradient was divided and read while its "
               "all-reduce may still have been running", "not_waited")  # fmt: skip


def average_gradients_trial(t: Trial, fn) -> None:
    n, r = t.world_size, t.rank
    t.tracer.watch_waits = True  # an async all-reduce's wait is read from its handle
    for per_rank, seed in GRADIENT_CASES:
        with t.case(f"{per_rank} samples per rank"):
            model, x, y = _setup(seed, per_rank * n)
            reference = _gradients(copy.deepcopy(model), x, y)  # one process, the whole batch
            model.to(t.device)
            mine = slice(r * per_rank, (r + 1) * per_rank)
            own = _gradients(model, x[mine].to(t.device), y[mine].to(t.device))
            before = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
            since = len(t.tracer.calls)
            t.call(fn, model)
            _waited(t, since)
            _check_gradients(t, model, reference, own, since, before)
    calls = _all_reduces(t, since)
    t.note(f"{len(calls)} all-reduce(s) a step, {sum(c.get('bytes', 0) for c in calls)} bytes of gradients: "
           "NaiveDDP makes one per trainable parameter; BucketedDDP packs them into a few buckets.")  # fmt: skip


def overlap_gradients_trial(t: Trial, fn) -> None:
    n, r, per_rank = t.world_size, t.rank, 4
    model, x, y = _setup(21, 2 * per_rank * n)
    mine = [slice(step * per_rank * n + r * per_rank, step * per_rank * n + (r + 1) * per_rank) for step in (0, 1)]
    references = [_gradients(copy.deepcopy(model), x[k * per_rank * n : (k + 1) * per_rank * n],
                             y[k * per_rank * n : (k + 1) * per_rank * n]) for k in (0, 1)]  # fmt: skip
    owns = [_gradients(copy.deepcopy(model), x[s], y[s]) for s in mine]
    model.to(t.device)
    seen: dict[str, int] = {}  # all-reduces started when the last gradient of backward (fc1.weight's) arrived
    model.fc1.weight.register_post_accumulate_grad_hook(lambda p: seen.update(last=len(_all_reduces(t, seen["at"]))))
    t.tracer.watch_waits = True  # whether finish() waited is read from the handles: values alone race with gloo
    with t.case("registering the hooks"):
        finish = t.call(fn, model)
        if not callable(finish):
            t.fail("return value", f"it is {type(finish).__name__}, not the function that waits", "no_finish")
    for step in (0, 1):
        with t.case(f"step {step + 1}"):
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[mine[step]].to(t.device)), y[mine[step]].to(t.device))
            seen.update(at=len(t.tracer.calls), last=0)
            t.call(loss.backward)
            launched = _all_reduces(t, seen["at"])
            timing = "timing of the all-reduces"
            if not launched:
                t.fail(timing, "no all-reduce started during backward: nothing overlapped it", "after_backward")
            if not seen["last"]:
                t.fail(timing, "every all-reduce started after fc1.weight's gradient, the last of backward, was "
                       "ready: nothing overlapped backward", "after_backward")  # fmt: skip
            blocking = [c for c in launched if c["done"]]
            if blocking:
                t.fail(timing, f"{len(blocking)} of its {len(launched)} all-reduces returned before backward went "
                       "on: each was waited for inside a hook", "blocking")  # fmt: skip
            t.call(finish)
            started = _all_reduces(t, seen["at"])
            unwaited = [c for c in started if not c["done"] and not c.get("waited")]
            if unwaited:
                t.fail("finish()", f"it returned without waiting for {len(unwaited)} of the {len(started)} "
                       f"all-reduces started in backward: until each is waited for, its gradient may still be "
                       f"rank {r}'s own, divided by {n}", "never_waited")  # fmt: skip
            carried = Counter(c.get("storage") for c in started)
            if len(started) > 1 and max(carried.values()) > 1:
                said = f"all {len(started)} all-reduces" if len(carried) == 1 else \
                    f"{sum(k for k in carried.values() if k > 1)} of the {len(started)} all-reduces"  # fmt: skip
                t.fail("handling of p.grad", f"{said} carried the same tensor", "same_tensor")
            changed = [c for c in started if c.get("changed_in_flight")]
            if changed:
                why = (f"{len(changed)} of the {len(started)} gradients were changed in place after their all-reduce "
                       "started and before it was waited for: the all-reduce reads and writes p.grad meanwhile, so "
                       "what it ends with depends on timing")  # fmt: skip
                t.fail("handling of p.grad", why, "changed_in_flight")
            _check_gradients(t, model, references[step], owns[step], seen["at"], own_divided="reduced_a_copy")
    t.note(f"when fc1.weight's gradient, the last, arrived, {seen['last']} all-reduce(s) were already in flight.")


SHARD_CASES = ((11, 0, 0, False), (11, 0, 1, False), (11, 42, 3, True), (12, 7, 2, False))
"""(samples, seed, epoch, drop_last): 11 divides by none of 2, 3 and 4; 12 by all of them."""


def shard_trial(t: Trial, fn) -> None:
    n_ranks = t.world_size
    for samples, seed, epoch, drop_last in SHARD_CASES:
        with t.case(f"{samples} samples at epoch {epoch} of seed {seed}{' with drop_last' if drop_last else ''}"):
            args = (samples, n_ranks)

            def sampler(rank: int, epoch: int = epoch, shuffle: bool = True) -> list[int]:
                s = DistributedSampler(range(samples), n_ranks, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
                s.set_epoch(epoch)
                return list(s)

            def ask(rank: int, epoch: int = epoch) -> list[int]:
                got = t.call(fn, *args, rank, seed, epoch, drop_last)
                try:
                    return [int(i) for i in got]
                except (TypeError, ValueError):
                    t.fail(f"slice for rank {rank}", f"it returned {type(got).__name__}, not indices", "not_indices")

            expected = [sampler(rank) for rank in range(n_ranks)]
            got = [ask(rank) for rank in range(n_ranks)]
            order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            _diagnose_shards(t, got, expected, samples, sampler, ask, epoch)
            _diagnose_cover(t, got, expected, order, drop_last)
            t.expect_close(torch.tensor(got[t.rank]), torch.tensor(expected[t.rank]), "slice",
                           locate=lambda i: f"position {i}")  # fmt: skip
    t.note("every rank's slice is DistributedSampler's, and together they cover the dataset.")


def _diagnose_shards(t: Trial, got, expected, samples, sampler, ask, epoch) -> None:
    n = t.world_size
    sizes = [len(g) for g in got]
    if n > 1 and any(size == samples for size in sizes):
        t.fail("split of the dataset", f"a rank got all {samples} samples", "whole_dataset")
    if n > 1 and all(g == got[0] for g in got):
        t.fail(
            "split of the dataset", f"every rank got the same {sizes[0]} indices {got[0][:4]}...", "same_on_every_rank"
        )
    if len(set(sizes)) > 1:
        t.fail("split of the dataset", ", ".join(f"rank {r} got {s}" for r, s in enumerate(sizes)) + " samples",
               "uneven_shards")  # fmt: skip
    if got == [sampler(rank, shuffle=False) for rank in range(n)]:
        t.fail(
            "split of the dataset",
            f"rank r got r, r + {n}, r + {2 * n}, ... in order: nothing was shuffled",
            "not_shuffled",
        )
    if all(ask(rank, epoch + 1) == g for rank, g in enumerate(got)):
        t.fail("split of the dataset", f"epoch {epoch} and epoch {epoch + 1} gave the same slices", "epoch_ignored")
    permutation = _interleaved(expected)  # padded, or cut
    per_rank = sizes[0]
    if got != expected and all(g == permutation[r * per_rank : (r + 1) * per_rank] for r, g in enumerate(got)):
        t.fail("split of the dataset", f"rank {t.rank} got a block of {per_rank} consecutive positions of the "
               "permutation", "contiguous_blocks")  # fmt: skip


def _times(k: int) -> str:
    return {1: "once", 2: "twice"}.get(k, f"{k} times")


def _interleaved(slices: list[list[int]]) -> list[int]:
    """The order the ranks' equal slices were cut from: position k * n + r is rank r's k-th index."""
    n = len(slices)
    return [slices[k % n][k // n] for k in range(n * len(slices[0]))]


def _diagnose_cover(t: Trial, got, expected, order: list[int], drop_last: bool) -> None:
    """Together the slices hold each sample as often as the sampler's do, or the verdict says which samples
    differ and why: from the seeded ``order`` but padded otherwise, or padded where drop_last cuts; the global
    RNG's hint only where the slices are not cut from the seeded order."""
    have, want = Counter(i for g in got for i in g), Counter(i for g in expected for i in g)
    if have == want:
        return
    samples, mine, sampler = len(order), _interleaved(got), _interleaved(expected)
    owners = {i: [r for r, g in enumerate(got) if i in g] for i in have}
    dropped = ", which the sampler leaves out with drop_last" if drop_last else ""
    extra = [f"sample {i} is on {ranks_said(owners[i])}" + (dropped if not want[i] else "") +
             (f" ({have[i]} times; the sampler has it {want[i]})" if want[i] > 1 else "")
             for i in sorted(have) if have[i] > want[i]]  # fmt: skip
    never = [f"sample {i} is on no rank" if not have[i] else f"sample {i} is there {_times(have[i])}, not "
             f"{_times(want[i])}" for i in sorted(want) if have[i] < want[i]]  # fmt: skip
    said, mistake = "; ".join((extra + never)[:3]), "overlap_or_missing"
    seeded = mine[: min(samples, len(mine))] == order[: min(samples, len(mine))]
    if seeded and drop_last and len(mine) > len(sampler):
        said = f"each rank got {len(got[0])} indices, the sampler's {len(expected[0])}: {said}"
        mistake = "drop_last_ignored"
    elif seeded and not drop_last and len(mine) == len(sampler):
        said = (f"the first {samples} positions are the seeded permutation, but the padding is {mine[samples:]}, "
                f"where the sampler repeats the permutation's first {sampler[samples:]}: {said}")  # fmt: skip
        mistake = "wrong_padding"
    t.fail("split of the dataset", said, mistake)


SAMPLER_MISTAKES = {
    "whole_dataset": "a rank got the whole dataset. DistributedSampler gives each rank about 1/N of it: "
    "the positions rank, rank + N, rank + 2N, ... of one shuffled order.",
    "same_on_every_rank": "every rank got the same samples, so N ranks compute N copies of one gradient. "
    "Start at position `rank` and step by `world_size`: order[rank::world_size].",
    "uneven_shards": "the ranks got different numbers of samples. Each rank runs one backward (one all-reduce) "
    "per batch, so a rank with fewer batches leaves the others waiting. Pad the order with its first "
    "indices up to a multiple of N (drop_last=False), or cut it down to one (drop_last=True), before slicing.",
    "overlap_or_missing": "the slices overlap or leave samples out. Every rank must cut the same permutation: "
    "draw it with a torch.Generator seeded with seed + epoch, not the global RNG, which differs by rank.",
    "wrong_padding": "pad with the permutation's first indices: DistributedSampler repeats order[:padding] at the "
    "end, so that the ranks that get one sample more get the permutation's first ones again.",
    "drop_last_ignored": "with drop_last, cut the permutation to floor(N / world_size) * world_size indices instead "
    "of padding it: its last N % world_size samples go to no rank this epoch.",
    "epoch_ignored": "the order does not change with the epoch, as when sampler.set_epoch(epoch) is forgotten. "
    "DistributedSampler seeds its generator with seed + epoch.",
    "not_shuffled": "the order is not shuffled: draw torch.randperm(num_samples, generator=g) first.",
    "contiguous_blocks": "you cut the permutation into consecutive blocks: a valid split, but not "
    "DistributedSampler's, which strides: order[rank::world_size].",
    "not_indices": "return the indices, as a list or a 1-d tensor of integers.",
}
GRADIENT_MISTAKES = {
    "summed": "the gradients are the sum over ranks, N times the average: divide each by "
    "dist.get_world_size() after the all-reduce (all_reduce sums).",
    "local_gradient": "the gradients are still each rank's own. all_reduce works in place on the tensor you give "
    "it: pass p.grad itself, not a copy such as p.grad / n or p.grad.clone().",
    "averaged_parameters": "you reduced the parameters. DDP keeps the weights equal by averaging the gradients, "
    "so that every rank takes the same step: all-reduce p.grad, not p or p.data.",
    "frozen_given_grad": "a frozen parameter (requires_grad=False) got a gradient. Skip parameters whose .grad is "
    "None: DDP reduces only what trains.",
    "gradient_dropped": "a trainable parameter lost its gradient: leave .grad a tensor.",
    "not_waited": "you started the all-reduce with async_op=True and never waited: call .wait() on its handle "
    "before dividing, or leave async_op off.",
    "averaged_twice": "you divided by N twice. dist.ReduceOp.AVG already divides the sum by N (so does dividing "
    "p.grad before a summing all-reduce): divide once.",
    "frozen_none_grad": "a parameter with requires_grad=False (here fc1.bias) has .grad None after backward. "
    "Skip it: `if p.grad is None: continue`.",
}


def _frozen_none(failure: dict) -> str | None:
    text = f"{failure['message']} {failure.get('code') or ''}"
    if "NoneType" in text or "Expected parameter `tensor`" in text:
        return "frozen_none_grad"
    if "doesn't require gradient" in text:
        return "hooked_frozen"
    return None


EXERCISES = (
    Exercise(
        name="average_gradients",
        page="ddp",
        task="After each rank's backward on its own micro-batch, make every gradient the average over the ranks: "
        "all-reduce each parameter's .grad, divide by the world size, and skip parameters that have no gradient.",
        signature="def average_gradients(model: torch.nn.Module) -> None:",
        solution="ddp.average_gradients",
        library="distlab.parallel.mini_ddp.NaiveDDP.finish_gradient_sync",
        trial=average_gradients_trial,
        mistakes=GRADIENT_MISTAKES,
        on_error=_frozen_none,
        pages=("labs/lab_ddp_mnist",),
    ),
    Exercise(
        name="overlap_gradients",
        page="ddp",
        task="Register a hook on every trainable parameter that, as soon as its gradient is ready during backward, "
        "divides it by the world size and starts its all-reduce with async_op=True; return a function `finish()` "
        "that waits for every all-reduce started (call it after backward, before the optimizer step).",
        signature="def overlap_gradients(model: torch.nn.Module):",
        solution="ddp.overlap_gradients",
        library="distlab.parallel.mini_ddp.BucketedDDP._bucket_ready",
        trial=overlap_gradients_trial,
        mistakes={
            **GRADIENT_MISTAKES,
            "after_backward": "the all-reduces started only once backward was over, so none overlapped it. "
            "Start each one from p.register_post_accumulate_grad_hook, which runs the moment p.grad is ready.",
            "blocking": "a hook waited for an all-reduce (its own, or one an earlier hook started), so backward "
            "stopped there. Pass async_op=True, keep every handle, and wait for them only in finish().",
            "hooked_frozen": "a hook cannot be registered on a parameter with requires_grad=False (here fc1.bias): "
            "hook only `p.requires_grad` parameters.",
            "no_finish": "return the function that waits for the all-reduces (it takes no argument).",
            "changed_in_flight": "you changed p.grad while its all-reduce was in flight. dist.all_reduce(p.grad, "
            "async_op=True) reads and writes p.grad until its handle is waited for, so a p.grad /= n meanwhile "
            "races with it: divide before you launch the all-reduce (divide, then sum, gives the average), or "
            "after wait().",
            "same_tensor": "your hook uses the loop variable p, which is the last parameter by the time hooks run; "
            "use the tensor the hook receives (def hook(param): ... param.grad ...).",
            "never_waited": "finish() must wait for every all-reduce started in backward: keep the handle "
            "dist.all_reduce(..., async_op=True) returns and call its .wait() in finish(). Until then the "
            "gradient is whatever the all-reduce has reached, often this rank's own divided by N.",
            "reduced_a_copy": "the all-reduces summed copies, and .grad kept this rank's own gradient divided by N. "
            "A hook from tensor.register_hook gets the gradient before autograd stores it, and autograd copies "
            "what the hook returns into .grad at once, before the all-reduce has finished. Use "
            "p.register_post_accumulate_grad_hook and all-reduce p.grad itself, in place.",
        },
        on_error=_frozen_none,
    ),
    Exercise(
        name="shard_indices",
        page="ddp",
        task="Return the sample indices DistributedSampler(dataset of num_samples, world_size, rank, shuffle=True, "
        "seed=seed, drop_last=drop_last) yields after set_epoch(epoch): a permutation seeded with seed + epoch, "
        "padded (or cut) to a multiple of world_size, then every world_size-th index from position rank.",
        signature="def shard_indices(num_samples, world_size, rank, seed, epoch, drop_last) -> torch.Tensor:",
        solution="ddp.shard_indices",
        library="distlab.data.shard_indices",
        trial=shard_trial,
        mistakes=SAMPLER_MISTAKES,
    ),
)
