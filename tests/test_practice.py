"""The practice chapter (book/practice.md): its frozen-base program counts, on two gloo ranks, exactly the bytes the
traffic prediction gives for the trainable values, and its calculator cell answers for a 7B base."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.predict.calculator import GIB, Inputs, memory_per_rank  # noqa: E402
from distlab.predict.traffic import expected_bytes_per_step, frozen_crossing  # noqa: E402
from support import run_page_program

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "practice.md"
EVERY, TRAINABLE = 4 * (512 * 512 + 512 + 2 * 8 * 512), 4 * 2 * 8 * 512  # four frozen layers and rank-8 adapters


def test_the_frozen_base_program_counts_what_the_prediction_says(tmp_path):
    """DDP all-reduces only the adapters' gradients; FSDP2 gathers every block twice, frozen weights too, and
    reduce-scatters the adapters': the counter's bytes on each rank are the prediction's, to the byte."""
    done = run_page_program("practice.md", "frozen_base.py", tmp_path)
    assert len((tmp_path / "frozen_base.py").read_text().splitlines()) <= 45
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    ddp = expected_bytes_per_step("ddp", EVERY, 2, trainable=TRAINABLE)
    fsdp = expected_bytes_per_step("fsdp", EVERY, 2, trainable=TRAINABLE)
    assert (ddp, fsdp) == (2 * TRAINABLE * 4 / 2, (2 * EVERY + TRAINABLE) * 4 / 2)
    values = f"{TRAINABLE:,} of {EVERY:,} values train"
    assert lines == [
        f"rank {r} {name}: {values}; sent {sent:,.0f} B in {calls}; predicted {sent:,.0f} B"
        for r in (0, 1)
        for name, sent, calls in (("DDP", ddp, "1 all_reduce"), ("FSDP2", fsdp, "8 all_gather, 4 reduce_scatter"))
    ]
    _check_picture(done.stdout, ddp, fsdp)


def _check_picture(printed: str, ddp: float, fsdp: float) -> None:
    """The page draws the run from the lines it printed: under each column the bytes a rank sends for it, adding up
    to what it printed (DDP nothing for the frozen base), in the book's 688 px column with text of 9 pt or more."""
    fig = plots.plot_frozen_base_run(printed)
    labels = [t.get_text() for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    assert "frozen base\nsends 0 B\n(nothing: no gradient)" in labels
    assert f"adapters\nsends {ddp:,.0f} B\n(all-reduce of the gradients)" in labels
    frozen_gathers = 2 * (EVERY - TRAINABLE) * 4 / 2
    assert f"frozen base\nsends {frozen_gathers:,.0f} B\n(2 all-gathers)" in labels
    assert f"adapters\nsends {fsdp - frozen_gathers:,.0f} B\n(2 all-gathers + reduce-scatter)" in labels
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    width = struct.unpack(">I", buffer.getvalue()[16:20])[0]
    assert width <= 688 and min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 9
    with pytest.raises(ValueError, match="pass the output of the frozen_base.py run"):
        plots.plot_frozen_base_run(printed.replace(f"sent {ddp:,.0f} B", "sent 1 B"))
    plt.close("all")


def test_fsdp_sends_more_over_every_frozen_base_in_one_dtype():
    """2 + f > 2f for f <= 1: the crossing is at f = 2 (FULL_SHARD) and 1 (SHARD_GRAD_OP), never reached."""
    assert frozen_crossing() == 2.0 and frozen_crossing(gathers=1) == 1.0
    for f in (0.001, 0.01, 0.5, 0.99):
        trainable = int(10**9 * f)
        assert expected_bytes_per_step("fsdp", 10**9, 4, trainable=trainable) > expected_bytes_per_step(
            "ddp", 10**9, 4, trainable=trainable
        )
    assert frozen_crossing(2, 2, 2, 4) == pytest.approx(2 / 3)  # torch's defaults: 16-bit FSDP against fp32 DDP
    with pytest.raises(ValueError, match="trainable must be from 0"):
        expected_bytes_per_step("ddp", 10, 2, trainable=11)


def test_a_7b_base_with_1_percent_trainable_on_two_16_gib_gpus():
    """The page's answer: in fp32 the weights alone are 26 GiB, so only FULL_SHARD fits; with a 16-bit base DDP
    fits, and sends a hundredth of FULL_SHARD's bytes."""
    fp32 = {r["strategy"]: r for r in memory_per_rank(7 * 10**9, Inputs(2, 16.0, trainable_fraction=0.01))}
    assert [label for label, row in fp32.items() if row["fits"]] == ["FSDP FULL_SHARD (ZeRO-3)"]
    assert fp32["DDP, torch's default buckets"]["parameters"] / GIB > 26
    half = {
        r["strategy"]: r for r in memory_per_rank(7 * 10**9, Inputs(2, 16.0, "zero-paper", trainable_fraction=0.01))
    }
    assert half["DDP, torch's default buckets"]["fits"]
    assert half["FSDP FULL_SHARD (ZeRO-3)"]["sent_vs_ddp"] == pytest.approx(100.5, rel=1e-3)
    assert "trainable_fraction=0.01" in PAGE.read_text()
