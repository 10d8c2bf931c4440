"""The labs' figures and their one speed-up (labs-1 L1, L4, L5, L9, L12, L13): each figure drawn from hand-made
records, as a lab draws it, must show whole at notebook width (about 790 px: a 900 px window with a side panel),
every text at 9 pt or more as shown, and no two tick labels of an axis running into each other."""

from __future__ import annotations

import dataclasses
import io
import struct

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.config import TrainConfig  # noqa: E402

NOTEBOOK_PX, MIN_PT = 790, 9.0
ENVIRONMENT = {"device": "cpu", "backend": "gloo", "cpu": "AMD EPYC", "cpu_count": 2, "gpus": []}


def train_record(strategy="single", ranks=1, batch=64, losses=(2.3, 1.9, 1.4, 0.9), samples_per_s=1000.0,
                 epoch_time_s=1.5, accuracy=0.95, loader="dataloader"):  # fmt: skip
    """A distlab.train result as read_result gives it: one epoch of ``losses``."""
    config = dataclasses.asdict(TrainConfig())
    config["parallel"]["strategy"], config["training"]["batch_size"] = strategy, batch
    config["data"]["loader"] = loader
    epoch = {"step_loss": list(losses), "samples_per_s": samples_per_s, "epoch_time_s": epoch_time_s,
             "test_accuracy": accuracy, "steps": len(losses)}  # fmt: skip
    return {"config": config, "environment": {**ENVIRONMENT, "world_size": ranks}, "metrics": {"epochs": [epoch]}}


def script_record(wrap="fsdp", model="gpt-tiny", samples_per_s=400.0, epoch_time_s=2.0, steps=8, memory=None):
    """A fsdp_train.py result: its config is its flags."""
    epoch = {"step_loss": [2.0] * steps, "samples_per_s": samples_per_s, "epoch_time_s": epoch_time_s,
             "test_accuracy": 0.25}  # fmt: skip
    memory = memory or [{"state_bytes": 9_000_000, "cuda_max_allocated": 0}] * 2
    return {
        "kind": "fsdp_train",
        "config": {"wrap": wrap, "model": model, "batch_size": 16},
        "environment": {**ENVIRONMENT, "world_size": 2},
        "metrics": {"epochs": [epoch, epoch], "memory": memory, "parameters": 1_234_567},
    }


def shown(fig) -> tuple[int, float]:
    """The PNG's width as the inline backend saves it, and the scale a notebook of NOTEBOOK_PX shows it at."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    width = struct.unpack(">I", buffer.getvalue()[16:20])[0]
    return width, min(1.0, NOTEBOOK_PX / width) * fig.dpi / 100


def texts(fig) -> list[Text]:
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def overlapping_tick_labels(fig) -> list[tuple[str, str]]:
    """Neighbouring x tick labels of one Axes whose boxes overlap, as drawn."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    clashes = []
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text().strip()]
        boxes = sorted(((t.get_window_extent(renderer), t.get_text()) for t in labels), key=lambda b: b[0].x0)
        clashes += [(a[1], b[1]) for a, b in zip(boxes, boxes[1:]) if a[0].x1 > b[0].x0]
    return clashes


def assert_readable_at_notebook_width(fig, name):
    width, scale = shown(fig)
    assert fig.get_size_inches()[0] <= 7.9, f"{name}: {fig.get_size_inches()[0]:.1f} in wide"
    assert width <= NOTEBOOK_PX, f"{name}: {width} px wide, shown at {scale:.2f} of its size"
    small = sorted({(round(t.get_fontsize() * scale, 1), t.get_text()[:30]) for t in texts(fig)})
    assert small[0][0] >= MIN_PT, f"{name}: texts under {MIN_PT} pt as shown: {[s for s in small if s[0] < MIN_PT]}"
    assert not overlapping_tick_labels(fig), f"{name}: tick labels run together: {overlapping_tick_labels(fig)}"


def _training_runs():
    single = train_record(samples_per_s=1030)
    ddp = train_record("ddp", 2, samples_per_s=1270, losses=(2.3, 1.8))
    return plots.plot_training_runs([single, ddp, script_record(), train_record(batch=128)], single=single)


