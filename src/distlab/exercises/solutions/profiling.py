"""The profiling chapter's answers, written for reading: the communication of a profiled step that no computation
hid (the library's version is :func:`distlab.measure.profile.step_time`), and what holds a GPU rank's memory beyond
the tracker's count (:func:`distlab.measure.allocator.memory_layers`).
"""


def exposed_communication_ms(step: dict) -> float:
    def busy(lane):  # when the lane ran: its intervals in order, overlapping ones merged
        merged = []
        for start, end in sorted((e["start_ms"], e["end_ms"]) for e in step["events"] if e["lane"] == lane):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged

    compute = busy("compute")
    exposed = 0.0
    for start, end in busy("communication"):
        hidden = sum(max(0.0, min(end, c_end) - max(start, c_start)) for c_start, c_end in compute)
        exposed += (end - start) - hidden  # the part of this collective's time with no compute beside it
    return exposed


def memory_gaps(peak_by_category: dict, cuda_memory: dict, smi_used_mib: float) -> dict:
    counted = sum(peak_by_category.values())  # every category at the peak, activations included
    allocated, reserved = cuda_memory["max_allocated"], cuda_memory["max_reserved"]
    before = cuda_memory["resident_before"]
    return {  # each number contains the one before it: subtract neighbours
        "allocated before the step": before,
        "rounding and unseen": allocated - before - counted,
        "cached": reserved - allocated,
        "outside the allocator": round(smi_used_mib * 2**20) - reserved,  # MiB are 2**20 bytes
    }
