"""The fp16 chapter (book/fp16.md): its programs print what fp16 and torch's scalers do (small gradients lost without a
scale, a skipped step halving the scale, one rank's inf letting the plain scaler's ranks diverge and not the sharded
one's), its pictures draw those lines, and its exercise grades torch's own scalers as the chapter says."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import struct
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.exercises import grade  # noqa: E402
from support import run_page_program  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "fp16.md"


def _run_in_process(filename: str, tmp_path: Path) -> str:
    """A program the page writes with %%writefile and runs in its kernel (%run): run here, its printed text."""
    program = re.search(rf"%%writefile {re.escape(filename)}\n(.*?)\n```", PAGE.read_text(), re.S).group(1)
    (tmp_path / filename).write_text(program)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(tmp_path / filename), run_name="__main__")
    return printed.getvalue()


def _fits_the_column(fig) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    width = struct.unpack(">I", buffer.getvalue()[16:20])[0]
    assert width <= 688 and min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 9


def test_without_a_scale_fp16_loses_the_small_gradients_and_with_it_keeps_them(tmp_path):
    """1e-8 and 1e-9 are below half of fp16's smallest subnormal (2^-25): without a scale they come back 0; 1e-7 is a
    subnormal and comes back a fifth off; times 65,536 every one is a normal fp16 number and comes back within
    fp16's rounding. The picture marks the two lost ones."""
    printed = _run_in_process("underflow.py", tmp_path)
    held = plots.fp16.underflow_records(printed)
    assert sorted(held) == [1.0, 65536.0]
    lost = [true for true, got, _ in held[1.0] if got == 0]
    assert lost == [1e-8, 1e-9] and all(true * 65536 > 2.0**-14 for true, _, _ in held[65536.0])
    assert dict((t, off) for t, _, off in held[1.0])[1e-7] == pytest.approx(0.192, abs=0.01)
    assert max(off for _, _, off in held[65536.0]) < 1e-3
    fig = plots.plot_underflow(printed)
    labels = [t.get_text() for t in fig.findobj(Text) if t.get_visible()]
    assert labels.count("lost") == 2 and "rounds to 0" in labels
    _fits_the_column(fig)
    with pytest.raises(ValueError, match="pass the output of the underflow.py run"):
        plots.plot_underflow("scale 1: nothing")
    plt.close("all")


def test_a_skipped_step_halves_the_scale_and_clean_steps_double_it(tmp_path):
    """A gradient of 2 from torch's 65,536 with a growth interval of 3: 2 x 65,536 and 2 x 32,768 are past 65,504
    and skipped, each halving the scale; three clean steps at 16,384 double it, the next step overflows again."""
    printed = _run_in_process("skipped_step.py", tmp_path)
    expected, scale, clean = [], 2.0**16, 0
    for step in range(8):  # torch's rule, written out: GradScaler(init_scale=2**16, growth_interval=3)
        overflow = 2 * scale > torch.finfo(torch.float16).max
        clean = 0 if overflow else clean + 1
        after = scale / 2 if overflow else (scale * 2 if clean == 3 else scale)
        clean = 0 if clean == 3 else clean
        taken = "skipped" if overflow else "stepped"
        expected.append(f"step {step}: scale {scale:,.0f}, gradient x scale {2 * scale:,.0f}, {taken}, "
                        f"next scale {after:,.0f}")  # fmt: skip
        scale = after
    assert printed.splitlines() == expected
    assert [line.split(", ")[2] for line in expected].count("skipped") == 3


@pytest.mark.slow  # a page's torchrun program (CONTRIBUTING: torchrun itself); the build runs it too
def test_one_ranks_inf_lets_the_plain_scalers_ranks_diverge_and_not_the_sharded_ones(tmp_path):
    """On two gloo ranks, rank 1's shard alone overflows: the plain GradScaler on plain shards steps rank 0 and
    skips rank 1 (their scales differ after); ShardedGradScaler skips both; FSDP2's DTensor gradients share the
    found-inf inside the plain GradScaler's unscale, so it skips both too. The picture draws exactly that."""
    done = run_page_program("fp16.md", "fp16_ranks.py", tmp_path)
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == sorted([
        "rank 0 GradScaler: inf in my shard 0, stepped, scale now 32,768",
        "rank 1 GradScaler: inf in my shard 1, skipped, scale now 16,384",
        *(f"rank {r} {name}: inf in my shard {r}, skipped, scale now 16,384"
          for r in (0, 1) for name in ("ShardedGradScaler", "FSDP2 + GradScaler")),
    ])  # fmt: skip
    fig = plots.plot_scaler_run(done.stdout)
    titles = [ax.get_title() for ax in fig.axes]
    agree = "the ranks agree: one model"
    assert titles == ["GradScaler: the ranks diverge: one stepped, one skipped", f"ShardedGradScaler: {agree}",
                      f"FSDP2 + GradScaler: {agree}"]  # fmt: skip
    outlined = [sum(1 for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()) for ax in fig.axes]
    assert outlined == [0, 2, 2]  # the shared found-inf, on both ranks, where a collective carried it
    _fits_the_column(fig)
    with pytest.raises(ValueError, match="pass the output of the fp16_ranks.py run"):
        plots.plot_scaler_run(done.stdout.replace("rank 1 GradScaler", "rank 1 Other"))
    plt.close("all")


def with_torchs_sharded_scaler(loss, optimizer, scaler):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    state = {"scale": scaler["scale"], "growth_factor": 2.0, "backoff_factor": 0.5,
             "growth_interval": scaler["growth_interval"], "_growth_tracker": scaler["clean_steps"]}  # fmt: skip
    torch_scaler = ShardedGradScaler(loss.device.type)
    torch_scaler.load_state_dict(state)
    torch_scaler.scale(loss).backward()
    torch_scaler.step(optimizer)
    torch_scaler.update()
    scaler["scale"], scaler["clean_steps"] = torch_scaler.get_scale(), torch_scaler._get_growth_tracker()


def with_torchs_plain_scaler(loss, optimizer, scaler):
    state = {"scale": scaler["scale"], "growth_factor": 2.0, "backoff_factor": 0.5,
             "growth_interval": scaler["growth_interval"], "_growth_tracker": scaler["clean_steps"]}  # fmt: skip
    torch_scaler = torch.amp.GradScaler(loss.device.type)
    torch_scaler.load_state_dict(state)
    torch_scaler.scale(loss).backward()
    torch_scaler.step(optimizer)
    torch_scaler.update()
    scaler["scale"], scaler["clean_steps"] = torch_scaler.get_scale(), torch_scaler._get_growth_tracker()


def test_the_exercise_passes_torchs_sharded_scaler_and_names_the_plain_ones_divergence():
    """What the check calls right is torch's ShardedGradScaler, driven step by step from the exercise's dict; torch's
    plain GradScaler on the same shards fails as a found-inf left local, the chapter's point."""
    sharded = grade("loss_scaled_step", with_torchs_sharded_scaler)
    assert sharded.passed, sharded.message
    plain = grade("loss_scaled_step", with_torchs_plain_scaler)
    assert not plain.passed and plain.mistake == "local_found_inf", plain.message
    assert "while rank 1's shard held an inf and rank 1 skipped" in plain.message
