"""The ZeRO chapter's exercises: a ZeRO-1 step, ZeRO-2's gradient shard, a ZeRO-3 unit, and the bytes per rank.

The first three work on :class:`distlab.parallel.flat_param.FlatParams`'s picture: ``numel`` values padded with
zeros to a multiple of N and cut into N equal shards, rank r owning shard r. Every rank draws every rank's data
from generators seeded by the case, so it computes what the collectives should leave it (the averaged gradient,
the stepped parameters) alone, with no collective of its own. Every rank makes all its calls of the learner's
function before it checks any: a rank whose answer is wrong is reported wrong, not as the other ranks left
waiting in its next call's collective. The fourth, the bytes per rank, is in :mod:`.zero_memory`.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable
from functools import partial

import torch

from .catalog import Exercise
from .trial import Trial, storages_reached
from .zero_memory import EXERCISES as MEMORY_EXERCISES

NUMELS = (11, 12)
"""Values in a flat buffer: 11 needs padding on 2, 3 or 4 ranks, 12 divides by 2, 3 and 4."""
LR, BETA = 0.1, 0.9
UNITS = ((4, 2), (2, 3))
"""The ZeRO-3 unit, a linear layer (in, out): 4 -> 2 is 10 values (padded on 3 or 4 ranks), 2 -> 3 is 9 (on 2
or 4)."""


def _values(numel: int, padded: int, seed: int) -> torch.Tensor:
    """``numel`` small integers, then zeros up to ``padded``."""
    flat = torch.zeros(padded)
    flat[:numel] = torch.randint(-9, 10, (numel,), generator=torch.Generator().manual_seed(seed)).float()
    return flat


def _layout(numel: int, n: int) -> tuple[int, int]:
    size = -(-numel // n)
    return size, size * n


def _locate(size: int, numel: int, offset: int = 0) -> Callable[[int], str]:
    def locate(index: int) -> str:
        index += offset
        padding = " (padding)" if index >= numel else ""
        return f"shard {index // size} (rank {index // size}'s), value {index}{padding}"

    return locate


def _cpu(x):
    return x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4)


def _run_then_check(t: Trial, calls: Iterable[tuple[str, Callable[[], Callable[[], None]]]]) -> None:
    """``calls``: (case, call), ``call()`` runs the learner once and returns the check of what it did; each case is
    checked as soon as it ran (a rank that stops at a wrong answer leaves its peers waiting in the next case's
    collective, and the grader reports the wrong answer, which came first)."""
    for label, call in calls:
        with t.case(label):
            call()()


def _values_of(size: int, k: int) -> str:
    return f"values {k * size}..{(k + 1) * size - 1}"


# --- ZeRO-1 ------------------------------------------------------------------------------------------------


def zero1_trial(t: Trial, fn) -> None:
    _run_then_check(t, _zero1_calls(t, fn))


def _zero1_calls(t: Trial, fn):
    for numel in NUMELS:
        size, padded = _layout(numel, t.world_size)
        reference = _values(numel, padded, seed=numel)  # the same model on every rank
        momentum_all = torch.zeros(padded)  # every shard's momentum
        params, momentum = reference.to(t.device), None
        unmoved: dict = {}  # step 1 wrote flat_params yet left it where it was: step 2 tells why
        for step in (1, 2):
            grad = _values(numel, padded, seed=100 * numel + step)
            momentum_all = BETA * momentum_all + grad
            before, reference = reference, reference - LR * momentum_all
            got = {}

            def call(got=got, grad=grad, momentum=momentum, step=step):  # called as soon as it is yielded
                since, version, params_before = len(t.tracer.calls), params._version, _cpu(params)
                got["momentum"] = t.call(fn, params, grad.to(t.device), momentum, LR, BETA)
                storage = params.untyped_storage().data_ptr()
                written = params._version != version or any(
                    c.get("storage") == storage for c in t.tracer.calls[since:]
                )  # the learner's copy_ bumps the version; a collective's output is seen in the trace
                seen = {"momentum": _cpu(got["momentum"]), "params": _cpu(params), "ops": t.tracer.ops(since),
                        "written": written, "params_before": params_before, "momentum_before": _cpu(momentum),
                        "step": step, "unmoved": unmoved}  # fmt: skip
                return partial(_zero1_check, t, seen, before, reference, momentum_all, size, numel)

            yield f"{numel} values{f' padded to {padded}' if padded > numel else ''}, step {step}", call
            momentum = got["momentum"]  # the learner's own state, fed back into its next step


def _zero1_check(t: Trial, got: dict, before, expected, momentum_all, size: int, numel: int) -> None:
    r, n = t.rank, t.world_size
    momentum, params = got["momentum"], got["params"]
    shard = [slice(k * size, (k + 1) * size) for k in range(n)]
    if not isinstance(momentum, torch.Tensor):
        t.fail("momentum", f"expected this rank's {size} values, got {type(momentum).__name__}", "not_a_tensor")
    if momentum.numel() != size:
        why = f"it holds {momentum.numel()} values; rank {r} keeps the momentum of its own shard only, {size} of"
        t.fail("momentum", f"{why} {n * size} (1/{n})", "state_not_sharded" if momentum.numel() >= numel else None)
    momentum = momentum.reshape(-1)
    if not _close(momentum, momentum_all[shard[r]]):
        if _close(momentum, (1 - BETA) * momentum_all[shard[r]]):
            why = f"it is (1 - beta) = {1 - BETA:g} times this shard's momentum: m = beta * m + (1 - beta) * g"
            t.fail(
                "momentum", f"{why} averages the gradients, where SGD's momentum adds each one whole", "ema_momentum"
            )
        if n > 1 and _close(momentum, momentum_all[shard[r]] / n):
            why = f"it is this shard's momentum divided by {n}: flat_grad was divided by {n} once more"
            t.fail("momentum", why, "divided_again")
        if n > 1 and _close(momentum, n * momentum_all[shard[r]]):
            summing = [op for op in got["ops"] if op.startswith("reduce_scatter") or op == "all_reduce"]
            by = {"all_reduce": "dist.all_reduce"}.get(summing[0], f"a reduce-scatter (dist.{summing[0]})") \
                if summing else "a sum over the ranks"  # fmt: skip
            why = f"it is {n} times this shard's momentum: {by} summed the {n} ranks' flat_grad, already their average"
            t.fail("momentum", why, "summed_again")
        for k in range(n):
            if k != r and _close(momentum, momentum_all[shard[k]]):
                why = f"it is shard {k}'s ({_values_of(size, k)}); rank {r} steps shard {r}, {_values_of(size, r)}"
                t.fail("momentum", why, "wrong_shard")
        t.expect_close(momentum, momentum_all[shard[r]], "momentum", locate=_locate(size, numel, r * size))
    if got["unmoved"]:
        _zero1_unmoved(t, got, params[shard[r]], size)
    moved = [k for k in range(n) if not torch.equal(expected[shard[k]], before[shard[k]])]
    stale = [k for k in moved if torch.equal(params[shard[k]], before[shard[k]])]
    if r in stale and got["written"] and got["step"] == 1:
        got["unmoved"]["step 1"] = True  # written, not moved: a step with the old momentum (zero) or no step
        return
    if r in stale:
        why = f"its own shard {r} ({_values_of(size, r)}) still holds the values before the step"
        if got["written"]:
            t.fail("flat_params", f"{why}, though your function wrote into flat_params", "not_stepped")
        t.fail("flat_params", f"{why}, and your function never wrote into flat_params", "not_in_place")
    if stale:
        held = f"shards {', '.join(map(str, stale))} still hold" if len(stale) > 1 else f"shard {stale[0]} still holds"
        why = f"{held} the values before the step; only shard {r}, this rank's, is stepped"
        t.fail("flat_params", why, "no_all_gather")
    t.expect_close(params, expected, "flat_params", locate=_locate(size, numel))
    if "all_reduce" in got["ops"]:  # right values, at twice the all-gather's bytes
        why = f"it called dist.all_reduce: each rank sent 2(n-1)/n = {2 * (n - 1) / n:.2f} times the buffer's bytes,"
        t.fail("choice of collective", f"{why} where an all-gather of the shards sends (n-1)/n = {(n - 1) / n:.2f}",
               "all_reduced")  # fmt: skip


def _zero1_unmoved(t: Trial, got: dict, own: torch.Tensor, size: int) -> None:
    """Step 1 wrote flat_params but left this rank's shard where it was; step 2 says why. A step with the momentum
    before this step's gradient was added moves by lr * beta * m_old, which is zero at step 1 (m starts at zero)
    and lr * beta * m_1 at step 2; a shard gathered before it was stepped never moves."""
    r, where = t.rank, f"its own shard {t.rank} ({_values_of(size, t.rank)})"
    shard_before = got["params_before"][r * size : (r + 1) * size]
    m_old = got["momentum_before"]
    if isinstance(m_old, torch.Tensor) and m_old.numel() == size:
        if _close(own, shard_before - LR * BETA * m_old.reshape(-1).to(own.dtype)):
            why = (f"flat_params was written, but {where} did not move at step 1 and moved by lr * beta * m at step 2, "
                   "m being the momentum your step 1 returned: each step used the momentum before adding its own "
                   "gradient")  # fmt: skip
            t.fail("flat_params", why, "momentum_late")
    if torch.equal(own, shard_before):
        t.fail("flat_params", f"flat_params was written at each step, but {where} never moved", "not_stepped")
    t.fail("flat_params", f"flat_params was written at step 1, but {where} did not move there")


# --- ZeRO-2 and ZeRO-3: a shard of the averaged gradient ------------------------------------------------------


def _observed(t: Trial, got, since: int) -> dict:
    """What the grader needs of a returned shard once the next call has run: its values, the bytes its storage
    holds, the collectives called."""
    storage = got.untyped_storage().nbytes() if isinstance(got, torch.Tensor) else 0
    return {"got": _cpu(got), "storage": storage, "ops": t.tracer.ops(since)}


def _gradient_check(t: Trial, seen: dict, mean: torch.Tensor, numel: int) -> None:
    """The returned gradient shard against ``mean``, the averaged flat gradient, padded."""
    r, n, got = t.rank, t.world_size, seen["got"]
    size, padded = _layout(numel, n)
    if not isinstance(got, torch.Tensor):
        t.fail("returned shard", f"expected a tensor of {size} values, got {type(got).__name__}", "not_a_tensor")
    got = got.reshape(-1)
    if got.numel() != size:
        if got.numel() in (numel, padded):
            mistake, why = "whole_gradient", "the whole gradient's"
        elif got.numel() in (numel // n, max(0, min(size, numel - r * size))):
            mistake, why = "no_padding", f"a shard of the {numel} values unpadded"
        else:
            mistake, why = None, "not a shard"
        why += f"; rank {r} keeps shard {r}: ceil({numel}/{n}) = {size} values, 1/{n} of the gradient padded to"
        t.fail("returned shard", f"it holds {got.numel()} values, {why} {padded}", mistake)
    shard = [mean[k * size : (k + 1) * size] for k in range(n)]
    if not _close(got, shard[r]):
        if _close(got, n * shard[r]):
            t.fail("gradient shard", f"it is the sum over the {n} ranks, {n} times the average", "summed")
        for k in range(n):
            if k != r and (_close(got, shard[k]) or _close(got, n * shard[k])):
                why = f"it is shard {k} ({_values_of(size, k)}); rank {r} keeps shard {r}, {_values_of(size, r)}"
                t.fail("gradient shard", why, "wrong_shard")
        t.expect_close(got, shard[r], "gradient shard", locate=_locate(size, numel, r * size))
    if "all_reduce" in seen["ops"]:
        why = "it called dist.all_reduce: every rank received the whole summed gradient, sending 2(n-1)/n ="
        t.fail("choice of collective", f"{why} {2 * (n - 1) / n:.2f} times its bytes, to keep 1/{n}", "all_reduced")
    if seen["storage"] > size * got.element_size():
        why = f"it is a view of a buffer of {seen['storage'] // got.element_size()} values: that whole buffer"
        t.fail("returned shard", f"{why} stays in memory as long as the {size}-value shard does", "gradient_kept")


def shard_gradient_trial(t: Trial, fn) -> None:
    _run_then_check(t, ((f"{k} values on {t.world_size} ranks", partial(_shard_call, t, fn, k)) for k in NUMELS))


def _shard_call(t: Trial, fn, numel: int):
    n = t.world_size
    grads = [_values(numel, numel, seed=1000 * numel + rank) for rank in range(n)]
    mean = torch.cat([sum(grads), torch.zeros(_layout(numel, n)[1] - numel)]) / n
    since = len(t.tracer.calls)
    seen = _observed(t, t.call(fn, grads[t.rank].clone().to(t.device)), since)
    return partial(_gradient_check, t, seen, mean, numel)


def _on_error_padding(failure: dict) -> str | None:
    return "no_padding" if re.search(r"world_?size", failure["message"], re.IGNORECASE) else None


# --- ZeRO-3 --------------------------------------------------------------------------------------------------


def _unit_loss(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    fan_out, fan_in = y.shape[1], x.shape[1]
    weight = flat[: fan_out * fan_in].view(fan_out, fan_in)
    bias = flat[fan_out * fan_in : fan_out * fan_in + fan_out]
    return ((x @ weight.T + bias - y) ** 2).mean()


FREED = "the parameter loss_fn was given holds {held} of its {numel} values when backward reads it"
NO_GRAD = "loss_fn was given a parameter that does not require grad, so backward gives it no gradient"


class _UnitForward(torch.autograd.Function):
    """The unit's linear layer on an input that requires grad, as a real unit's is (the activation of the unit
    before): its backward reads the weight to pass the gradient on, and it reads the parameter loss_fn was given
    as it is *then*. A parameter freed after forward (its storage resized to nothing, or ``.data`` swapped for an
    empty tensor) and not gathered again fails there; gathered again in place, it passes."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, x: torch.Tensor, fan_out: int) -> torch.Tensor:
        ctx.flat = flat  # the learner's own tensor, not a saved copy: what it holds at backward is what is read
        ctx.shape, ctx.fan_out = flat.shape, fan_out
        ctx.save_for_backward(x)
        values = flat.detach().reshape(-1)
        fan_in = x.shape[1]
        return x @ values[: fan_out * fan_in].view(fan_out, fan_in).T + values[fan_out * fan_in :][:fan_out]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        flat, fan_out, fan_in = ctx.flat, ctx.fan_out, x.shape[1]
        numel = ctx.shape.numel()
        held = min(flat.numel(), flat.untyped_storage().nbytes() // flat.element_size() - flat.storage_offset())
        if held < numel:
            raise RuntimeError(FREED.format(held=max(held, 0), numel=numel))
        weight = flat.detach().reshape(-1)[: fan_out * fan_in].view(fan_out, fan_in)
        grad_flat = torch.zeros(numel, dtype=grad_out.dtype, device=grad_out.device)
        grad_flat[: fan_out * fan_in] = (grad_out.T @ x).reshape(-1)
        grad_flat[fan_out * fan_in : fan_out * fan_in + fan_out] = grad_out.sum(0)
        ctx.flat = None  # the parameter is the learner's to free once backward is over
        return grad_flat.view(ctx.shape), grad_out @ weight, None


def _unit_data(fan_in: int, fan_out: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7000 + 100 * fan_in + 10 * fan_out + rank)
    x = torch.randint(-3, 4, (2, fan_in), generator=generator).float()
    return x, torch.randint(-3, 4, (2, fan_out), generator=generator).float()


def zero3_trial(t: Trial, fn) -> None:
    labels = [f"linear {i} -> {o}, {o * i + o} values on {t.world_size} ranks" for i, o in UNITS]
    _run_then_check(t, ((label, partial(_zero3_call, t, fn, *unit)) for label, unit in zip(labels, UNITS)))


def _zero3_call(t: Trial, fn, fan_in: int, fan_out: int):
    n, r, numel = t.world_size, t.rank, fan_out * fan_in + fan_out
    size, padded = _layout(numel, n)
    full = _values(numel, padded, seed=numel)
    batches = [_unit_data(fan_in, fan_out, rank) for rank in range(n)]
    grads = []
    for x, y in batches:  # one process's gradient of each rank's loss, at the whole parameter
        leaf = full.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(_unit_loss(leaf, x, y), leaf)[0])
    x_mine = batches[r][0].clone().requires_grad_(True)
    input_grad = torch.autograd.grad(_unit_loss(full, x_mine, batches[r][1]), x_mine)[0]
    gathered = []

    def loss_fn(flat):
        if not isinstance(flat, torch.Tensor) or flat.numel() != padded:
            got = flat.numel() if isinstance(flat, torch.Tensor) else type(flat).__name__
            why = f"loss_fn takes the unit's whole flat parameter, {padded} values (padding included); it got"
            raise ValueError(f"{why} {got} (this rank's shard is {size})")
        if not flat.requires_grad:
            raise ValueError(NO_GRAD)
        x, y = (v.to(flat.device) for v in batches[r])
        x = x.detach().clone().requires_grad_(True)  # the unit before's activation: backward passes its gradient on
        record = {"values": flat.detach().cpu().clone(), "parameter": weakref.ref(flat), "gradient": None, "x": x}
        if flat.is_leaf:  # the gradient's own reference, whether or not the parameter lives
            flat.register_post_accumulate_grad_hook(lambda p: record.update(gradient=weakref.ref(p.grad)))
        gathered.append(record)
        return ((_UnitForward.apply(flat, x, fan_out) - y) ** 2).mean()

    since = len(t.tracer.calls)
    seen = _observed(t, t.call(fn, full[r * size : (r + 1) * size].clone().to(t.device), loss_fn), since)
    reached = storages_reached(fn)
    seen["kept"] = [(_kept_bytes(g["parameter"], reached), _kept_bytes(g["gradient"], reached)) for g in gathered]
    seen["gathered"] = [g["values"] for g in gathered]
    seen["input_grads"] = [_cpu(g["x"].grad) for g in gathered]
    return partial(_zero3_check, t, seen, full, sum(grads) / n, numel, input_grad)


