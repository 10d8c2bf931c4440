"""The pinned-memory chapter's exercises, graded against the course's stream model (:mod:`distlab.predict.streams`).

No CPU can run CUDA, so both exercises predict what the model, which follows CUDA's documented rules, says: how
long a blocking host-to-device copy takes from pinned and from pageable memory (the staging pipeline), and
whether the host's read of a device-to-host copy sees the copied data (the ``non_blocking`` hazard). Each runs
on one rank, on a grid of inputs; a wrong answer is compared with what each typical mistake would give.
"""

from __future__ import annotations

from ..predict.stream_scenarios import single_copy
from ..predict.streams import Inputs, StreamModel, pcie_GBps
from .catalog import Exercise
from .trial import Trial, numbers_close, size_label

MiB = 1 << 20
LINKS = (
    (pcie_GBps(3), 5.0, 2 * MiB, "PCIe 3.0 x16, staging at 5 GB/s"),
    (pcie_GBps(3), 30.0, 2 * MiB, "PCIe 3.0 x16, staging at 30 GB/s"),
    (pcie_GBps(5), 12.0, 4 * MiB, "PCIe 5.0 x16, staging at 12 GB/s, 4 MiB buffers"),
)
SIZES = (64 << 10, 5 * MiB, 64 * MiB)


def model_copy_time(nbytes: int, pinned: bool, link: float, stage: float, chunk: int) -> float:
    """The model's blocking copy on an idle GPU, with no call overhead: the time the call blocks the host."""
    inputs = Inputs(link_GBps=link, stage_GBps=stage, chunk_bytes=chunk)
    return single_copy(inputs, nbytes, pinned=pinned, non_blocking=False).host_blocked_s


def _copy_mistakes(nbytes: int, pinned: bool, link: float, stage: float, chunk: int) -> list[tuple[str, float]]:
    right = model_copy_time(nbytes, pinned, link, stage, chunk)
    wrong = [("gibibytes", right * 1e9 / 2**30)]
    if pinned:
        return wrong + [("pinned_staged", model_copy_time(nbytes, False, link, stage, chunk))]
    whole_chunks = nbytes // chunk * chunk  # the last, partial chunk left out
    return wrong + [
        ("partial_chunk", model_copy_time(whole_chunks, pinned, link, stage, chunk) if whole_chunks else 0.0),
        ("pageable_as_pinned", nbytes / (link * 1e9)),
        ("stage_then_send", nbytes / (stage * 1e9) + nbytes / (link * 1e9)),
        ("no_pipeline_fill", nbytes / (min(stage, link) * 1e9)),
    ]


def copy_time_trial(t: Trial, fn) -> None:
    for link, stage, chunk, label in LINKS:
        with t.case(label):
            for pinned in (True, False):
                for nbytes in SIZES:
                    expected = model_copy_time(nbytes, pinned, link, stage, chunk)
                    got = t.call(fn, nbytes, pinned, link, stage, chunk)
                    if numbers_close(got, expected):
                        continue
                    mistake = next(
                        (k for k, v in _copy_mistakes(nbytes, pinned, link, stage, chunk) if numbers_close(got, v)),
                        None,
                    )
                    shown = f"{got * 1e3:.6g} ms" if isinstance(got, (int, float)) else repr(got)
                    staging = "" if pinned else f" ({-(-nbytes // chunk)} chunk(s) of at most {size_label(chunk)})"
                    t.fail(
                        "copy time",
                        f"{size_label(nbytes)} from {'pinned' if pinned else 'pageable'} memory: got "
                        f"{shown}, the model says {expected * 1e3:.6g} ms{staging}",
                        mistake,
                    )
    t.note("a pageable copy is a pipeline: the host stages chunk k+1 while the copy engine sends chunk k")


WAITS = ("none", "synchronize", "event_after_copy", "event_before_copy")
HAZARD_INPUTS = Inputs(link_GBps=pcie_GBps(3), stage_GBps=5.0, api_s=5e-6)
HAZARD_BYTES, COMPUTE_S = 16 * MiB, 6e-3


def model_read(pinned: bool, non_blocking: bool, wait: str):
    """A kernel writes a result; the host copies it back, waits as told, and reads its buffer: (read, copy)."""
    m = StreamModel(HAZARD_INPUTS)
    m.kernel("compute result", COMPUTE_S)
    if wait == "event_before_copy":
        m.record("event")
    copy = m.copy_d2h("copy to host", HAZARD_BYTES, pinned=pinned, non_blocking=non_blocking, into="host buffer")
    if wait == "event_after_copy":
        m.record("event")
    if wait.startswith("event"):
        m.event_synchronize("event")
    if wait == "synchronize":
        m.synchronize()
    return m.read("host buffer"), copy


