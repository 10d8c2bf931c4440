"""What a rank's calls of torch.distributed were: each traced as it starts and when it returns, and read back.

The rank side (:mod:`.trial`) installs a :class:`Tracer` around the learner's function: every send, receive and
collective is appended to a file before it can block, so that a rank killed in a deadlock still says what it was
waiting for; an async call's handle (:class:`WatchedWork`) reports the learner's wait. The notebook side
(:mod:`.verdict`) reads those files once the ranks have ended: :func:`sent_elsewhere` says who a stuck rank's
peer sent to instead.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

TRACED = (
    "send", "recv", "isend", "irecv", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather",
    "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all_single", "barrier",
    "all_gather_single", "reduce_scatter_single",  # torch 2.14's names for the *_tensor pair
)  # fmt: skip
SENDS = {"send": "dst", "isend": "dst"}
RECEIVES = {"recv": "src", "irecv": "src"}
# isend and irecv are also compared by identity inside torch (P2POp checks its op is one of them)
IDENTITY_CHECKED = ("isend", "irecv")


def _first_tensor(kwargs: dict) -> torch.Tensor | None:
    """The tensor a call names first by keyword: ``tensor``, or the output of a collective called with keywords
    (FSDP2 calls ``reduce_scatter_tensor(output=..., input=...)``)."""
    return next((kwargs[key] for key in ("tensor", "output", "output_tensor") if key in kwargs), None)


class Tracer:
    """Every traced call this rank makes, appended to a file as it starts and when it returns."""

    def __init__(self, path: Path):
        self.path = path
        self.calls: list[dict] = []
        self.inside = False  # torch's send is its isend waited on: only the learner's own call is traced
        self.case = -1  # the index of the case running, set by Trial.case
        self.watch_waits = False  # an async call's handle reports the learner's wait (a trial that needs it says so)
        self.batching = False  # inside dist.batch_isend_irecv, whose requests are watched as a batch
        self.in_flight: dict[int, tuple[torch.Tensor, int]] = {}  # call -> (its tensor, its version at launch)
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (closed by the rank's exit)

    def record(self, op: str, args: tuple, kwargs: dict) -> dict:
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(kwargs)
        call = {"op": op, "n": len(self.calls) + 1, "done": False, "case": self.case}
        if isinstance(tensor, torch.Tensor):
            call["bytes"] = tensor.numel() * tensor.element_size()
            # what the call reads or writes: a received segment lands in `tensor` itself or in a copy of it
            call["storage"] = tensor.untyped_storage().data_ptr()
        reduce_op = kwargs.get("op", args[1] if op == "all_reduce" and len(args) > 1 else None)
        if op == "all_reduce" and reduce_op is not None:
            call["reduce_op"] = getattr(reduce_op, "name", str(reduce_op))  # ReduceOp.AVG -> "AVG"
        peer_key = SENDS.get(op) or RECEIVES.get(op)
        if peer_key:
            peer = kwargs.get(peer_key, args[1] if len(args) > 1 else None)
            if peer is None:
                peer = kwargs.get(f"group_{peer_key}")
            call["peer"] = peer
        self.calls.append(call)
        self.file.write(json.dumps(call) + "\n")
        return call

    def finish(self, call: dict) -> None:
        call["done"] = True
        self.file.write(json.dumps({"n": call["n"], "done": True}) + "\n")

    def waited(self, call: dict, done: bool) -> None:
        """The learner waited for an async ``call`` (``done``: it has returned), or took its future to wait on.
        A tensor the learner changed in place between the launch and this wait is marked ``changed_in_flight``:
        torch's collectives never bump a tensor's version, so only the learner's own in-place ops (``/=``) do."""
        call["waited"] = True
        launched = self.in_flight.pop(call["n"], None)
        if launched is not None and launched[0]._version != launched[1]:
            call["changed_in_flight"] = True
        if done and not call["done"]:
            self.finish(call)

    def watch(self, result, calls: list[dict]):
        """``result``, the handle of the async ``calls``, wrapped to report the learner's wait to each of them."""
        for call in calls:
            call["watched"] = True

        def waited(done: bool) -> None:
            for call in calls:
                self.waited(call, done)

        return WatchedWork(result, waited)

    def bytes_sent(self, since: int = 0) -> int:
        sent = 0
        for call in self.calls[since:]:
            if call["op"] in SENDS:
                sent += call.get("bytes", 0)
        return sent

    def ops(self, since: int = 0) -> list[str]:
        return [call["op"] for call in self.calls[since:]]

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap torch.distributed's calls for the duration; the originals come back afterwards."""
        import torch.distributed.distributed_c10d as c10d

        originals = {}
        for op in TRACED:
            original = getattr(dist, op, None)
            if original is None:
                continue
            originals[op] = original
            wrapped = self._wrap(op, original)
            setattr(dist, op, wrapped)
            if op in IDENTITY_CHECKED:
                setattr(c10d, op, wrapped)
        batch = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._wrap_batch(batch)
        try:
            yield
        finally:
            dist.batch_isend_irecv = batch
            for op, original in originals.items():
                setattr(dist, op, original)
                if op in IDENTITY_CHECKED:
                    setattr(c10d, op, original)

    def _wrap(self, op: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def traced(*args, **kwargs):
            if self.inside:
                return original(*args, **kwargs)
            call = self.record(op, args, kwargs)
            self.inside = True
            try:
                result = original(*args, **kwargs)
            finally:
                self.inside = False
            if op not in ("isend", "irecv") and not kwargs.get("async_op"):
                self.finish(call)
            elif self.watch_waits and isinstance(result, dist.Work) and not self.batching:
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
                if isinstance(tensor, torch.Tensor):
                    self.in_flight[call["n"]] = (tensor, tensor._version)
                result = self.watch(result, [call])
            return result

        return traced

    def _wrap_batch(self, original: Callable) -> Callable:
        """dist.batch_isend_irecv, whose sends and receives are traced one by one; with ``watch_waits``, its
        requests report the learner's waits: one request per op (gloo), or one for the whole batch (NCCL
        coalesces it), which then stands for every op in it."""

        @functools.wraps(original)
        def traced(p2p_op_list):
            since = len(self.calls)
            self.batching = True
            try:
                requests = original(p2p_op_list)
            finally:
                self.batching = False
            if not self.watch_waits or not isinstance(requests, list):
                return requests
            calls = [c for c in self.calls[since:] if c["op"] in ("isend", "irecv")]
            if len(requests) == len(calls):
                return [self.watch(r, [c]) for r, c in zip(requests, calls)]
            return [self.watch(r, calls) for r in requests]

        return traced


class WatchedWork:
    """The handle an async call returned, which tells the tracer when the learner waits for it. Whether an
    all-reduce was ever waited for cannot be read from its values: on an idle machine gloo often finishes it
    before anything looks, so an answer that never waits would pass or fail by chance. Everything else is the
    handle's own."""

    def __init__(self, work: dist.Work, on_wait: Callable[[bool], None]):
        self._work, self._on_wait = work, on_wait

    def wait(self, *args, **kwargs):
        finished = self._work.wait(*args, **kwargs)
        self._on_wait(True)
        return finished

    def is_completed(self) -> bool:
        completed = self._work.is_completed()
        if completed:  # a learner's loop that polls until it is done has waited
            self._on_wait(True)
        return completed

    def get_future(self):
        self._on_wait(False)  # what waits on the future is the learner's own code
        return self._work.get_future()

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _posted(calls: list[dict], ops: dict, peer: int) -> int:
    return sum(1 for c in calls if c["op"] in ops and c.get("peer") == peer)


def sent_elsewhere(traces: list[list[dict]], rank: int, call: dict | None) -> str:
    """Read from every rank's trace (the grader's, once the ranks have ended): when ``call``, the send or receive
    ``rank`` waits in, names a peer that posted no message for it but one for another rank that no receive takes
    (or a receive from another rank that nothing fills), that, said."""
    if call is None or call.get("peer") is None or not 0 <= call["peer"] < len(traces):
        return ""
    peer, receiving = call["peer"], call["op"] in RECEIVES
    mine, theirs = (RECEIVES, SENDS) if receiving else (SENDS, RECEIVES)
    if _posted(traces[peer], theirs, rank) >= _posted(traces[rank], mine, peer):
        return ""  # the peer posted its half
    others = []
    for c in traces[peer]:
        other = c.get("peer")
        if c["op"] in theirs and other not in (None, rank) and 0 <= other < len(traces) and other not in others:
            if _posted(traces[peer], theirs, other) > _posted(traces[other], mine, peer):
                others.append(other)
    if not others:
        return ""
    listed = " and ".join(f"rank {k}" for k in others)
    if receiving:
        return f"; rank {peer} sent to {listed}, not to rank {rank}"
    return f"; rank {peer} receives from {listed}, not from rank {rank}"
