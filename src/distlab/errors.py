"""Errors a user can fix, said in one line: :class:`DistlabError`, and :func:`run_main`, which every
entry point runs its ``main`` in.

A collective whose peers never matched it (a timeout, a peer gone, a mismatch that
TORCH_DISTRIBUTED_DEBUG=DETAIL found) becomes one line per rank: which rank, in which collective
(:func:`collective_site`, or its traceback), torch's reason (:func:`torch_says`); rank 0 adds the fix
(:data:`COLLECTIVE_FIXES`), once every rank has reported through torchrun's store (:class:`FailureReports`).
"""

from __future__ import annotations

import gc
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError: 2.5+


class DistlabError(RuntimeError):
    """A mistake in how distlab was called; its message says what to do.

    Most such mistakes are the same on every rank, so only rank 0 reports
    them; ``every_rank=True`` marks one that only some ranks hit.
    """

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


@dataclass
class FailureReports:
    """Where the ranks of a job whose collectives failed say what each saw, through torchrun's store (which
    outlives the process group). torchrun stops every rank as soon as one exits: rank 0 leaves last, once
    every rank has written its line or its peers' collectives must have timed out too, and names the cause."""

    store: Any
    rank: int
    world_size: int
    timeout_s: float

    def add(self, kind: str) -> None:
        """Count this rank's failure under its kind (a key of :data:`COLLECTIVE_FIXES`)."""
        try:
            self.store.add(f"distlab/failed/{kind}", 1)
        except Exception:  # the store is gone with its host: nobody is left to tell
            pass

    def finished(self) -> None:
        """Rank 0 ended well: a rank still reporting a failure need not wait for it."""
        try:
            self.store.set("distlab/finished", "1")
        except Exception:
            pass

    def _counts(self) -> dict[str, int] | None:
        try:
            return {kind: self.store.add(f"distlab/failed/{kind}", 0) for kind in COLLECTIVE_FIXES}
        except Exception:
            return None

    def _rank0_finished(self) -> bool:
        try:
            return self.store.check(["distlab/finished"])
        except Exception:
            return True

    def wait(self) -> list[str]:
        """Rank 0: the kinds the ranks reported, once all have, or after the collectives' timeout (10 s at
        most: ranks that fail together do so within a second or two, and a rank stuck outside any collective
        must not hold the job for another whole timeout). Other ranks: wait for torchrun to stop them when
        rank 0 leaves, at most as long; return nothing."""
        deadline = time.monotonic() + min(self.timeout_s, 10.0) + 2.0
        while time.monotonic() < deadline:
            if self.rank != 0:
                if self._rank0_finished():
                    return []
            else:
                counts = self._counts()
                if counts is None or sum(counts.values()) >= self.world_size:
                    break
            time.sleep(0.1)
        return [kind for kind, count in (self._counts() or {}).items() if count]


@contextmanager
def collective_site(where: str, fix: str = "", this_rank: str = "") -> Iterator[None]:
    """Name the collectives run inside, for the line :func:`run_main` writes if their peers never match them.

    ``where`` says what this rank was doing ("the barrier after its loop"), ``fix`` what the user should
    change, ``this_rank`` what sets this rank apart ("3 batches"). The innermost site wins.
    """
    try:
        yield
    except Exception as err:
        if collective_failure(err) and not hasattr(err, "distlab_site"):
            err.distlab_site, err.distlab_fix, err.distlab_rank = where, fix, this_rank
        raise


_PEER_FAILURE = re.compile(
    r"Timed out waiting|Connection (closed|reset) by peer|failed to pass monitoredBarrier|"
    r"Detected mismatch between collectives|Broken pipe|Application timeout caused pair closure",
    re.IGNORECASE,
)


def collective_failure(err: BaseException) -> str | None:
    """What went wrong in a collective, or None: ``mismatch`` (TORCH_DISTRIBUTED_DEBUG=DETAIL compared the
    ranks' calls), ``timeout`` (this rank waited its whole timeout), ``peer`` (a peer left or broke the
    connection). torch raises gloo's failures as a plain RuntimeError, NCCL's and the store's as DistError."""
    text = str(err)
    if isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and _PEER_FAILURE.search(text)):
        if "Detected mismatch between collectives" in text:
            return "mismatch"
        return "timeout" if re.search(r"timed out|timeout", text, re.IGNORECASE) else "peer"
    return None