def _hazard_mistake(pinned: bool, non_blocking: bool, wait: str, said_safe: bool) -> str | None:
    if said_safe:
        return "event_before_copy" if wait == "event_before_copy" else "pinned_non_blocking_safe"
    if not non_blocking:
        return "blocking_stale"
    return "pageable_async" if not pinned else None


def read_hazard_trial(t: Trial, fn) -> None:
    for pinned, non_blocking in ((False, False), (False, True), (True, False), (True, True)):
        with t.case(f"{'pinned' if pinned else 'pageable'} memory, non_blocking={non_blocking}"):
            for wait in WAITS:
                read, copy = model_read(pinned, non_blocking, wait)
                got = t.call(fn, pinned, non_blocking, wait)
                if not isinstance(got, bool):
                    t.fail("answer", f"wait={wait!r}: it returned {got!r}, not True or False", None)
                if got == (not read.stale):
                    continue
                t.fail(
                    "answer",
                    f"wait={wait!r}: you said the read {'sees' if got else 'misses'} the copied data; in "
                    f"the model the copy ends at {copy.end * 1e3:.3f} ms and the host reads at "
                    f"{read.time * 1e3:.3f} ms, seeing {read.saw!r}",
                    _hazard_mistake(pinned, non_blocking, wait, got),
                )
    t.note("only pinned memory with non_blocking=True returns before the data has arrived")


EXERCISES = (
    Exercise(
        name="h2d_copy_time",
        page="pinned_memory",
        task="Return how long a blocking host-to-device copy of `nbytes` holds the host, by the stream model: from "
        "pinned memory the copy engine reads at `link_GBps`; from pageable memory the host stages `chunk_bytes` "
        "at a time into one of two pinned buffers at `stage_GBps`, and the engine sends each staged chunk in turn "
        "(a buffer is filled again once its chunk has been sent). GB is 1e9 bytes; no call overhead.",
        signature="def h2d_copy_time(nbytes: int, pinned: bool, link_GBps: float, stage_GBps: float, "
        "chunk_bytes: int = 2 << 20) -> float:",
        solution="pinned.h2d_copy_time",
        library="distlab.predict.streams.StreamModel.copy_h2d",
        trial=copy_time_trial,
        ranks=1,
        mistakes={
            "partial_chunk": "the last chunk is partial when chunk_bytes does not divide nbytes, and it is staged and "
            "sent too: ceil(nbytes / chunk_bytes) chunks, the last one nbytes - (k - 1) * chunk_bytes long.",
            "pageable_as_pinned": "from pageable memory the DMA engine cannot read the source: the host first "
            "copies each chunk into a pinned staging buffer, at the staging rate.",
            "stage_then_send": "staging and sending overlap: with two buffers the host stages chunk k+1 while the "
            "engine sends chunk k, so the slower of the two sets the pace, not their sum.",
            "no_pipeline_fill": "close, but a pipeline fills and drains. Nothing is sent before the first chunk is "
            "staged, and the last chunk is sent after it is staged: walk the chunks one by one.",
            "gibibytes": "a GB/s here is 1e9 bytes per second, as link rates are quoted, not 2**30.",
            "pinned_staged": "from pinned memory nothing is staged: the copy engine reads the source directly, so "
            "the copy takes nbytes / link.",
        },
        pages=("labs/lab_pinned_memory",),
    ),
    Exercise(
        name="d2h_read_hazard",
        page="pinned_memory",
        task="A kernel computes a result; the host copies it into host memory (`pinned` or pageable, "
        "`non_blocking` or not), then waits as `wait` says ('none', 'synchronize', 'event_after_copy': an event "
        "recorded after the copy, synchronized; 'event_before_copy': one recorded before it), then reads the host "
        "buffer. Return True if the read sees the copied data.",
        signature="def d2h_read_sees_result(pinned: bool, non_blocking: bool, wait: str) -> bool:",
        solution="pinned.d2h_read_sees_result",
        library="distlab.predict.stream_scenarios.d2h_read_hazard",
        trial=read_hazard_trial,
        ranks=1,
        mistakes={
            "pinned_non_blocking_safe": "into pinned memory a non_blocking copy is only queued: the call returns "
            "before the bytes arrive, and the host reads the old contents, with no error.",
            "event_before_copy": "an event marks the point its stream had reached when it was recorded. One "
            "recorded before the copy completes before the copy even starts: record it after the copy.",
            "pageable_async": "into pageable memory the copy cannot be left to the GPU: the driver stages it "
            "through pinned buffers and the call returns only once the data is in place, non_blocking or not.",
            "blocking_stale": "without non_blocking PyTorch follows the copy with cudaStreamSynchronize: the call "
            "returns once the data has arrived.",
        },
    ),
)
