"""The profiling chapter's answer: the communication of a profiled step that no computation hid. Written for
reading: the library's version is :func:`distlab.measure.profile.step_time`.
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
