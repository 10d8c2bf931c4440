"""torch's Flight Recorder, read: which collective each rank called at each sequence number, and the first one
at which the ranks disagree.

torch keeps each rank's last collectives in a ring buffer, gloo's as well as NCCL's: the process group, the
collective's sequence number in that group, its name (``gloo:all_reduce``), the sizes of its tensors, and the
Python stack that called it. In torch 2.14 it keeps 2,000 (``TORCH_FR_BUFFER_SIZE``, ``FlightRecorder.hpp``; 0
turns it off; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is the older name). NCCL's watchdog writes the buffer to a file
when a collective times out (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, files named ``TORCH_FR_DUMP_TEMP_FILE`` + rank);
with gloo a rank writes it itself (:func:`write_dump`; on failure, :func:`dumped_on_failure`).

torch's own analyzer (``python -m torch.distributed.flight_recorder.fr_trace DIR -p rank_``) stops on gloo's
dumps with ``KeyError: ('0', 0)``: it files each rank's groups under the names the dump's ``pg_config`` gives
them, then looks each entry's group up by the name the entry gives (``components/builder.py``,
``build_collectives``); a gloo dump lists its one group under ``''`` and its entries name it ``'0'``.
:func:`first_mismatch` needs no ``pg_config``: it lines the ranks' calls up by (group, sequence number).
"""

from __future__ import annotations

import json
import pickle
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DUMP_PREFIX = "rank_"
"""A dump's file name before its rank (``TORCH_FR_DUMP_TEMP_FILE`` sets the one NCCL's watchdog writes)."""


@dataclass(frozen=True)
class Call:
    """One collective one rank called, as its Flight Recorder kept it."""

    rank: int
    group: str
    """The process group's name: ``'0'`` is the default group."""
    sequence: int
    """Its position among this rank's collectives in ``group``, from 1: the number the ranks' calls pair by."""
    collective: str
    """``all_reduce``, ``broadcast``, ``barrier``...: torch's name without the backend."""
    sizes: tuple[tuple[int, ...], ...]
    """Each input tensor's shape."""
    where: str = ""
    """The line that called it, outside torch (``failures.py:57 in mismatch``)."""

    def describe(self) -> str:
        shapes = ", ".join(str(list(size)) for size in self.sizes)
        return f"{self.collective}({shapes})" + (f" at {self.where}" if self.where else "")


def _caller(frames: list[dict]) -> str:
    """The innermost frame outside torch: the line of the user's code that made the call."""
    for frame in frames:
        if "/torch/" not in "/" + frame["filename"]:  # a path under torch/, whole or cut to torch/...
            return f"{Path(frame['filename']).name}:{frame['line']} in {frame['name']}"
    return ""


def calls_in(dump: dict, rank: int) -> list[Call]:
    """A dump's collectives (point-to-point sends and receives left out: they pair by another count)."""
    return [
        Call(
            rank=rank,
            group=str(entry["process_group"][0]),
            sequence=int(entry["collective_seq_id"]),
            collective=entry["profiling_name"].split(":")[-1],
            sizes=tuple(tuple(size) for size in entry["input_sizes"]),
            where=_caller(entry.get("frames", [])),
        )
        for entry in dump["entries"]
        if not entry.get("is_p2p")
    ]


def read_dump(path: Path | str) -> list[Call]:
    """One rank's dump: torch's pickle, or the same dictionary as JSON; its name ends in its rank (``rank_1``)."""
    path = Path(path)
    raw = path.read_bytes()
    dump = json.loads(raw) if path.suffix == ".json" else pickle.loads(raw)
    return calls_in(dump, _rank_of(path))


def _rank_of(path: Path) -> int:
    return int(re.search(r"(\d+)$", path.name.split(".")[0]).group(1))


def read_dumps(folder: Path | str, prefix: str = DUMP_PREFIX) -> dict[int, list[Call]]:
    """Every rank's dump in a folder, by rank (``prefix``: the file names before the rank)."""
    return {_rank_of(path): read_dump(path) for path in sorted(Path(folder).glob(f"{prefix}*"))}


