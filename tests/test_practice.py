"""The practice chapter (book/practice.md): its frozen-base program counts, on two gloo ranks, exactly the bytes the
traffic prediction gives for the trainable values, and its calculator cell answers for a 7B base; its accumulation
programs show the wrong and the right normalisation over uneven micro-batches, and FSDP2's bytes and held gradients
with and without the sync as predicted; the library's token-weighted micro-steps pass the exercise's check."""

from __future__ import annotations

import io
import re
import struct
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.exercises import grade  # noqa: E402
from distlab.predict.calculator import GIB, Inputs, memory_per_rank  # noqa: E402
from distlab.predict.traffic import expected_bytes_per_step, frozen_crossing  # noqa: E402
from support import run_page_program

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "practice.md"
EVERY, TRAINABLE = 4 * (512 * 512 + 512 + 2 * 8 * 512), 4 * 2 * 8 * 512  # four frozen layers and rank-8 adapters


@pytest.mark.slow  # a page's torchrun program (CONTRIBUTING: torchrun itself); the build runs it too
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


# Accumulation done right

PSI = 4 * (256 * 256 + 256)  # the FSDP program's four 256 x 256 blocks


@pytest.mark.slow
def test_the_fsdp_accumulation_program_counts_what_the_prediction_says(tmp_path):
    """Synchronised every micro-step, FSDP2 gathers every unit twice and reduce-scatters the gradients each time,
    and holds only a shard of them; synchronised at the last, it sends no reduce-scatter before the last micro-step
    and holds the whole gradients until then: bytes and held gradients as predicted, to the byte, on each rank."""
    done = run_page_program("practice.md", "accumulate_fsdp.py", tmp_path)
    assert len((tmp_path / "accumulate_fsdp.py").read_text().splitlines()) <= 55
    gathers = expected_bytes_per_step("fsdp", PSI, 2, trainable=0)
    reduce = expected_bytes_per_step("fsdp", PSI, 2) - gathers
    whole, shard = 4 * PSI, 4 * PSI // 2
    assert (gathers, reduce) == (2 * whole / 2, whole / 2)
    assert (
        f"predicted: a micro-step gathers {gathers:,.0f} B and a sync reduce-scatters {reduce:,.0f} B; "
        f"whole gradients hold {whole:,} B, a shard of them {shard:,} B" in done.stdout
    )
    records = plots.practice.accumulation_records(done.stdout)
    assert list(records) == ["synced every micro-step", "synced at the last"]
    for rank in (0, 1):
        synced, at_last = records["synced every micro-step"][rank], records["synced at the last"][rank]
        assert synced["held"] == {1: shard, 2: shard, 3: shard}
        assert synced["sent"] == dict.fromkeys((1, 2, 3), gathers + reduce)
        assert synced["calls"][1] == {"all_gather": 8, "reduce_scatter": 4}
        assert at_last["held"] == {1: whole, 2: whole, 3: shard}
        assert at_last["sent"] == {1: gathers, 2: gathers, 3: gathers + reduce}
        assert at_last["calls"][1] == {"all_gather": 8}
        assert at_last["peak"] > synced["peak"]  # the whole gradients, held across micro-steps, raise the peak
    _check_accumulation_picture(done.stdout, gathers, reduce)


def _check_accumulation_picture(printed: str, gathers: float, reduce: float) -> None:
    """The page draws the run from its lines: whole gradients where the sync was skipped, a shard elsewhere, each
    column the bytes the run printed, in the book's 688 px column with text of 9 pt or more."""
    fig = plots.plot_accumulation_run(printed)
    labels = [t.get_text() for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    assert labels.count(f"holds {4 * PSI:,} B\n(whole)") == 4  # two ranks, two micro-steps without a sync
    assert labels.count(f"holds {2 * PSI:,} B\n(a shard)") == 8
    assert labels.count(f"micro-step 1\nsends {gathers:,.0f} B in\n8 all-gathers") == 1
    assert labels.count(f"micro-step 3\nsends {gathers + reduce:,.0f} B in\n8 all-gathers,\n4 reduce-scatters") == 2
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    width = struct.unpack(">I", buffer.getvalue()[16:20])[0]
    assert width <= 688 and min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 9
    with pytest.raises(ValueError, match="pass the output of the accumulate_fsdp.py run"):
        plots.plot_accumulation_run(printed.replace("rank 1 synced at the last: peak", "rank 1 lost its peak"))
    plt.close("all")


@pytest.mark.slow
def test_the_uneven_batch_program_shows_only_the_steps_tokens_right(tmp_path):
    """Sequences of 2 + 12 tokens on rank 0 and 9 + 9 on rank 1: the mean of micro-batch means and the rank's own
    tokens leave the gradient far from one process's on the whole batch; the step's tokens match it to rounding."""
    done = run_page_program("practice.md", "uneven_tokens.py", tmp_path)
    assert len((tmp_path / "uneven_tokens.py").read_text().splitlines()) <= 40
    off = {
        way.strip(): float(value)
        for way, value in re.findall(r"^(.+): the gradient is off by (\S+) of its size$", done.stdout, re.M)
    }
    assert list(off) == ["mean of micro-batch means", "the rank's own tokens", "the step's tokens"], done.stdout
    assert off["mean of micro-batch means"] > 0.3 and off["the rank's own tokens"] > 0.05
    assert off["the step's tokens"] < 1e-6


def library_micro_steps(model, micro_batches):
    from distlab.parallel.accumulation import token_weighted_micro_steps

    token_weighted_micro_steps(model, micro_batches, model.no_sync)


def test_the_librarys_token_weighted_micro_steps_pass_the_exercises_check():
    """The library's version, given torch DDP's no_sync, is graded as a learner's answer would be: the whole
    batch's gradient on two gloo ranks, with one gradient all-reduce a step."""
    verdict = grade("token_weighted_accumulation", library_micro_steps)
    assert verdict.passed, verdict.message


def _fsdp2_token_weighted(runtime, seed: int):
    """On each rank: the exercise's per-token model sharded by FSDP2 (its first layer a unit, then the root), one
    step of the library's token-weighted micro-steps with the FSDP2 strategy's no_sync; the whole gradients."""
    import copy

    from torch.distributed.fsdp import fully_shard

    from distlab.exercises.accumulation import per_token_model, step_batches
    from distlab.parallel.accumulation import token_weighted_micro_steps
    from distlab.parallel.fsdp2 import FSDP2

    model = copy.deepcopy(per_token_model(seed))
    fully_shard(model[0])
    fully_shard(model)
    mine = step_batches(runtime.world_size, 3, 2, 6, seed)[runtime.rank]
    share = token_weighted_micro_steps(model, mine, lambda: FSDP2().no_sync(model))
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}, float(share)


def test_the_librarys_micro_steps_under_fsdp2_give_the_whole_batchs_gradient_and_loss(ranks2):
    """FSDP2 synchronised only at the last of three micro-steps of uneven lengths: every rank's gradient is one
    process's on the whole batch, and the ranks' shares of the loss add up to its mean loss per token."""
    import torch.nn.functional as F

    from distlab.exercises.accumulation import per_token_model, step_batches

    seed = 5
    plain = per_token_model(seed)
    x, y = (torch.cat(parts) for parts in zip(*(b for mine in step_batches(2, 3, 2, 6, seed) for b in mine)))
    loss = F.cross_entropy(plain(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    loss.backward()
    ranks = ranks2.run(_fsdp2_token_weighted, seed)
    for grads, _ in ranks:
        for name, p in plain.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5)
    assert sum(share for _, share in ranks) == pytest.approx(loss.item(), rel=1e-6)
