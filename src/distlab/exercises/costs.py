"""The cost chapter's exercises: a ring collective's time by the alpha-beta model, and the bytes each strategy
sends per step. Both are arithmetic, run on one rank and graded on a grid against the library's cost model
(:mod:`distlab.predict.costmodel`, with the GPU systems of :mod:`distlab.predict.gpu_specs` as inputs); a wrong
answer is compared with what each typical mistake would give on the same inputs.
"""

from __future__ import annotations

from ..predict.costmodel import RING_FACTOR, RING_STEPS, CollectiveModel, collective_calls
from ..predict.gpu_specs import SYSTEMS
from ..predict.traffic import expected_bytes_per_step, sharded_values_sent
from .catalog import Exercise
from .trial import Trial, numbers_close, size_label

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
SIZES = (4 << 10, 1 << 20, 256 << 20)


def _ring_mistakes(collective: str, nbytes: float, n: int, alpha: float, bw: float) -> dict[str, float]:
    steps, factor = RING_STEPS[collective](n), RING_FACTOR[collective](n)
    n_hops = steps * n // (n - 1)  # n hops a phase where the ring makes n - 1
    wrong = {
        "whole_tensor_per_hop": steps * alpha + steps * nbytes / bw,
        "latency_once": alpha + factor * nbytes / bw,
        "no_latency": factor * nbytes / bw,
    }
    if collective == "all_reduce":
        wrong["reduce_scatter_only"] = (n - 1) * alpha + (n - 1) / n * nbytes / bw
    else:
        wrong["all_reduce_factor"] = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw
    wrong["n_hops"] = n_hops * alpha + n_hops / n * nbytes / bw  # last: on 2 ranks n hops are an all-reduce's
    return wrong


def _check_ring(t: Trial, fn, collective: str, nbytes: int, n: int, alpha: float, bw: float) -> None:
    expected = CollectiveModel.nccl(collective, n, bw, alpha, 0.0).time_s(nbytes)
    got = t.call(fn, collective, nbytes, n, alpha, bw)
    if numbers_close(got, expected):
        return
    mistake = next(
        (k for k, v in _ring_mistakes(collective, nbytes, n, alpha, bw).items() if numbers_close(got, v)), None
    )
    steps, factor = RING_STEPS[collective](n), RING_FACTOR[collective](n)
    shown = f"{got * 1e6:.6g} us" if isinstance(got, (int, float)) else repr(got)
    size = size_label(nbytes)
    terms = f"{steps} hop{'s' * (steps != 1)} x {alpha * 1e6:g} us + {factor:.3g} x {size} / {bw / 1e9:g} GB/s"
    what = f"{collective} of {size} on {n} ranks"
    t.fail("time", f"{what}: got {shown}, expected {expected * 1e6:.6g} us = {terms}", mistake)


def ring_time_trial(t: Trial, fn) -> None:
    for key, system in SYSTEMS.items():
        alpha, bw = system.alpha_step_s, system.allreduce_busbw
        with t.case(f"{key}: alpha {alpha * 1e6:g} us a hop, {bw / 1e9:g} GB/s"):
            for n in (2, 4, 8):
                for collective in COLLECTIVES:
                    for nbytes in SIZES:
                        _check_ring(t, fn, collective, nbytes, n, alpha, bw)
    t.note("the latency term counts hops (2(n-1) for an all-reduce), the bandwidth term n-ths of the tensor")


STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "fsdp-no-reshard")
WIRES = (
    (4, 4, "fp32 everywhere"),
    (4, 2, "fp32 gradients, 16-bit parameters (DDP under autocast; FSDP2 with reduce_dtype=fp32, the course's policy)"),
    (2, 2, "16 bits everywhere (FSDP2's default with a 16-bit param_dtype; DDP with a compression hook)"),
)
"""(reduce_bytes, gather_bytes, what sends them). torch's ``MixedPrecisionPolicy`` leaves ``reduce_dtype`` None, and
FSDP2 then reduces in ``param_dtype``: 16 bits once the parameters are 16-bit. fp32 reductions are DDP's under
autocast (its parameters stay fp32) and the course's FSDP2 policy (``--fsdp-reduce-dtype fp32``)."""
PARAMETERS = (124_439_808, 1_557_611_200)  # gpt-small's and gpt-xl's sizes; both divide by 2 and by 8


def expected_bytes(strategy: str, parameters: int, n: int, reduce_bytes: int, gather_bytes: int) -> float:
    """What the cost model's GPU predictions count: every collective of one step, in its own dtype."""
    calls = collective_calls(strategy, [[(parameters,)], []], n, "nccl", reduce_bytes, gather_bytes=gather_bytes)
    return sum(size * RING_FACTOR[collective](n) for collective, _, size in calls)


