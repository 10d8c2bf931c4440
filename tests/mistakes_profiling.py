"""Typical wrong answers to the profiling chapter's exercise, each with the mistake its check must name."""


def _merged(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _lane(events, lane):
    return [(e["start_ms"], e["end_ms"]) for e in events if e["lane"] == lane]


def _overlap(first, second):
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in first for b0, b1 in second)


def summed_durations(step):
    events = step["events"]
    return sum(end - start for start, end in _lane(events, "communication"))  # the cost, not what was waited for


def communication_not_exposed(step):
    events = step["events"]
    return sum(end - start for start, end in _merged(_lane(events, "communication")))  # nothing subtracted


def busy_times_subtracted(step):
    events = step["events"]
    busy = {lane: sum(e - s for s, e in _merged(_lane(events, lane))) for lane in ("communication", "compute")}
    return busy["communication"] - busy["compute"]  # durations, not moments


def overlapping_collectives_counted_twice(step):
    events = step["events"]
    compute = _merged(_lane(events, "compute"))
    return sum((e - s) - _overlap([(s, e)], compute) for s, e in _lane(events, "communication"))  # not merged


def nested_ops_subtracted_twice(step):
    events = step["events"]
    communication = _merged(_lane(events, "communication"))
    return sum(e - s for s, e in communication) - _overlap(communication, _lane(events, "compute"))  # nested ops


def idle_counted_as_communication(step):
    events = step["events"]
    return step["step_ms"] - sum(e - s for s, e in _merged(_lane(events, "compute")))  # Python, gaps: all of it


def _gaps(split, cuda, smi_mib, counted=None, cached=None, outside=None):
    counted = sum(split.values()) if counted is None else counted
    allocated, reserved, before = cuda["max_allocated"], cuda["max_reserved"], cuda["resident_before"]
    return {
        "allocated before the step": before,
        "rounding and unseen": allocated - before - counted,
        "cached": reserved - allocated if cached is None else cached,
        "outside the allocator": round(smi_mib * 2**20) - reserved if outside is None else outside,
    }


def named_categories_only(split, cuda, smi_mib):
    states = split["parameters"] + split["gradients"] + split["optimizer_state"]  # activations forgotten
    return _gaps(split, cuda, smi_mib, counted=states)


def resident_left_in(split, cuda, smi_mib):
    gaps = _gaps(split, cuda, smi_mib)
    gaps["rounding and unseen"] = cuda["max_allocated"] - sum(split.values())  # the batch called rounding
    return gaps


def cached_from_the_count(split, cuda, smi_mib):
    return _gaps(split, cuda, smi_mib, cached=cuda["max_reserved"] - sum(split.values()))


def outside_from_allocated(split, cuda, smi_mib):
    return _gaps(split, cuda, smi_mib, outside=round(smi_mib * 2**20) - cuda["max_allocated"])


def mebibytes_as_megabytes(split, cuda, smi_mib):
    return _gaps(split, cuda, smi_mib, outside=smi_mib * 1e6 - cuda["max_reserved"])


MISTAKES = [
    ("exposed_communication_ms", summed_durations, "summed_durations", "a DDP step"),
    ("exposed_communication_ms", communication_not_exposed, "communication_not_exposed", "a DDP step"),
    ("exposed_communication_ms", busy_times_subtracted, "busy_times_subtracted", "a DDP step"),
    (
        "exposed_communication_ms",
        overlapping_collectives_counted_twice,
        "overlapping_collectives_counted_twice",
        "a DDP step",
    ),
    ("exposed_communication_ms", nested_ops_subtracted_twice, "nested_ops_subtracted_twice", "a DDP step"),
    ("exposed_communication_ms", idle_counted_as_communication, "idle_counted_as_communication", "a DDP step"),
    ("memory_gaps", named_categories_only, "named_categories_only", "a DDP rank"),
    ("memory_gaps", resident_left_in, "resident_left_in", "a DDP rank"),
    ("memory_gaps", cached_from_the_count, "cached_from_the_count", "a DDP rank"),
    ("memory_gaps", outside_from_allocated, "outside_from_allocated", "a DDP rank"),
    ("memory_gaps", mebibytes_as_megabytes, "mebibytes_as_megabytes", "a DDP rank"),
]
