"""The DDP-vs-FSDP chapter's first program keeps what it prints: each rank saves its records (what it held and what
it sent, by collective, for DDP and then FSDP2), and the page loads them as ``live_run`` for the picture of that run.
The records must say exactly what the printed lines say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "ddp_vs_fsdp.md"


def test_the_first_programs_saved_records_are_what_each_rank_held_and_sent(tmp_path, monkeypatch):
    """4 layers of 512 x 512 + bias in fp32 on 2 gloo ranks: DDP holds all of it and sends it in one all-reduce
    (2 (n-1)/n of it); FSDP2 holds half and sends 1.5x, 8 all-gathers and 4 reduce-scatters."""
    text = PAGE.read_text()
    program = re.search(r"%%writefile ddp_or_fsdp.py\n(.*?)\n```", text, re.S).group(1)
    (tmp_path / "ddp_or_fsdp.py").write_text(program)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "ddp_or_fsdp.py"]
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    loader = re.search(r"live_run = (.*)\n", text).group(1)  # the page's own line, run where the ranks wrote
    monkeypatch.chdir(tmp_path)
    live_run = eval(loader, {"torch": torch})
    values = 4 * (512 * 512 + 512)
    expected = []
    for rank in range(2):
        expected += [
            {"rank": rank, "strategy": "DDP", "held_bytes": 4 * values,
             "sent": {"all_reduce": {"bytes_sent": 4.0 * values, "calls": 1}}},
            {"rank": rank, "strategy": "FSDP2", "held_bytes": 2 * values,
             "sent": {"all_gather": {"bytes_sent": 4.0 * values, "calls": 8},
                      "reduce_scatter": {"bytes_sent": 2.0 * values, "calls": 4}}},
        ]  # fmt: skip
    assert live_run == expected
