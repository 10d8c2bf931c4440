"""The profiling chapter's exercises, each run on one rank and graded on inputs drawn by hand to tell its typical
mistakes apart:

* ``exposed_communication_ms``: from one rank's profiled step, the communication nothing hid; interval arithmetic
  on events already sorted into lanes, against the library's :func:`distlab.measure.profile.step_time` (which the
  chapter runs on the traces of its own DDP and FSDP2 steps);
* ``memory_gaps``: from the tracker's split at a peak and the allocator's numbers, what holds the rest, against
  :func:`distlab.measure.allocator.memory_layers` (which the chapter runs on a committed GPU sweep).
"""

from __future__ import annotations

from ..measure.allocator import MIB, memory_layers
from ..measure.profile import COMMUNICATION, COMPUTE, busy, overlap_ms, step_time
from .catalog import Exercise
from .trial import Trial, numbers_close


def _event(lane: str, start: float, end: float, name: str) -> dict:
    return {"name": name, "lane": lane, "start_ms": start, "end_ms": end}


def _compute(start, end, name="aten::addmm"):
    return _event(COMPUTE, start, end, name)


def _communication(start, end, name="gloo:all_reduce"):
    return _event(COMMUNICATION, start, end, name)


STEPS = (
    (
        "a DDP step: backward ops nested in their parents, two buckets' all-reduces overlapping each other and "
        "running past backward, the optimizer, then a gap where neither lane ran",
        25.0,
        [
            _compute(0, 6, "aten::linear"),
            _compute(0.5, 5.5, "aten::addmm"),
            _compute(6, 9, "aten::mm"),
            _compute(9, 12, "aten::mm"),
            _compute(10, 11, "aten::sum"),
            _compute(12, 14, "aten::mm"),
            _communication(10, 16),
            _communication(13, 18),
            _compute(19, 21, "aten::add_"),
        ],
    ),
    (
        "an FSDP step, its events out of order: the first all-gather before any compute, a prefetch under the "
        "forward, the last reduce-scatter after backward",
        15.0,
        [
            _compute(8, 12, "aten::mm"),
            _communication(12, 15, "gloo:reduce_scatter"),
            _communication(0, 3, "gloo:all_gather"),
            _compute(3, 8, "aten::mm"),
            _communication(5, 7, "gloo:all_gather"),
        ],
    ),
    ("an all-reduce entirely under compute", 10.0, [_compute(0, 10), _communication(2, 5)]),
    ("a step with no communication", 4.0, [_compute(0, 1.5), _compute(2, 4)]),
)
"""(what it is, the step's length in ms, its events)."""


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _mistakes(step_ms: float, events: list[dict]) -> list[tuple[str, float]]:
    compute, communication = busy(events, COMPUTE), busy(events, COMMUNICATION)
    every_communication = [(e["start_ms"], e["end_ms"]) for e in events if e["lane"] == COMMUNICATION]
    every_compute = [(e["start_ms"], e["end_ms"]) for e in events if e["lane"] == COMPUTE]
    return [
        ("summed_durations", _length(every_communication)),
        ("communication_not_exposed", _length(communication)),
        ("busy_times_subtracted", _length(communication) - _length(compute)),
        (
            "overlapping_collectives_counted_twice",
            sum(_length([i]) - overlap_ms([i], compute) for i in every_communication),
        ),
        ("nested_ops_subtracted_twice", _length(communication) - overlap_ms(communication, every_compute)),
        ("idle_counted_as_communication", step_ms - _length(compute)),
    ]


def exposed_trial(t: Trial, fn) -> None:
    for label, step_ms, events in STEPS:
        with t.case(label):
            expected = step_time({"step_ms": step_ms, "events": events})["exposed_ms"]
            got = t.call(fn, {"step_ms": step_ms, "events": [dict(e) for e in events]})
            if numbers_close(got, expected):
                continue
            mistake = next((k for k, v in _mistakes(step_ms, events) if numbers_close(got, v)), None)
            shown = f"{got:g} ms" if isinstance(got, int | float) else repr(got)
            t.fail("exposed communication", f"got {shown}, expected {expected:g} ms", mistake)
    t.note("exposed = the time a collective ran and no computation did: each lane merged first, then subtracted")


GAPS = ("allocated before the step", "rounding and unseen", "cached", "outside the allocator")


def _split(parameters, gradients, optimizer_state, activations, gathered=0, other=0) -> dict:
    return {
        "parameters": parameters,
        "gradients": gradients,
        "optimizer_state": optimizer_state,
        "gathered": gathered,
        "activations": activations,
        "other": other,
    }


RANKS_MEMORY = (
    (
        "a DDP rank: activations at the peak, the optimizer state, a batch allocated before the model",
        _split(400 * MIB, 0, 800 * MIB, 3_000 * MIB, other=2 * MIB),
        {"max_allocated": 4_500 * MIB, "max_reserved": 5_800 * MIB, "resident_before": 250 * MIB},
        6_300,
    ),
    (
        "an FSDP2 rank at its peak in backward: gathered parameters, gradients, little cached",
        _split(100 * MIB, 60 * MIB, 200 * MIB, 900 * MIB, gathered=300 * MIB, other=MIB),
        {"max_allocated": 1_700 * MIB + 4_096, "max_reserved": 1_900 * MIB, "resident_before": 120 * MIB},
        2_450,
    ),
)
"""(what it is, the tracker's split at the peak, the allocator's peaks as a sweep records them, nvidia-smi's
used MiB after the step): drawn by hand, not measured."""


