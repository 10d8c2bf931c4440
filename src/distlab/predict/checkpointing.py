"""Activation checkpointing's arithmetic: the activation bytes one rank holds at the peak of a step, with and
without recomputing each block in backward (``book/checkpointing.md``).

A block keeps its input and some bytes more (its *inside*) for backward. Without checkpointing every block keeps
both until its own backward, so the peak, in the last block's backward, holds them all. Checkpointed one block at
a time, a block keeps only its input; backward reruns one block's forward just before that block's backward, so
the peak holds every block's input and one block's inside. What this is compared with is the course's tracker
(:mod:`distlab.measure.memory`), to the byte, on the chapter's block. No torch.
"""

from __future__ import annotations


def checkpointed_activation_bytes(input_bytes: int, inside_bytes: int, blocks: int, checkpointed: bool) -> int:
    """Activation bytes kept for backward at the peak, for ``blocks`` equal blocks each keeping ``input_bytes`` (its
    input) and ``inside_bytes`` more: ``blocks * (input + inside)``; checkpointed per block,
    ``blocks * input + inside`` (every input kept, one block recomputed at a time). A whole model checkpointed as
    one is one block whose inside is everything: it keeps as much at the peak as no checkpointing."""
    if blocks < 1 or input_bytes < 0 or inside_bytes < 0:
        raise ValueError(
            f"blocks must be 1 or more and the bytes 0 or more, not {blocks}, {input_bytes}, {inside_bytes}"
        )
    if checkpointed:
        return blocks * input_bytes + inside_bytes
    return blocks * (input_bytes + inside_bytes)


def mlp_block_bytes(batch: int, width: int, hidden: int, bytes_per_value: int = 4) -> tuple[int, int]:
    """``(input_bytes, inside_bytes)`` of the chapter's block, ``Linear(width, hidden)``, GELU, ``Linear(hidden,
    width)`` without biases, on ``batch`` rows: the first Linear keeps its input (``batch x width``); GELU keeps
    its input and the second Linear its own (``batch x hidden`` each). The weights are parameters, not activations."""
    return batch * width * bytes_per_value, 2 * batch * hidden * bytes_per_value


def mlp_backward_bytes(batch: int, width: int, hidden: int, bytes_per_value: int = 4) -> int:
    """What the last block's backward holds beside what forward kept, at the peak (the same with or without
    checkpointing): the gradient arriving at its output (``batch x width``), its hidden layer's gradient (``batch x
    hidden``), and its second weight's gradient (``hidden x width``), which the tracker counts as an activation from
    the moment backward makes it until autograd hands it to ``.grad``."""
    return (batch * width + batch * hidden + hidden * width) * bytes_per_value


LOSS_BYTES = 8
"""The loss, a float32 scalar, and the gradient backward starts from, another."""


def mlp_activation_peak_bytes(
    batch: int, width: int, hidden: int, blocks: int, checkpointed: bool, bytes_per_value: int = 4
) -> int:
    """The most activation bytes the course's tracker counts in one step of the chapter's model (an embedding, then
    ``blocks`` MLP blocks, a mean for the loss) under DDP: what forward kept
    (:func:`checkpointed_activation_bytes` of :func:`mlp_block_bytes`), the last block's backward
    (:func:`mlp_backward_bytes`) and the loss (:data:`LOSS_BYTES`)."""
    input_bytes, inside_bytes = mlp_block_bytes(batch, width, hidden, bytes_per_value)
    kept = checkpointed_activation_bytes(input_bytes, inside_bytes, blocks, checkpointed)
    return kept + mlp_backward_bytes(batch, width, hidden, bytes_per_value) + LOSS_BYTES
