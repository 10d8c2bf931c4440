"""The DDP chapter's first program (book/ddp.md, "DDP in 26 lines"), run as the page runs it on two gloo ranks:
it learns (each rank's mean loss falls epoch by epoch: H16, whose first version trained on random targets and
printed a loss that rose) and ends with one model on both ranks."""

from __future__ import annotations

import re

import pytest

from support import run_page_program


@pytest.mark.slow  # a page's torchrun program (CONTRIBUTING: torchrun itself); the build runs it too
def test_the_first_program_learns_and_ends_with_the_same_weights_on_every_rank(tmp_path):
    done = run_page_program("ddp.md", "ddp_minimal.py", tmp_path)
    for rank in (0, 1):
        losses = [
            float(x) for x in re.findall(rf"rank {rank}/2 epoch \d+: \d+ samples, mean loss ([\d.]+)", done.stdout)
        ]
        assert len(losses) == 3 and losses[0] > losses[1] > losses[2], (rank, losses)
    sums = set(re.findall(r"rank \d: weights sum to (\S+)", done.stdout))
    assert len(sums) == 1, sums
