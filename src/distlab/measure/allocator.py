"""One rank's GPU memory as the learner's own tools report it, reconciled with the course's count.

The course's :class:`~distlab.measure.memory.MemoryTracker` counts every tensor storage a step holds, by what it is.
CUDA's caching allocator reports more, and ``nvidia-smi`` more again. Each number contains the one before it:

* **counted**: the tracker's split at the step's peak (parameters, gradients, optimizer state, gathered
  parameters, activations, other);
* **allocated before the step**: what the rank had allocated before the model was built and stays live through
  the step (the batch, cuBLAS's workspace): ``resident_before`` of a sweep's ``cuda_memory``;
* **rounding and unseen**: up to ``torch.cuda.max_memory_allocated``: the allocator hands out blocks in multiples
  of 512 bytes, a large tensor's block up to 1 MiB more (a leftover too small to split off), and tensors the
  tracker never saw;
* **cached**: up to ``torch.cuda.max_memory_reserved``: segments the allocator took from CUDA and keeps for
  reuse, their freed blocks and the unusable ends of split ones (fragmentation, what
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` reduces);
* **outside the allocator**: up to the device's used memory (``nvidia-smi``, or ``torch.cuda.mem_get_info``):
  CUDA's context, NCCL's buffers, other processes.

:func:`memory_layers` computes those gaps from numbers already recorded; :func:`read_snapshot` reads the
allocator's own snapshot (``torch.cuda.memory._snapshot()``, or the pickle ``_dump_snapshot`` writes) into the
same terms. Both are plain arithmetic on dicts, so they run, and are tested, on a CPU; only taking the numbers
needs a GPU (``tests/test_gpu_allocator.py``). Errors are ValueError: this package imports nothing of distlab's.
"""

from __future__ import annotations

from collections.abc import Mapping

MIB = 2**20
"""``nvidia-smi`` prints MiB: 2**20 bytes, not 10**6."""

LAYERS = ("counted", "allocated before the step", "rounding and unseen", "cached", "outside the allocator")
"""The layers of one rank's peak, inside out: each number of the learner's tools contains the ones before it."""


def memory_layers(
    peak_by_category: Mapping[str, int], cuda_memory: Mapping[str, int], device_used: int | None = None
) -> dict[str, int | None]:
    """The layers of one rank's peak, in bytes (:data:`LAYERS`).

    ``peak_by_category`` is the tracker's split at its peak (it sums to the counted peak), ``cuda_memory`` holds
    ``max_allocated``, ``max_reserved`` and ``resident_before`` as a sweep records them, ``device_used`` the
    device's used bytes after the step (None where it was not read: its layer is then None). The allocator keeps
    what it reserved until ``empty_cache``, so the reserved peak is still reserved when the device is read.
    """
    missing = {"max_allocated", "max_reserved", "resident_before"} - set(cuda_memory)
    if missing:
        raise ValueError(f"cuda_memory lacks {sorted(missing)}: it is what a sweep records on a GPU")
    counted = sum(peak_by_category.values())
    before = cuda_memory["resident_before"]
    allocated, reserved = cuda_memory["max_allocated"], cuda_memory["max_reserved"]
    return {
        "counted": counted,
        "allocated before the step": before,
        "rounding and unseen": allocated - before - counted,
        "cached": reserved - allocated,
        "outside the allocator": None if device_used is None else device_used - reserved,
    }


def sweep_memory_rows(sweep: Mapping) -> list[dict]:
    """Each variant of a sweep result that carries CUDA's numbers (a GPU run), rank 0's: its model, tokens a step,
    variant, the tracker's split at the peak and ``cuda_memory``. A CPU sweep has none."""
    rows = []
    for preset in sweep["metrics"]["presets"]:
        for variant in preset.get("variants", []):
            cuda = variant.get("cuda_memory")
            if not cuda:
                continue
            rows.append(
                {
                    "model": preset.get("model"),
                    "tokens": preset.get("tokens_per_rank"),
                    "variant": variant.get("variant") or variant.get("name"),
                    "peak_by_category": variant["memory"]["ranks"][0]["peak_by_category"],
                    "cuda_memory": cuda[0],
                    "device_used": cuda[0].get("device_used"),  # recorded from 2026-12-07 on
                }
            )
    return rows


ACTIVE_STATES = ("active_allocated", "active_awaiting_free")


def read_snapshot(snapshot: Mapping) -> dict[str, int]:
    """The allocator's state from one of its snapshots, in bytes: what ``memory_stats`` calls current.

    ``reserved``: every segment's size (what it took from CUDA); ``allocated``: its blocks in use by a tensor
    (``active_allocated``); ``awaiting_free``: freed blocks another stream may still use; ``requested``: what the
    tensors of both asked for, before rounding (``memory_stats`` drops a block's request only once it is free);
    ``cached``: the rest, free for reuse; ``largest_free``: the largest free block (it serves only its own stream
    and pool); ``segments``; ``streams``: how many streams hold segments (FSDP2's all-gathers run on streams of
    their own). A snapshot holds every device's segments (``_snapshot`` ignores its device argument): these are
    one device's numbers where the process used one GPU, as a rank of one GPU does.
    """
    segments = snapshot.get("segments")
    if segments is None:
        raise ValueError(
            "not an allocator snapshot (no 'segments'): torch.cuda.memory._snapshot() returns one, "
            "and torch.cuda.memory._dump_snapshot(path) pickles it"
        )
    found = dict.fromkeys(("reserved", "allocated", "requested", "awaiting_free", "cached", "largest_free"), 0)
    streams = set()
    for segment in segments:
        found["reserved"] += segment["total_size"]
        streams.add(segment.get("stream", 0))
        for block in segment["blocks"]:
            if block["state"] in ACTIVE_STATES:
                found["requested"] += block.get("requested_size", block["size"])
            if block["state"] == "active_allocated":
                found["allocated"] += block["size"]
            elif block["state"] == "active_awaiting_free":
                found["awaiting_free"] += block["size"]
            else:
                found["cached"] += block["size"]
                found["largest_free"] = max(found["largest_free"], block["size"])
    return {**found, "segments": len(segments), "streams": len(streams)}
