"""Typical wrong answers to the checkpointing chapter's exercise, each with the mistake its check must name."""


def forgot_block_inputs(input_bytes, inside_bytes, blocks, checkpointed):
    return inside_bytes if checkpointed else blocks * (input_bytes + inside_bytes)  # only the recomputed block


def forgot_recomputed_block(input_bytes, inside_bytes, blocks, checkpointed):
    return blocks * input_bytes if checkpointed else blocks * (input_bytes + inside_bytes)  # only the kept inputs


def recomputed_every_block(input_bytes, inside_bytes, blocks, checkpointed):
    return blocks * (input_bytes + inside_bytes)  # as if backward held every block's recompute at once


def recomputed_block_input_twice(input_bytes, inside_bytes, blocks, checkpointed):
    if checkpointed:
        return blocks * input_bytes + input_bytes + inside_bytes  # the recomputed block's input counted again
    return blocks * (input_bytes + inside_bytes)


MISTAKES = [
    ("checkpointed_activation_bytes", forgot_block_inputs, "forgot_block_inputs", "got 524,288 B"),
    ("checkpointed_activation_bytes", forgot_recomputed_block, "forgot_recomputed_block", "4 blocks checkpointed"),
    ("checkpointed_activation_bytes", recomputed_every_block, "recomputed_every_block", "expected 786,432 B"),
    ("checkpointed_activation_bytes", recomputed_block_input_twice, "recomputed_block_input_twice", "got 851,968 B"),
]