def _fingerprint(text: str) -> tuple[str, str]:
    """``CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[4], ...)`` -> ``ALLREDUCE [4] #2``,
    and the sequence number alone."""
    op, seq = re.search(r"OpType=(\w+)", text), re.search(r"SequenceNumber=(\d+)", text)
    shape = re.search(r"TensorShape=(\[[^\]]*\])", text)
    return " ".join(x for x in (op and op[1], shape and shape[1], seq and f"#{seq[1]}") if x), seq and seq[1]


def torch_says(err: BaseException) -> str:
    """torch's reason, short: its first sentence without source paths or ports; for a mismatch
    TORCH_DISTRIBUTED_DEBUG=DETAIL found, the collective each rank was in."""
    text = str(err).strip()
    if "Detected mismatch between collectives" in text:
        mine, _, theirs = text.partition(", but Rank ")
        (me, my_seq), (peer, peer_seq) = _fingerprint(mine), _fingerprint(theirs.split("Collectives differ")[0])
        rank, other = re.search(r"Rank (\d+) is running", mine), re.match(r"(\d+)", theirs)
        # A peer at another position in the sequence shows up as the check's own operation (a GATHER, a REDUCE),
        # not the call its code made: only a peer at the same position is named; its own line says the rest.
        peer = f"rank {other and other[1]} in {peer}" if peer_seq == my_seq else "the other rank in another collective"
        return f"TORCH_DISTRIBUTED_DEBUG=DETAIL: rank {rank and rank[1]} is in {me}, {peer}"
    if "Application timeout caused pair closure" in text:  # gloo's words on the rank whose peer gave up first
        return "a peer timed out and closed the connection"
    first = text.splitlines()[0] if text else type(err).__name__
    first = re.sub(r"^(\[[^\]]*\]:?\s*)+|\s*\[[^\]]*\]:\d+", "", first)  # no source path, no address
    return first.split(". ")[0]


def _site_in_traceback(err: BaseException) -> str:
    """The collective ``err`` came out of, from its traceback: the torch.distributed function the user's
    code called (or the first torch function, e.g. ``backward``), and the line that called it."""
    frames = traceback.extract_tb(err.__traceback__)
    in_torch = [f.filename.startswith(os.path.dirname(torch.__file__)) for f in frames]
    first = in_torch.index(True) if True in in_torch else len(frames)
    caller = frames[first - 1] if first > 0 else None
    called = [
        f.name
        for f in frames[first:]
        if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_") and f.name != "wrapper"
    ]
    name = called[0] if called else frames[first].name if first < len(frames) else "a collective"
    return f"{name}()" + (f" at {os.path.basename(caller.filename)}:{caller.lineno}" if caller else "")


# What to change, by the kind of failure; causes come before the symptoms they produce on other ranks.
COLLECTIVE_FIXES = {
    "mismatch": "every rank must call the same collectives, in the same order, on tensors of the same shape: "
    "make the code path that differs run on every rank",
    "timeout": "a rank waited in a collective its peers never called (one skipped it, called another, or is "
    "still busy): rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to see which, or raise --timeout-s for a slow rank",
    "peer": "another rank failed or left first: read its error above",
}


def report_collective_failure(err: BaseException, kind: str, rank: str, say) -> None:
    """One line for this rank (which collective, torch's reason); rank 0 adds the fix."""
    who = f"rank {rank} ({err.distlab_rank})" if getattr(err, "distlab_rank", "") else f"rank {rank}"
    where = getattr(err, "distlab_site", None) or _site_in_traceback(err)
    say(f"distlab: {who} stopped in {where}, which its peers never matched ({torch_says(err)})")
    reports = getattr(err, "distlab_reports", None)
    kinds = [kind]
    if reports is not None:
        reports.add(kind)
        kinds += reports.wait()
    if rank == "0":
        # COLLECTIVE_FIXES lists causes before symptoms: a rank that saw its peer leave is not the cause.
        cause = next(k for k in COLLECTIVE_FIXES if k in kinds)
        say(f"distlab: error: {getattr(err, 'distlab_fix', '') or COLLECTIVE_FIXES[cause]}")


SIGTERM_GRACE_S = 2.0
"""How long a rank torchrun stops with SIGTERM may take to end: long enough to say where it was."""

QUIET_RANK_WAIT_S = 30.0
"""How long a rank that leaves a mistake for rank 0 to report waits for it to. torchrun stops every rank the moment
one fails: a quiet rank that left first stopped rank 0 before it said anything (it was still importing, under load
in CI). Once rank 0 has said it and left, torchrun's SIGTERM ends the wait (after :data:`SIGTERM_GRACE_S`)."""