def _kept_bytes(ref: weakref.ref | None, reached: set[int]) -> int:
    """Bytes of the tensor ``ref`` names that the learner's objects still reach (0 once it is gone, resized to
    nothing, or held only inside torch: the returned shard is checked on its own)."""
    tensor = ref() if ref is not None else None
    if tensor is None:
        return 0
    storage = tensor.untyped_storage()
    return storage.nbytes() if storage.nbytes() and storage.data_ptr() in reached else 0


def _zero3_check(t: Trial, seen: dict, full, mean, numel: int, input_grad: torch.Tensor) -> None:
    size, _ = _layout(numel, t.world_size)
    if not seen["gathered"]:
        t.fail("unit", "loss_fn was never called: gather the whole parameter, then call loss_fn on it", "not_gathered")
    t.expect_close(seen["gathered"][0].reshape(-1), full, "gathered parameter", locate=_locate(size, numel))
    got = seen["input_grads"][0]
    if got is not None and not _close(got, input_grad):  # backward read other values than forward's
        why = "backward read other values of the parameter than forward did, so the gradient passed on to the"
        t.fail("gradient of the unit's input", f"{why} unit before is wrong", "freed_before_backward")
    for kept in seen["kept"]:
        alive = [f"{what} ({b} bytes)" for what, b in zip(("the gathered parameter", "its gradient"), kept) if b]
        if alive:
            why = f"{' and '.join(alive)} {'are' if len(alive) > 1 else 'is'} still alive after your function returned"
            t.fail(
                "memory after the call",
                f"{why}; rank {t.rank} should keep only its {size}-value shard",
                "gathered_kept",
            )
    _gradient_check(t, seen, mean, numel)