def _state_against_prediction():
    rows = [(f"{wrap}, rank {rank}", 9_000_000 // (2 if wrap == "fsdp" else 1), 9_000_000, None)
            for wrap in ("ddp", "fsdp") for rank in range(2)]  # fmt: skip
    return plots.plot_state_against_prediction(rows, "gpt-tiny (1,234,567 parameters), measured on this CPU").figure


def _predicted_footprint():
    gib = 2**30
    predicted = {
        "ddp": {"parameters": 3.74 * gib, "gradients": 3.74 * gib, "optimizer_state": 7.48 * gib,
                "buckets": 3.74 * gib, "gathered": 0},
        "fsdp": {"parameters": 1.87 * gib, "gradients": 1.87 * gib, "optimizer_state": 3.74 * gib, "buckets": 0,
                 "gathered": 0.21 * gib},
    }  # fmt: skip
    return plots.plot_predicted_footprint(
        predicted, 14.75 * gib, "predicted: gpt-xl x30 blocks, 2 ranks on a T4"
    ).figure


def _tokens_per_s():
    done = {"gpt-tiny ddp": script_record("ddp", samples_per_s=121.0), "gpt-tiny fsdp": script_record(samples_per_s=60)}
    return plots.plot_tokens_per_s(done, {label: 1024 for label in done}).figure


def _step_options():
    records = {"default": script_record(), "prefetch depth 2": script_record(epoch_time_s=2.2),
               "CPU offload": script_record(epoch_time_s=2.1)}  # fmt: skip
    return plots.plot_fsdp_step_options(records, "FSDP options, gpt-tiny").figure


FIGURES = {
    "training runs (every lab)": _training_runs,
    "state against prediction (FSDP lab, part 2)": _state_against_prediction,
    "predicted footprint (FSDP lab, part 2)": _predicted_footprint,
    "tokens per second (FSDP lab, part 2)": _tokens_per_s,
    "FSDP options (FSDP lab, part 3)": _step_options,
}


@pytest.mark.parametrize("name", list(FIGURES))
def test_each_lab_figure_is_readable_at_notebook_width(name):
    figures = FIGURES[name]()
    try:
        for fig in figures if isinstance(figures, tuple) else (figures,):
            assert_readable_at_notebook_width(fig, name)
    finally:
        plt.close("all")


def test_the_measure_sees_tick_labels_running_together():
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.barh(["a"], [120_000])
    ax.set_xticks(range(0, 140_001, 20_000))
    try:
        assert overlapping_tick_labels(fig)
    finally:
        plt.close(fig)


def test_the_footprint_draws_ddps_buckets_beside_its_state():
    """L5: torch DDP's bar includes its buckets (20 bytes a parameter), a segment of its own in the legend."""
    ax = _predicted_footprint().axes[0]
    try:
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "predicted: buckets" in legend
        ddp_label = ax.get_yticklabels()[0].get_text()
        assert "18.70 GiB, 127 %" in ddp_label, ddp_label  # 3.74 x 5 GiB of a 14.75 GiB T4
    finally:
        plt.close("all")


def test_the_speed_up_is_throughput_over_the_single_runs_not_a_ratio_of_epoch_times():
    """L1, L12: with --max-steps the single epoch held 12 x 128 samples in 1.49 s, DDP's 8 x 256 in 1.61 s: epoch
    times said 0.92x, the throughput 1.23x. The speed-up is the throughput's."""
    single = train_record(samples_per_s=1030, epoch_time_s=1.49)
    ddp = train_record("ddp", 2, samples_per_s=1270, epoch_time_s=1.61)
    assert plots.throughput_speedup(ddp, single) == pytest.approx(1270 / 1030)
    assert plots.throughput_speedup(single, single) == 1.0


def test_a_single_run_at_ddps_global_batch_is_the_same_training_and_its_loss_gap_is_measured():
    """L2: one rank at 256 takes DDP's steps at 2 x 128; the largest relative step-loss difference says how close."""
    single = train_record(batch=256, losses=(2.3, 1.9, 1.4))
    ddp = train_record("ddp", 2, batch=128, losses=(2.3, 1.9, 1.4 * (1 + 3e-6)))
    assert plots.same_training(single, ddp) and not plots.same_training(train_record(batch=128), ddp)
    assert not plots.same_training(train_record(batch=256, loader="device"), ddp)
    steps, gap = plots.largest_step_loss_difference(single, ddp)
    assert steps == 3 and gap == pytest.approx(3e-6, rel=1e-3)
    with pytest.raises(ValueError, match="not the same training"):
        plots.largest_step_loss_difference(train_record(), ddp)


def test_legends_say_the_batch_is_per_rank():
    """L13: "batch 64" read as the global batch; it is per rank."""
    assert "batch 64/rank" in plots.training_label(train_record("ddp", 2))
    assert "batch 128/rank" in plots.training_label(train_record(batch=128))  # the default batch is said too
    assert plots.training_label(script_record()) == "fsdp (2 ranks, batch 16/rank, fsdp_train.py)"


def test_a_loss_axis_within_one_decade_has_more_than_two_labels():
    """L13: a log axis over 0.8-2.4 labelled only 10^0 and 2x10^0."""
    ax = plots.plot_loss_curves([train_record(losses=(2.4, 1.8, 1.2, 0.8))])
    try:
        ax.figure.canvas.draw()
        low, high = ax.get_ylim()
        shown_labels = [
            t.get_text() for t in ax.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high
        ]
        assert len(shown_labels) >= 3, shown_labels
        assert ax.get_lines()[0].get_xdata()[0] == 1  # steps counted from 1
    finally:
        plt.close("all")


def test_the_step_times_say_their_whiskers_are_quartiles():
    """L6, L13: the error bars were unlabelled quartiles."""
    variants = [{"variant": v, "time_s": t, "time_q1_s": t * 0.97, "time_q3_s": t * 1.02}
                for v, t in (("local (no sync)", 0.17), ("NaiveDDP", 0.19), ("torch DDP 25 MB", 0.176))]  # fmt: skip
    record = {"config": {"model": "cnn", "batch_size": 128}, "environment": {**ENVIRONMENT, "world_size": 2},
              "metrics": {"variants": variants}}  # fmt: skip
    ax = plots.plot_step_times(record)
    try:
        assert "quartiles" in " ".join(t.get_text() for t in ax.get_legend().get_texts())
    finally:
        plt.close("all")


def test_a_prediction_range_with_equal_ends_is_one_number():
    """L7: "9,705,760-9,705,760 tokens/s"."""
    assert plots.number_range(9_705_760.2, 9_705_759.9) == "9,705,760"
    assert plots.number_range(6_842_523, 8_535_925) == "6,842,523-8,535,925"