def _bytes_mistakes(strategy: str, p: int, n: int, r: int, g: int) -> list[tuple[str, float]]:
    share, right = (n - 1) / n, expected_bytes(strategy, p, n, r, g)
    gathers = {"fsdp": 2}.get(strategy, 1)
    # first: on 2 ranks a whole tensor is also twice the bytes, and the fp32 reduction is the likelier mistake here
    wrong = [("reduced_in_fp32", expected_bytes(strategy, p, n, 4, g))] if r != 4 else []
    wrong.append(("whole_tensor", right * n / (n - 1)))
    if strategy == "ddp":
        wrong.append(("wrong_dtype", 2 * share * p * g))
    else:  # every collective in one of the two dtypes
        wrong += [("wrong_dtype", share * p * (r + gathers * r)), ("wrong_dtype", share * p * (g + gathers * g))]
    if strategy == "fsdp":
        wrong.append(("forgot_backward_gather", share * p * (r + g)))  # in one dtype, DDP's bytes
    if strategy == "fsdp-no-reshard":
        wrong.append(("no_reshard_gathers_twice", share * p * (r + 2 * g)))
    if strategy in ("zero1", "zero2"):
        wrong.append(("zero_without_gather", share * p * r))
        wrong.append(("zero_all_reduced", share * p * (2 * r + g)))
    return wrong


def _check_bytes(t: Trial, fn, strategy: str, p: int, n: int, r: int, g: int) -> None:
    expected = expected_bytes(strategy, p, n, r, g)
    got = t.call(fn, strategy, p, n, r, g)
    if numbers_close(got, expected):
        return
    mistake = next((k for k, v in _bytes_mistakes(strategy, p, n, r, g) if numbers_close(got, v)), None)
    number = isinstance(got, (int, float))
    shown = f"{got / 1e9:.6g} GB ({got / (p * r):.4g} x the gradients' bytes)" if number else repr(got)
    what = f"{strategy}, {p:,} parameters, {r}-byte gradients and {g}-byte parameters on the wire"
    t.fail("bytes sent", f"{what}: got {shown}, expected {expected / 1e9:.6g} GB ({expected / (p * r):.4g} x)", mistake)


def bytes_sent_trial(t: Trial, fn) -> None:
    for r, g, wire in WIRES:
        for n in (2, 8):
            with t.case(f"{wire}, {n} ranks"):
                for strategy in STRATEGIES:
                    for p in PARAMETERS:
                        _check_bytes(t, fn, strategy, p, n, r, g)
    t.note(
        "with 16-bit gathers and an fp32 reduce-scatter (the course's policy) FULL_SHARD sends what DDP sends under "
        "autocast, 2 + 2 + 4 against 4 + 4 per value; with torch's default reduce dtype (the 16-bit param_dtype) "
        "2 + 2 + 2, three quarters of it"
    )


FROZEN_STRATEGIES = ("ddp", "fsdp", "fsdp-no-reshard")
FROZEN_MODELS = (
    (6_738_415_616, 4_194_304, "Llama-2-7B, rank-8 adapters on q and v"),
    (6_738_415_616, 67_384_156, "Llama-2-7B, 1 % trainable"),
    (124_439_808, 811_008, "gpt-small, rank-8 adapters on every linear layer"),
)
"""(every parameter, the trainable ones, what they are): frozen bases with small adapters."""


def _frozen_mistakes(strategy: str, p: int, t: int, n: int, b: int) -> list[tuple[str, float]]:
    share, gathers = (n - 1) / n, {"fsdp": 2, "fsdp-no-reshard": 1}.get(strategy, 0)
    every_gradient = expected_bytes_per_step(strategy, p, n, b)  # as if every parameter trained
    wrong = [("frozen_gradients_reduced", every_gradient)]
    if gathers:
        wrong.append(("frozen_weights_not_gathered", share * sharded_values_sent(t, t, gathers) * b))
    wrong.append(("whole_tensor", expected_bytes_per_step(strategy, p, n, b, trainable=t) / share))
    return wrong


def _check_frozen(t: Trial, fn, strategy: str, p: int, trainable: int, n: int, b: int) -> None:
    expected = expected_bytes_per_step(strategy, p, n, b, trainable=trainable)
    got = t.call(fn, strategy, p, trainable, n, b)
    if numbers_close(got, expected):
        return
    mistake = next((k for k, v in _frozen_mistakes(strategy, p, trainable, n, b) if numbers_close(got, v)), None)
    shown = f"{got / 2**20:,.6g} MiB" if isinstance(got, (int, float)) else repr(got)
    what = f"{strategy}, {trainable:,} of {p:,} parameters trainable, {b}-byte values on {n} ranks"
    t.fail("bytes sent", f"{what}: got {shown}, expected {expected / 2**20:,.6g} MiB", mistake)


def frozen_bytes_trial(t: Trial, fn) -> None:
    for p, trainable, model in FROZEN_MODELS:
        for n in (2, 8):
            with t.case(f"{model}, {n} ranks"):
                for strategy in FROZEN_STRATEGIES:
                    for b in (4, 2):
                        _check_frozen(t, fn, strategy, p, trainable, n, b)
    t.note("over a frozen base DDP sends a fraction f of its usual bytes, FULL_SHARD 2 + f passes over the model")