def _gap_mistakes(split: dict, cuda: dict, smi_mib: float) -> list[tuple[str, dict]]:
    right = _right_gaps(split, cuda, smi_mib)
    counted = sum(split.values())
    states = split["parameters"] + split["gradients"] + split["optimizer_state"]
    allocated, reserved, before = cuda["max_allocated"], cuda["max_reserved"], cuda["resident_before"]
    return [
        ("named_categories_only", {**right, "rounding and unseen": allocated - before - states}),
        ("resident_left_in", {**right, "rounding and unseen": allocated - counted}),
        ("cached_from_the_count", {**right, "cached": reserved - counted}),
        ("outside_from_allocated", {**right, "outside the allocator": smi_mib * MIB - allocated}),
        ("mebibytes_as_megabytes", {**right, "outside the allocator": smi_mib * 1e6 - reserved}),
    ]


def _right_gaps(split: dict, cuda: dict, smi_mib: float) -> dict:
    layers = memory_layers(split, cuda, round(smi_mib * MIB))
    return {gap: layers[gap] for gap in GAPS}


def _gaps_equal(got, expected: dict) -> bool:
    return (
        isinstance(got, dict)
        and set(got) == set(expected)
        and all(numbers_close(got[k], expected[k]) or got[k] == expected[k] for k in expected)
    )


def gaps_trial(t: Trial, fn) -> None:
    for label, split, cuda, smi_mib in RANKS_MEMORY:
        with t.case(label):
            expected = _right_gaps(split, cuda, smi_mib)
            got = t.call(fn, dict(split), dict(cuda), smi_mib)
            if _gaps_equal(got, expected):
                continue
            mistake = next((k for k, wrong in _gap_mistakes(split, cuda, smi_mib) if _gaps_equal(got, wrong)), None)
            if not isinstance(got, dict) or set(got) != set(expected):
                shown = sorted(got) if isinstance(got, dict) else repr(got)
                t.fail("the gaps", f"got {shown}, expected a dict with the keys {list(GAPS)}", mistake)
            wrong = [k for k in GAPS if not (numbers_close(got[k], expected[k]) or got[k] == expected[k])]
            detail = "; ".join(f"{k}: got {got[k]!r} bytes, expected {expected[k]:,}" for k in wrong)
            t.fail("the gaps", detail, mistake)
    t.note("each of the learner's numbers contains the one before it: subtract neighbours, peak from peak, in bytes")


EXERCISES = (
    Exercise(
        name="exposed_communication_ms",
        page="profiling",
        task="Return the communication of a profiled step that no computation hid, in ms: the time during which "
        "an event of the `communication` lane ran and none of the `compute` lane did. The step is what "
        "`read_steps` returns for one step: `step_ms`, and `events`, each a dict with `lane`, `start_ms` and "
        "`end_ms`, in no particular order.",
        signature="def exposed_communication_ms(step: dict) -> float:",
        solution="profiling.exposed_communication_ms",
        library="distlab.measure.profile.step_time",
        trial=exposed_trial,
        ranks=1,
        mistakes={
            "summed_durations": "adding up the collectives' durations is the communication's cost, not what the step "
            "waited for: merge the lanes' intervals, then take the communication that no compute covered.",
            "communication_not_exposed": "the time a collective ran is not the time it cost the step: subtract the "
            "part that ran while the compute lane was busy.",
            "busy_times_subtracted": "subtracting the compute's total from the communication's compares durations, "
            "not moments: subtract only the compute that ran at the same time as a collective.",
            "overlapping_collectives_counted_twice": "gloo runs several collectives at once: merge the communication "
            "lane's intervals before you measure them, or the time two ran together counts twice.",
            "nested_ops_subtracted_twice": "ops nest (aten::linear holds aten::addmm): merge the compute lane's "
            "intervals before you subtract them, or the same moment is subtracted once per level.",
            "idle_counted_as_communication": "the step minus its compute is everything else too: Python, the data, "
            "the gaps where neither lane ran. Exposed communication is only the time a collective ran.",
        },
    ),
    Exercise(
        name="memory_gaps",
        page="profiling",
        task="Return what holds a GPU rank's memory beyond the tracker's count, in bytes, as a dict with four keys: "
        "`allocated before the step` (`resident_before`), `rounding and unseen` (the rest of the allocated peak), "
        "`cached` (the reserved peak beyond the allocated one) and `outside the allocator` (nvidia-smi's used "
        "memory beyond the reserved peak). You get the tracker's split at its peak (bytes by category), "
        "`cuda_memory` as a sweep records it (`max_allocated`, `max_reserved`, `resident_before`, bytes) and "
        "nvidia-smi's used memory in MiB.",
        signature="def memory_gaps(peak_by_category: dict, cuda_memory: dict, smi_used_mib: float) -> dict:",
        solution="profiling.memory_gaps",
        library="distlab.measure.allocator.memory_layers",
        trial=gaps_trial,
        ranks=1,
        mistakes={
            "named_categories_only": "the tracker's count is every category at the peak, activations, gathered "
            "parameters and other included, not only the parameters, gradients and optimizer state.",
            "resident_left_in": "the allocated peak also holds what was allocated before the step: subtract "
            "resident_before as well, or the batch and cuBLAS's workspace are called rounding.",
            "cached_from_the_count": "the cache is the reserved peak beyond the allocated peak: subtract "
            "max_allocated from max_reserved, not the tracker's count.",
            "outside_from_allocated": "nvidia-smi shows what the allocator reserved and more: subtract the "
            "reserved peak, not the allocated one, or the cache is counted twice.",
            "mebibytes_as_megabytes": "nvidia-smi's MiB are 2**20 bytes, not 10**6.",
        },
    ),
)
