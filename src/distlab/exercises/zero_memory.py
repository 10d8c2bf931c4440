"""The ZeRO chapter's first exercise: the bytes one rank holds for training with Adam, at each ZeRO stage.

Arithmetic, on one rank, graded on a grid of Ψ and N against :func:`distlab.predict.memory.expected_state_bytes`.
A wrong term is compared with every way of counting it wrongly (a term divided or not by N, the master copy, the
padding, the step counter), so that the verdict names the one the answer took. The chapter's module
(:mod:`.zero`) lists it with the ZeRO steps.
"""

from __future__ import annotations

from itertools import product

from ..predict.memory import BYTES_PER_VALUE, expected_state_bytes
from .catalog import Exercise
from .trial import Trial

# --- Bytes per rank --------------------------------------------------------------------------------------------

TERMS = ("parameters", "gradients", "optimizer_state")
DIVIDES = {"ddp": (), "zero1": TERMS[2:], "zero2": TERMS[1:], "zero3": TERMS}
"""The terms each stage divides by N."""
COUNTER = 4
"""Adam's float32 step counter, one per tensor it steps (one flat tensor here). torch keeps it on the CPU unless
Adam is capturable or fused: on gloo, as the course runs, it is the rank's memory like the rest; on a GPU it is
host memory, not the GPU's."""
PSIS, WORLD_SIZES = (1_000_000, 7_000_000_001), (1, 3, 8)
"""Ψ that divides by 8 and not by 3, and a 7B model that divides by neither."""


def _count(
    term: str, precision: str, psi: int, n: int, divided: bool, padded: bool, master: bool = True, counter: bool = True
) -> tuple[list[float], str]:
    """One way of counting ``term``: the bytes it gives (unpadded shards: Ψ/N exactly, or rounded down), and the
    arithmetic in words."""
    shard = -(-psi // n)
    if divided:
        values, said = ([shard], f"ceil(Ψ/N) = {shard:,} values") if padded else ([psi / n, psi // n], "Ψ/N values")
    elif padded:
        values, said = [shard * n], f"ceil(Ψ/N)·N = {shard * n:,} values (the padded buffer)"
    else:
        values, said = [psi], f"Ψ = {psi:,} values"
    per_value = BYTES_PER_VALUE["adam", precision][TERMS.index(term)] - (0 if master else 4)
    extra = COUNTER if term == "optimizer_state" and counter else 0
    said += f" × {per_value} bytes" + (" + 4 (Adam's step counter, on the CPU)" if extra else "")
    return [v * per_value + extra for v in values], said


def _diagnose(term: str, strategy: str, precision: str, psi: int, n: int, got: float) -> str | None:
    """The mistake a wrong ``term`` is, where one way of counting it wrongly gives ``got``: a term divided or not
    divided by N, then the master copy left out, the padding left out or added, the step counter left out."""
    right = (term in DIVIDES[strategy], strategy != "ddp", True, True)
    state = term == "optimizer_state"
    for change in product((False, True), repeat=4):
        if (change[2] and not (state and precision == "mixed")) or (change[3] and not state) or not any(change):
            continue
        way = [value != flip for value, flip in zip(right, change)]
        if any(abs(value - got) < 0.5 for value in _count(term, precision, psi, n, *way)[0]):
            if change[0]:
                if strategy == "zero2" and not state:
                    return "zero2_wrong_term"
                return "sharded_too_early" if way[0] else "not_sharded"
            return "no_master_copy" if change[2] else "no_padding" if change[1] else None  # the counter alone passes
    return None


COUNTER_NOTE = "right; the library also counts Adam's 4-byte step counter, a CPU tensor, in optimizer_state"


def bytes_trial(t: Trial, fn) -> None:
    without_counter = []  # the cases right but for Adam's step counter: the stage table, which leaves it out
    for strategy, precision in product(DIVIDES, ("fp32", "mixed")):
        with t.case(f"{strategy}, {precision}"):
            for psi, n in product(PSIS, WORLD_SIZES):
                got = t.call(fn, psi, strategy, n, precision)
                without_counter += _bytes_check(t, got, strategy, precision, psi, n)
    if without_counter:
        t.note(COUNTER_NOTE)


def _bytes_check(t: Trial, got, strategy: str, precision: str, psi: int, n: int) -> list[str]:
    """Fails on a wrong term; returns the terms that are right but for the step counter (the optimizer state's)."""
    where = f"at Ψ={psi:,}, N={n}"
    if isinstance(got, (tuple, list)) and len(got) == 3:
        got = dict(zip(TERMS, got))
    if not isinstance(got, dict) or set(TERMS) - set(got):
        t.fail(f"answer {where}", f"expected a dict with keys {', '.join(TERMS)}, got {got!r:.80}", "not_a_dict")
    expected = expected_state_bytes(psi, strategy, n, "adam", precision)
    without_counter = []
    for term in TERMS:
        value = got[term]
        if not isinstance(value, (int, float)) or abs(value - expected[term]) >= 0.5:
            if (
                term == "optimizer_state"
                and isinstance(value, (int, float))
                and abs(value + COUNTER - expected[term]) < 0.5
            ):
                without_counter.append(term)  # the idea (which term divides by N) is right; the counter is bookkeeping
                continue
            right = _count(term, precision, psi, n, term in DIVIDES[strategy], strategy != "ddp")
            shown = f"{value:,}" if isinstance(value, (int, float)) else repr(value)
            mistake = _diagnose(term, strategy, precision, psi, n, value) if isinstance(value, (int, float)) else None
            t.fail(f"{term} {where}", f"{shown} bytes, expected {expected[term]:,} = {right[1]}", mistake)
    return without_counter


EXERCISES = (
    Exercise(
        name="zero_bytes_per_rank",
        page="fsdp_from_scratch",
        task="Return the bytes one rank holds for training with Adam, as a dict with keys parameters, gradients and "
        "optimizer_state, for strategy ddp, zero1, zero2 or zero3, world_size N and precision fp32 or mixed. Count "
        "as on the CPU, where the course runs: Adam's 4-byte step counter is then the rank's memory too.",
        signature="def bytes_per_rank(num_params: int, strategy: str, world_size: int, precision: str) -> dict:",
        solution="zero.bytes_per_rank",
        library="distlab.predict.memory.expected_state_bytes",
        trial=bytes_trial,
        ranks=1,
        mistakes={
            "no_master_copy": "mixed precision keeps an fp32 master copy of the parameters in the optimizer state "
            "beside Adam's two moments: 4 + 4 + 4 = 12 bytes a value, not 8.",
            "sharded_too_early": "each stage divides one more term by N: ZeRO-1 the optimizer state only, ZeRO-2 also "
            "the gradients, ZeRO-3 also the parameters; DDP divides nothing.",
            "not_sharded": "this stage divides that term by N: ZeRO-1 the optimizer state, ZeRO-2 also the "
            "gradients, ZeRO-3 all three.",
            "zero2_wrong_term": "ZeRO-2 divides the gradients and the optimizer state by N, and keeps the "
            "parameters whole on every rank.",
            "no_padding": "a ZeRO stage pads its flat buffer with zeros to a multiple of N: a shard holds "
            "ceil(Ψ/N) values, and a whole buffer ceil(Ψ/N)·N (DDP holds exactly Ψ).",
        },
    ),
)
