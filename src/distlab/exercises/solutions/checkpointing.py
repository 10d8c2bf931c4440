"""The checkpointing chapter's answer: the activation bytes held at the peak, with and without checkpointing each
block. Written for reading: the library's version is
:func:`distlab.predict.checkpointing.checkpointed_activation_bytes`.
"""


def checkpointed_activation_bytes(input_bytes: int, inside_bytes: int, blocks: int, checkpointed: bool) -> int:
    if not checkpointed:  # every block keeps its input and its inside until its own backward
        return blocks * (input_bytes + inside_bytes)
    # each block keeps only its input; backward reruns one block at a time, so one inside is held at the peak
    return blocks * input_bytes + inside_bytes