@contextmanager
def _grace_after_sigterm(seconds: float) -> Iterator[None]:
    """torchrun stops the other ranks with SIGTERM the moment one fails, and the others are then often failing
    in the same collective a moment later, about to say where they were: SIGTERM's default would end them
    before they do. Here the signal only starts a clock. Python's own C-level handler writes it to a pipe at
    once, even while the main thread is blocked inside a collective; a thread waiting on the pipe ends the
    process ``seconds`` later, as SIGTERM would have (exit status 143), unless it has ended by then."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)

    def watch() -> None:
        while chunk := os.read(read_end, 64):  # one byte per signal caught, its number
            if signal.SIGTERM in chunk:
                time.sleep(seconds)
                os._exit(128 + signal.SIGTERM)
        os.close(read_end)

    previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    previous_fd = signal.set_wakeup_fd(write_end)
    threading.Thread(target=watch, name="distlab-sigterm-grace", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous_handler)
        os.close(write_end)  # the watcher reads the end of the pipe and returns


KNOWN_TORCH_ERRORS = {
    "No backend type associated with device type cpu": "a CPU tensor went into a collective of a group that has "
    "NCCL only: create the group with a gloo leg (backend='cpu:gloo,cuda:nccl', as distlab.runtime.distributed "
    "does), or move the tensor to the GPU first",
}
"""torch's errors whose cause is known, by a phrase of their message: the fix, said in one line."""


def run_main(main, argv=None) -> None:
    """Call ``main(argv)`` and turn the errors a user can fix into one line.

    A :class:`DistlabError` is the user's to fix. A collective whose peers never matched it (a timeout, a
    peer gone, a mismatch found by TORCH_DISTRIBUTED_DEBUG=DETAIL) is one line per rank: which rank, in
    which collective, and torch's reason; rank 0 adds what to change.

    It is a process's main, as its SIGTERM handling is: what existed before it (the imports) is frozen for the
    process's remaining collections (``gc.freeze``), which then walk only what ``main`` made.
    """
    rank = os.environ.get("RANK", "0")

    def say(line: str) -> None:
        sys.stderr.write(line + "\n")  # one write: lines of concurrent ranks stay whole
        sys.stderr.flush()

    # What the imports made (torch's ~330,000 objects) moves to the collector's permanent generation: the
    # collections after main (the group's teardown, the one below, the interpreter's at exit) then walk what main
    # made, about 0.3 s less each on this CPU; what main makes is collected as before.
    gc.freeze()
    with _grace_after_sigterm(SIGTERM_GRACE_S):  # the lines below get said even if torchrun is stopping us
        try:
            main(argv)
        except DistlabError as err:
            if rank == "0" or err.every_rank:
                say(f"distlab: error: {err}" if rank == "0" else f"distlab: error on rank {rank}: {err}")
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                if rank == "0":
                    # The other ranks make the same mistake a moment later and leave quietly; rank 0 leaving first
                    # would break their connections while they are still setting up, and each would say so.
                    time.sleep(1.0)
                elif not err.every_rank:
                    time.sleep(QUIET_RANK_WAIT_S)  # rank 0 says it and leaves; torchrun's SIGTERM ends this wait
            raise SystemExit(2) from None
        except _OUT_OF_MEMORY as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
            say(
                f"distlab: rank {rank} ran out of device memory ({first_line[:160]}): shard the model "
                "(--strategy fsdp or zero3), add --activation-checkpointing, or use a smaller --batch-size"
            )
            raise SystemExit(4) from None
        except KeyboardInterrupt:
            say(f"distlab: rank {rank} interrupted")
            raise SystemExit(130) from None
        except Exception as err:
            kind = collective_failure(err)
            fix = next((f for phrase, f in KNOWN_TORCH_ERRORS.items() if phrase in str(err)), None)
            if kind is None and fix is not None:
                say(f"distlab: error on rank {rank}: {str(err).strip().splitlines()[0][:200]}: {fix}")
                raise SystemExit(1) from None
            if kind is None:
                raise
            report_collective_failure(err, kind, rank, say)
            raise SystemExit(3) from None
        finally:
            # Once the lines are out: what a failed body left in reference cycles (an FSDP model, which holds the
            # group distributed() destroyed) goes now, while Python runs, not at interpreter shutdown.
            gc.collect()
