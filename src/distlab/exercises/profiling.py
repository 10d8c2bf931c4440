"""The profiling chapter's exercise: from one rank's profiled step, the communication nothing hid. Interval
arithmetic on events already sorted into lanes, run on one rank and graded on steps drawn to tell its typical
mistakes apart, against the library's :func:`distlab.measure.profile.step_time` (which the chapter runs on the
traces of its own DDP and FSDP2 steps).
"""

from __future__ import annotations

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
)