def _zero3_on_error(failure: dict) -> str | None:
    """The mistake a learner's exception in ``zero3_unit`` says: loss_fn's own refusals, and the unit's backward
    finding its parameter freed (torch's own words when a view of it is read)."""
    message = failure["message"]
    if "loss_fn takes" in message:
        return "not_gathered"
    if NO_GRAD in message or "does not require grad and does not have a grad_fn" in message:
        return "gathered_without_grad"
    if "when backward reads it" in message or "out of bounds for storage of size 0" in message:
        return "freed_before_backward"
    return None


# --- The exercises -------------------------------------------------------------------------------------------

SHARD_MISTAKES = {
    "summed": "you summed the gradients without dividing by the number of ranks. Data parallelism averages: "
    "divide by N, before the reduce-scatter (as the library does, so low precision cannot overflow) or after.",
    "wrong_shard": "rank r owns shard r of the flat buffer, values r*size to (r+1)*size - 1 with size = "
    "ceil(numel / N): the order torch's all-gather and reduce-scatter use.",
    "whole_gradient": "you returned the whole gradient. Each rank keeps 1/N of it: ceil(numel / N) values, its "
    "own shard; a reduce-scatter (reduce_scatter_flat) leaves exactly that.",
    "no_padding": "pad the flat buffer with zeros to a multiple of N first, so that every shard has "
    "ceil(numel / N) values: the equal-shard collectives need N equal pieces.",
    "all_reduced": "an all-reduce sends twice the bytes of a reduce-scatter and leaves every rank the whole "
    "gradient; a reduce-scatter (reduce_scatter_flat) sends (n-1)/n of them and leaves each rank its shard.",
    "gradient_kept": "the shard you returned is a view of a whole-sized buffer, which lives as long as the view "
    "does. Reduce into a tensor of shard size (or return a .clone() of the slice).",
}

