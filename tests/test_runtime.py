"""The runtime's helpers on real gloo ranks: per-rank payloads reach rank 0
in rank order, and a result file records where the job ran, once."""

from __future__ import annotations

import json

import torch

from distlab.cli import finish_run
from distlab.runtime import gather_per_rank
from distlab.testing import run_ranks


def gather_and_write(runtime, out_dir: str):
    ranks = gather_per_rank({"rank": runtime.rank, "bytes": 1000 * (runtime.rank + 1)}, runtime)
    path = finish_run(runtime, out_dir, "gathered", "test", {}, {"ranks": ranks})
    return {"ranks": ranks, "path": str(path) if path else None}


def test_gather_per_rank_and_finish_run_write_once_on_rank_0(tmp_path):
    results = run_ranks(gather_and_write, 3, tmp_path, str(tmp_path))
    assert results[0]["ranks"] == [{"rank": r, "bytes": 1000 * (r + 1)} for r in range(3)]
    assert results[1]["ranks"] is None and results[2]["ranks"] is None
    assert results[0]["path"] and results[1]["path"] is None and results[2]["path"] is None
    record = json.loads((tmp_path / "gathered.json").read_text())
    env = record["environment"]
    assert (env["world_size"], env["backend"], env["device"]) == (3, "gloo", "cpu")
    assert env["torch"] == torch.__version__
    assert record["metrics"]["ranks"] == results[0]["ranks"]