EXERCISES = (
    Exercise(
        name="ring_collective_time",
        page="ddp_vs_fsdp",
        task="Return the alpha-beta time of one ring `collective` ('all_reduce', 'reduce_scatter' or 'all_gather') "
        "of `nbytes` on `n` ranks: `alpha_s` per hop, and each hop moves one n-th of the tensor at `bandwidth` "
        "bytes per second.",
        signature="def ring_time(collective: str, nbytes: float, n: int, alpha_s: float, bandwidth: float) -> float:",
        solution="costs.ring_time",
        library="distlab.predict.costmodel.CollectiveModel.nccl",
        trial=ring_time_trial,
        ranks=1,
        mistakes={
            "reduce_scatter_only": "that is a reduce-scatter's time. A ring all-reduce is a reduce-scatter and then "
            "an all-gather: 2(n-1) hops, and 2(n-1)/n of the tensor through each link.",
            "whole_tensor_per_hop": "each hop moves one segment, S/n bytes, not the whole tensor: the bandwidth term "
            "is (hops / n) * S / B.",
            "latency_once": "the latency is paid on every hop, since each hop waits for the one before: hops * alpha.",
            "no_latency": "the latency term is missing: hops * alpha, which decides the time of small messages.",
            "n_hops": "a ring of n ranks makes n - 1 hops a phase, not n: after n - 1 hops every segment has been "
            "to every rank (2(n-1) hops for an all-reduce, and (n-1)/n of the tensor through each link per phase).",
            "all_reduce_factor": "only the all-reduce runs two phases. A reduce-scatter or an all-gather is one: "
            "n-1 hops and (n-1)/n of the tensor.",
        },
    ),
    Exercise(
        name="bytes_sent_per_step",
        page="ddp_vs_fsdp",
        task="Return the bytes one rank sends in one optimizer step of `strategy` ('ddp', 'zero1', 'zero2', 'fsdp' "
        "or 'fsdp-no-reshard') for `parameters` values on `n` ranks, by NCCL's ring, gradients reduced in "
        "`reduce_bytes` per value and parameters gathered in `gather_bytes` (every value gathered in forward, and "
        "again in backward where the strategy frees it).",
        signature="def bytes_sent_per_step(strategy: str, parameters: int, n: int, reduce_bytes: int, "
        "gather_bytes: int) -> float:",
        solution="costs.bytes_sent_per_step",
        library="distlab.predict.traffic.expected_bytes_per_step",
        trial=bytes_sent_trial,
        ranks=1,
        mistakes={
            "forgot_backward_gather": "FULL_SHARD frees each unit after its forward, so backward gathers it again: "
            "two all-gathers and one reduce-scatter, three (n-1)/n passes over the values where DDP makes two.",
            "no_reshard_gathers_twice": "SHARD_GRAD_OP keeps the gathered parameters from forward to backward: one "
            "all-gather and one reduce-scatter, DDP's volume.",
            "zero_without_gather": "after each rank steps its slice, the updated parameters must reach every rank: "
            "ZeRO-1 and ZeRO-2 all-gather them, so they send what DDP sends.",
            "zero_all_reduced": "ZeRO-1 and ZeRO-2 reduce-scatter the gradients, since each rank steps only its own "
            "shard, then all-gather the parameters: (n-1)/n each, DDP's bytes. An all-reduce of the gradients "
            "would send twice the reduce-scatter's bytes.",
            "reduced_in_fp32": "the gradients were reduced in fp32 where they travel in reduce_bytes. fp32 is not "
            "a default of FSDP2: torch's MixedPrecisionPolicy reduces in param_dtype unless reduce_dtype says "
            "otherwise (the course's policy sets fp32), and DDP reduces in its gradients' dtype.",
            "wrong_dtype": "each collective carries its own dtype: the gradients (all-reduce, reduce-scatter) in "
            "reduce_bytes, the parameters (all-gather) in gather_bytes.",
            "whole_tensor": "a ring sends (n-1)/n of the tensor from each rank per phase, not the whole of it.",
        },
    ),
    Exercise(
        name="frozen_base_bytes_sent",
        page="practice",
        task="Return the bytes one rank sends in one step of `strategy` ('ddp', 'fsdp' or 'fsdp-no-reshard') for a "
        "model of `parameters` values of which only `trainable` have gradients (the rest a frozen base), on `n` "
        "ranks by NCCL's ring, every value `bytes_per_value` bytes on the wire.",
        signature="def frozen_base_bytes_sent(strategy: str, parameters: int, trainable: int, n: int, "
        "bytes_per_value: int) -> float:",
        solution="costs.frozen_base_bytes_sent",
        library="distlab.predict.traffic.expected_bytes_per_step",
        trial=frozen_bytes_trial,
        ranks=1,
        mistakes={
            "frozen_gradients_reduced": "frozen parameters have no gradient, so nothing of theirs is reduced: DDP "
            "all-reduces the trainable gradients only, 2(n-1)/n x trainable, and FSDP reduce-scatters only those.",
            "frozen_weights_not_gathered": "FSDP shards the frozen weights too, and forward and backward compute "
            "with them: every parameter is all-gathered (twice under FULL_SHARD, once under SHARD_GRAD_OP), only "
            "the gradients are the trainable ones.",
            "whole_tensor": "a ring sends (n-1)/n of the tensor from each rank per phase, not the whole of it.",
        },
    ),
)
