"""The memory section of the profiling chapter: the layers of a rank's peak from numbers a GPU sweep recorded, and
the allocator's snapshot read, both on snapshots and records written by hand or committed (the CPU's side; a real
snapshot is tests/test_gpu_allocator.py's)."""

from __future__ import annotations

import json
import pickle

import pytest

from distlab.measure.allocator import LAYERS, MIB, memory_layers, read_snapshot, sweep_memory_rows
from distlab.results import committed_results


def _block(size, state, requested=None):
    return {"size": size, "requested_size": size if requested is None else requested, "address": 0, "state": state,
            "frames": []}  # fmt: skip


SNAPSHOT = {
    "segments": [
        {"address": 0, "total_size": 20 * MIB, "stream": 0, "segment_type": "large",
         "blocks": [_block(8 * MIB, "active_allocated", 8 * MIB - 100), _block(2 * MIB, "active_awaiting_free"),
                    _block(10 * MIB, "inactive")]},
        {"address": 1, "total_size": 2 * MIB, "stream": 7, "segment_type": "small",
         "blocks": [_block(512, "active_allocated", 4), _block(2 * MIB - 512, "inactive")]},
    ],
    "device_traces": [[]],
}  # fmt: skip


def test_a_snapshot_reads_as_the_allocators_current_numbers():
    read = read_snapshot(SNAPSHOT)
    assert read == {
        "reserved": 22 * MIB,
        "allocated": 8 * MIB + 512,
        "requested": 8 * MIB - 100 + 2 * MIB + 4,  # before rounding (a 4-byte tensor takes a 512-byte block),
        # awaiting free included: memory_stats drops a block's request only once it is free
        "awaiting_free": 2 * MIB,
        "cached": 10 * MIB + 2 * MIB - 512,
        "largest_free": 10 * MIB,
        "segments": 2,
        "streams": 2,
    }
    assert read["allocated"] + read["awaiting_free"] + read["cached"] == read["reserved"]


def test_a_dumped_snapshot_reads_the_same_and_anything_else_is_one_line(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    assert read_snapshot(pickle.loads(path.read_bytes())) == read_snapshot(SNAPSHOT)
    with pytest.raises(ValueError, match="_dump_snapshot"):
        read_snapshot({"traceEvents": []})  # a profiler trace, not a snapshot


def test_the_layers_add_up_to_each_of_the_learners_numbers():
    split = {"parameters": 100, "gradients": 100, "optimizer_state": 200, "gathered": 0, "activations": 600,
             "other": 10}  # fmt: skip
    cuda = {"max_allocated": 1_300, "max_reserved": 2_000, "resident_before": 250}
    layers = memory_layers(split, cuda, device_used=2_600)
    assert tuple(layers) == LAYERS
    assert layers["counted"] == 1_010
    assert layers["counted"] + layers["allocated before the step"] + layers["rounding and unseen"] == 1_300
    assert 1_300 + layers["cached"] == 2_000 and 2_000 + layers["outside the allocator"] == 2_600
    assert memory_layers(split, cuda)["outside the allocator"] is None  # not read: not guessed
    with pytest.raises(ValueError, match="resident_before"):
        memory_layers(split, {"max_allocated": 1, "max_reserved": 1})


def test_the_committed_h200_sweep_has_every_variants_layers_and_a_cpu_sweep_none():
    """The chapter's picture reads these: the layers sum to the allocator's reserved peak, variant by variant."""
    (sweep_file,) = [p for p in committed_results("gpu").glob("*/sweep.json") if "20261128" in p.parent.name]
    rows = sweep_memory_rows(json.loads(sweep_file.read_text()))
    assert {(r["variant"], r["tokens"]) for r in rows} >= {("ddp", 2_048), ("fsdp", 260_096)}
    for row in rows:
        layers = memory_layers(row["peak_by_category"], row["cuda_memory"])
        inside = sum(v for k, v in layers.items() if k != "outside the allocator")
        assert inside == row["cuda_memory"]["max_reserved"]
        assert layers["cached"] >= 0
    cpu_sweep = {"metrics": {"presets": [{"model": "gpt-tiny", "variants": [{"variant": "ddp", "memory": {}}]}]}}
    assert sweep_memory_rows(cpu_sweep) == []


def test_the_picture_draws_a_bar_a_row_and_leaves_a_layer_below_zero_out():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from distlab import plots

    split = {"parameters": 100, "gradients": 0, "optimizer_state": 200, "gathered": 0, "activations": 600, "other": 0}
    rows = [
        {"variant": "ddp", "tokens": 2048, "peak_by_category": split,
         "cuda_memory": {"max_allocated": 1_000, "max_reserved": 1_500, "resident_before": 50}},
        {"variant": "zero1", "tokens": 2048, "peak_by_category": split,  # counted a tensor allocated before
         "cuda_memory": {"max_allocated": 1_000, "max_reserved": 1_200, "resident_before": 150}},
    ]  # fmt: skip
    axes = plots.plot_memory_layers(rows)
    widths = [[patch.get_width() for patch in ax.patches] for ax in axes]
    assert sum(widths[0]) == pytest.approx(1_500 / 1e9)
    assert len(widths[1]) == 5  # parameters, optimizer state, activations, before, cached: no negative bar
    plt.close("all")
