"""The checkpointing chapter's exercise: the activation bytes a rank holds at the peak of a step, with and without
recomputing each block in backward. Arithmetic, run on one rank and graded on a grid of models against the
library's model (:func:`distlab.predict.checkpointing.checkpointed_activation_bytes`, which the chapter's test holds
to the course's memory tracker); a wrong answer is compared with what each typical mistake would give.
"""

from __future__ import annotations

from ..predict.checkpointing import checkpointed_activation_bytes, mlp_block_bytes
from .catalog import Exercise
from .trial import Trial, numbers_close


def _transformer(seq_len: int, micro_batch: int, hidden: int) -> tuple[int, int]:
    """(input, inside) of one transformer layer in 16-bit training with fused attention (Korthikanti et al.,
    ``distlab.predict.calculator.layer_activation_bytes``): its input is 2sbh bytes of its 34sbh."""
    tokens = seq_len * micro_batch * hidden
    return 2 * tokens, 32 * tokens


MODELS = (
    (*mlp_block_bytes(256, 64, 256), 4, "the chapter's model: 4 MLP blocks, 256 rows, width 64, hidden 256, fp32"),
    (*_transformer(1024, 8, 768), 12, "gpt-small: 12 layers, 8 sequences of 1024 tokens, 16-bit"),
    (*_transformer(4096, 1, 4096), 32, "a 7B model: 32 layers, 1 sequence of 4096 tokens, 16-bit"),
)
"""(input_bytes, inside_bytes, blocks, what it is)."""


def _mistakes(input_bytes: int, inside_bytes: int, blocks: int, checkpointed: bool) -> list[tuple[str, int]]:
    if not checkpointed:
        return [("kept_inputs_only", blocks * input_bytes)]
    return [
        ("forgot_block_inputs", inside_bytes),
        ("forgot_recomputed_block", blocks * input_bytes),
        ("recomputed_every_block", blocks * (input_bytes + inside_bytes)),
        ("recomputed_block_input_twice", (blocks + 1) * input_bytes + inside_bytes),
    ]


def _check(t: Trial, fn, input_bytes: int, inside_bytes: int, blocks: int, checkpointed: bool) -> None:
    expected = checkpointed_activation_bytes(input_bytes, inside_bytes, blocks, checkpointed)
    got = t.call(fn, input_bytes, inside_bytes, blocks, checkpointed)
    if numbers_close(got, expected):
        return
    mistake = next((k for k, v in _mistakes(input_bytes, inside_bytes, blocks, checkpointed) if got == v), None)
    shown = f"{got:,} B" if isinstance(got, int | float) else repr(got)
    what = f"{blocks} blocks {'checkpointed' if checkpointed else 'not checkpointed'}"
    t.fail("activation bytes", f"{what}: got {shown}, expected {expected:,} B", mistake)


def checkpointed_bytes_trial(t: Trial, fn) -> None:
    for input_bytes, inside_bytes, blocks, model in MODELS:
        with t.case(f"{model}; a block's input {input_bytes:,} B, inside {inside_bytes:,} B"):
            for checkpointed in (False, True):
                _check(t, fn, input_bytes, inside_bytes, blocks, checkpointed)
    t.note("checkpointing each block keeps every block's input and, at the peak, one block recomputed")


EXERCISES = (
    Exercise(
        name="checkpointed_activation_bytes",
        page="checkpointing",
        task="Return the activation bytes a rank keeps for backward at the peak of one step, for `blocks` equal "
        "blocks that each keep `input_bytes` (the block's input) and `inside_bytes` more, without checkpointing "
        "or (`checkpointed`) with each block checkpointed.",
        signature="def checkpointed_activation_bytes(input_bytes: int, inside_bytes: int, blocks: int, "
        "checkpointed: bool) -> int:",
        solution="checkpointing.checkpointed_activation_bytes",
        library="distlab.predict.checkpointing.checkpointed_activation_bytes",
        trial=checkpointed_bytes_trial,
        ranks=1,
        mistakes={
            "forgot_block_inputs": "a checkpointed block still keeps its input, to rerun its forward from it: "
            "every block's input is held at the peak, blocks x input_bytes, beside the recomputed block.",
            "forgot_recomputed_block": "at the peak backward has just rerun one block's forward, and that block's "
            "inside is held again until its backward ends: add one inside_bytes to the kept inputs.",
            "recomputed_every_block": "backward recomputes one block at a time, right before that block's backward, "
            "and frees it after: only one block's inside is held at once, not every block's.",
            "recomputed_block_input_twice": "the recomputed block's input is the one it kept: count it once, "
            "blocks x input_bytes + inside_bytes.",
            "kept_inputs_only": "without checkpointing nothing is recomputed: every block keeps its input and its "
            "inside until its backward, blocks x (input_bytes + inside_bytes).",
        },
    ),
)