def dump_now() -> dict:
    """This rank's Flight Recorder buffer, as torch would write it to a file."""
    from torch._C._distributed_c10d import _dump_fr_trace  # the gloo and NCCL recorder, torch >= 2.8

    return pickle.loads(_dump_fr_trace())


def write_dump(folder: Path | str, rank: int) -> Path:
    """Write this rank's buffer as ``folder/rank_<rank>``, in torch's format (a pickle)."""
    path = Path(folder) / f"{DUMP_PREFIX}{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(dump_now()))
    return path


@contextmanager
def dumped_on_failure(folder: Path | str, rank: int) -> Iterator[None]:
    """Write this rank's dump if the code inside raises (a collective that timed out), then let the error go on."""
    try:
        yield
    except Exception:
        write_dump(folder, rank)
        raise


@dataclass(frozen=True)
class Mismatch:
    """The first sequence number at which the ranks' calls differ, and the rank whose call is the odd one."""

    group: str
    sequence: int
    rank: int
    """The rank that called something else there, or nothing (its last call came before)."""
    calls: dict[int, Call | None]
    """Every rank's call at that sequence number (None: it never called one)."""

    @property
    def collective(self) -> str | None:
        call = self.calls[self.rank]
        return call.collective if call else None

    def describe(self) -> str:
        odd = self.calls[self.rank]
        others = ", ".join(
            f"rank {rank} called {call.describe()}"
            for rank, call in sorted(self.calls.items())
            if call and rank != self.rank
        )
        did = f"called {odd.describe()}" if odd else "never called it"
        return f"collective #{self.sequence} of group {self.group!r}: rank {self.rank} {did}, where {others}"


def _signature(call: Call) -> tuple[str, tuple]:
    return call.collective, call.sizes


def lined_up(dumps: dict[int, list[Call]]) -> dict[str, dict[int, dict[int, Call | None]]]:
    """group -> sequence number -> rank -> its call there (None: it has none), for the sequence numbers every
    rank's buffer still covers (a ring buffer drops its oldest calls, and not as many on every rank)."""
    ranks = sorted(dumps)
    by_group: dict[str, dict[int, dict[int, Call]]] = {}
    for rank, calls in dumps.items():
        for call in calls:
            by_group.setdefault(call.group, {}).setdefault(call.sequence, {})[rank] = call
    table = {}
    for group, by_sequence in by_group.items():
        members = [rank for rank in ranks if any(rank in calls for calls in by_sequence.values())]
        covered = max(min(s for s, calls in by_sequence.items() if rank in calls) for rank in members)
        table[group] = {
            sequence: {rank: by_sequence[sequence].get(rank) for rank in members}
            for sequence in sorted(by_sequence)
            if sequence >= covered
        }
    return table


def first_mismatch(dumps: dict[int, list[Call]]) -> Mismatch | None:
    """The first sequence number at which the ranks' calls differ (in the default group first), or None.

    A rank whose calls stop before a number the others reached never called that collective: the others wait
    for it. Otherwise the odd rank is the one whose call (collective and sizes) differs from the one most ranks
    made; when the ranks split evenly, the lowest rank's call is the reference.
    """
    found = []
    for group, by_sequence in lined_up(dumps).items():
        last = {
            rank: max(s for s, calls in by_sequence.items() if calls[rank]) for rank in next(iter(by_sequence.values()))
        }
        for sequence, calls in by_sequence.items():
            missing = [rank for rank, call in calls.items() if call is None and last[rank] < sequence]
            if missing:
                found.append(Mismatch(group, sequence, missing[0], calls))
                break
            present = [rank for rank, call in calls.items() if call is not None]
            counts = Counter(_signature(calls[rank]) for rank in present)
            if len(counts) > 1:
                most = max(counts.values())
                usual = next(_signature(calls[r]) for r in present if counts[_signature(calls[r])] == most)
                odd = next(rank for rank in present if _signature(calls[rank]) != usual)
                found.append(Mismatch(group, sequence, odd, calls))
                break
    return min(found, key=lambda m: (m.group != "0", m.sequence), default=None)  # the default group's first