EXERCISES = (
    Exercise(
        name="zero1_step",
        page="fsdp_from_scratch",
        task="Every rank holds the whole padded `flat_params` and the whole averaged `flat_grad`. Step only this "
        "rank's shard r (SGD with momentum: m = beta * m + g, p -= lr * m, with `momentum` this shard's state, None "
        "at the first step), all-gather every rank's stepped shard into `flat_params` in place (an all-gather: an "
        "all-reduce of the buffer would send twice the bytes), and return the new momentum of this rank's shard.",
        signature="def zero1_step(flat_params: torch.Tensor, flat_grad: torch.Tensor, momentum, lr: float, "
        "beta: float) -> torch.Tensor:",
        solution="zero.zero1_step",
        library="distlab.parallel.zero.ShardedBucket",
        trial=zero1_trial,
        mistakes={
            "state_not_sharded": "you kept momentum for the whole buffer. ZeRO-1's saving is exactly that each rank "
            "keeps the optimizer state of its own 1/N shard: step flat_params[r*size:(r+1)*size] only.",
            "wrong_shard": "rank r steps shard r, values r*size to (r+1)*size - 1 with size = flat_params.numel() / N: "
            "the order in which an all-gather lays the ranks' shards.",
            "no_all_gather": "each rank stepped its own shard, but the others never arrived: all-gather every rank's "
            "stepped shard into flat_params (all_gather_flat(stepped_shard, flat_params.numel()), then copy).",
            "not_in_place": "flat_params must hold the new values when your function returns: write into it "
            "(the all-gather's output is flat_params itself) rather than making a new tensor.",
            "ema_momentum": "the momentum here is SGD's, m = beta * m + g, not an average: Adam's first moment "
            "scales g by (1 - beta); SGD adds it whole.",
            "momentum_late": "you stepped with the momentum before this step's gradient was added to it, so at "
            "the first step (m = 0) nothing moved. Update the momentum first, then step with it: m = beta * m + g, "
            "then p -= lr * m.",
            "not_stepped": "what you gathered into flat_params is the shards before the step: step this rank's "
            "shard (p - lr * m) first, then all-gather the stepped shards.",
            "divided_again": "flat_grad arrives already averaged over the ranks (it was all-reduced and divided, as "
            "in DDP): add flat_grad[shard] to the momentum as it is, without dividing by N again.",
            "summed_again": "flat_grad is already the average over the ranks, the same on every rank: a reduce-scatter "
            "(or all-reduce) of it sums N equal copies, N times the average. Use this rank's shard of flat_grad as it "
            "is; reduce-scattering the gradient is ZeRO-2's step, on each rank's own gradient.",
            "all_reduced": "an all-reduce of flat_params with the other shards zeroed gives every rank the right "
            "values, but sends twice the bytes: 2(n-1)/n of the buffer from each rank, where an all-gather of the "
            "stepped shards sends (n-1)/n. All-gather them: all_gather_flat(stepped_shard, flat_params.numel()).",
        },
    ),
    Exercise(
        name="zero2_shard_gradient",
        page="fsdp_from_scratch",
        task="`grad` is this rank's own flat gradient (numel values). Return this rank's shard of the gradient "
        "averaged over the ranks: ceil(numel / N) values, padded with zeros at the end, made by one reduce-scatter.",
        signature="def shard_gradient(grad: torch.Tensor) -> torch.Tensor:",
        solution="zero.shard_gradient",
        library="distlab.parallel.zero.ShardedBucket.reduce_scatter",
        trial=shard_gradient_trial,
        mistakes=SHARD_MISTAKES,
        on_error=_on_error_padding,
    ),
    Exercise(
        name="zero3_unit",
        page="fsdp_from_scratch",
        task="`shard` is this rank's shard of a unit's padded flat parameter. Gather the whole parameter, run "
        "`loss_fn(full)` and backward, and return this rank's shard of the gradient averaged over the ranks, keeping "
        "nothing whole once your function returns.",
        signature="def zero3_unit(shard: torch.Tensor, loss_fn) -> torch.Tensor:",
        solution="zero.zero3_unit",
        library="distlab.parallel.zero3.ShardedUnit",
        trial=zero3_trial,
        mistakes={
            **SHARD_MISTAKES,
            "not_gathered": "loss_fn needs the unit's whole parameter: all-gather every rank's shard into a buffer "
            "of N * shard.numel() values first (all_gather_flat(shard, N * shard.numel())).",
            "freed_before_backward": "backward reads the whole parameter: keep it until backward ends, or gather it "
            "again before backward (ShardedUnit's pre-backward hook does).",
            "gathered_without_grad": "backward gives a gradient only to a tensor that requires grad: call "
            "full.requires_grad_(True) on the gathered buffer before loss_fn(full).",
            "gathered_kept": "ZeRO-3 holds a unit whole only while it computes. Keep no reference to the gathered "
            "buffer (in a global, a cache, the return value); the library resizes its storage to zero bytes.",
        },
        on_error=_zero3_on_error,
        pages=("labs/lab_fsdp",),
    ),
    *MEMORY_EXERCISES,
)
