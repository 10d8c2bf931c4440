"""What the chapters' pictures of who holds and sends what are drawn with: the page's own code run on real ranks
with every call it makes traced (``run_on_ranks``), and one grammar to draw holdings and sends (``plot_holdings``)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist

from distlab.errors import DistlabError
from distlab.exercises import run_on_ranks
from distlab.plots import plot_holdings


def ring_pass() -> list[float]:
    """Each rank sends its own number to the next and returns what it received (the page's kind of code)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine, theirs = torch.tensor([float(rank)]), torch.zeros(1)
    request = dist.isend(mine, (rank + 1) % n)
    dist.recv(theirs, (rank - 1) % n)
    request.wait()
    print(f"rank {rank} got {theirs.item():g}")
    return theirs


def gives_up():
    raise ValueError("not on this rank")


def test_run_on_ranks_hands_back_each_ranks_output_result_and_sends():
    runs = run_on_ranks(ring_pass, ranks=3)
    assert [run.rank for run in runs] == [0, 1, 2]
    for run in runs:
        assert run.returned == [float((run.rank - 1) % 3)]
        assert run.printed == [f"rank {run.rank} got {(run.rank - 1) % 3}"]
        assert [(s["op"], s["peer"], s["bytes"]) for s in run.sends()] == [("isend", (run.rank + 1) % 3, 4)]
        assert [c["op"] for c in run.calls] == ["isend", "recv"]


def test_run_on_ranks_says_which_rank_raised_in_one_line():
    with pytest.raises(DistlabError, match="rank 0 of 2: not on this rank"):
        run_on_ranks(gives_up, ranks=2)


def test_plot_holdings_draws_every_cell_and_an_arrow_a_send():
    fig, ax = plt.subplots()
    held = [[frozenset([0]), "w"], [frozenset([0, 1]), "w"]]
    plot_holdings(ax, held, [(0, 0, 1), (1, 1, None)], columns=["grad", "weights"], title="t")
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == ["0", "0+1", "w", "w"]
    arrows = [p for p in ax.patches if type(p).__name__ == "FancyArrowPatch"]
    outlines = [p for p in ax.patches if type(p).__name__ == "Rectangle" and not p.get_fill()]
    assert len(arrows) == 1 and len(outlines) == 2  # into a collective: outlined, no arrow
    assert [t.get_text() for t in ax.get_xticklabels()] == ["grad", "weights"]
    plt.close(fig)
