"""The pinned-memory chapter's answers, by the rules of the course's stream model.

Written for reading: :class:`distlab.predict.streams.StreamModel` runs the same rules, with a host thread, copy
engines, streams and events (``copy_h2d`` and ``copy_d2h`` are the copies below).
"""


def h2d_copy_time(nbytes: int, pinned: bool, link_GBps: float, stage_GBps: float, chunk_bytes: int = 2 << 20) -> float:
    link, stage = link_GBps * 1e9, stage_GBps * 1e9
    if pinned:  # the copy engine reads the source directly
        return nbytes / link
    staged = sent = 0.0  # when the host has staged, and the engine has sent, the chunks so far
    free = [0.0, 0.0]  # when each of the two staging buffers may be filled again
    for index, offset in enumerate(range(0, nbytes, chunk_bytes)):
        chunk = min(chunk_bytes, nbytes - offset)
        staged = max(staged, free[index % 2]) + chunk / stage  # wait for a free buffer, then copy into it
        sent = max(sent, staged) + chunk / link  # sent once staged and once the engine is done with the last one
        free[index % 2] = sent
    return sent


def d2h_read_sees_result(pinned: bool, non_blocking: bool, wait: str) -> bool:
    if not (pinned and non_blocking):
        return True  # blocking: PyTorch synchronizes; to pageable memory: copied out before the call returns
    # into pinned memory the call only queues the copy: the host must wait for a point after it
    return wait in ("synchronize", "event_after_copy")
