"""The DDP-vs-FSDP chapter's pictures and tables, made by code from the course's models and results: P10 (compute
against DDP's unhidden fp32 all-reduce, PREDICTED, crossing where the chapter's formula says and near where the cost
model does), a GPU report's sweep figure (the numbers its summary holds, each point's regime), the bytes-per-value
table (from the collectives the cost model lists), and the chapter's first program (its printed traffic is what
the two strategies really send)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from distlab import plots  # noqa: E402
from distlab.gpu_report import schema, summary  # noqa: E402
from distlab.predict import costmodel, gpu_predictions  # noqa: E402
from distlab.predict.gpu_specs import SYSTEMS  # noqa: E402
from distlab.results import committed_results  # noqa: E402
from support import run_page_program  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "ddp_vs_fsdp.md"


def _lines(fig) -> dict:
    return {line.get_gid(): line for line in fig.axes[0].lines if line.get_gid()}


def test_p10_draws_each_multi_gpu_systems_compute_and_all_reduce_from_its_cited_figures():
    """Per billion parameters: compute 6 x 1e9 x t / (peak x MFU), DDP's fp32 all-reduce 2(n-1)/n x 4e9 / busbw, for
    every system of more than one GPU (one GPU sends nothing), crossing at the chapter's t*; labelled PREDICTED."""
    fig = plots.plot_compute_vs_allreduce()
    lines = _lines(fig)
    multi = {key: s for key, s in SYSTEMS.items() if s.count > 1}
    assert {gid.rsplit(" ", 1)[0] for gid in lines} == set(multi) and "H200x1" in SYSTEMS
    assert "PREDICTED" in fig.axes[0].get_title()
    for key, system in multi.items():
        n, achieved = system.count, gpu_predictions.achieved_flops(system.gpu)
        tokens, compute = lines[f"{key} compute"].get_data()
        assert list(compute) == pytest.approx([6e9 * t / achieved for t in tokens])
        allreduce = 2 * (n - 1) / n * 4e9 / system.allreduce_busbw
        ys = list(lines[f"{key} all-reduce"].get_ydata())
        assert ys == pytest.approx([allreduce] * len(ys))
        (t,), (y,) = lines[f"{key} crossing"].get_data()
        assert t == pytest.approx(8 * (n - 1) / n * achieved / (6 * system.allreduce_busbw))
        assert y == pytest.approx(allreduce) and 6e9 * t / achieved == pytest.approx(allreduce)  # the lines cross
    matplotlib.pyplot.close(fig)


def test_p10s_crossing_is_near_the_cost_models_and_moves_with_the_link():
    """The formula leaves out attention's FLOPs and the buckets' latencies: the cost model's own crossing (DDP, nothing
    hidden, gpt-small and gpt-xl) is within a quarter of it on every system. Halve the bus bandwidth and the figure's
    crossing doubles: it is drawn from the systems it is given."""
    for key, system in ((k, s) for k, s in SYSTEMS.items() if s.count > 1):
        formula = gpu_predictions.crossing_tokens(system)
        for model in ("gpt-small", "gpt-xl"):
            r = gpu_predictions.predict(system, model, "ddp", system.count, 2048, 1024)
            assert 0.8 < 2048 * r["communication_s"] / r["compute_s"] / formula < 1.25, (key, model)
    assert gpu_predictions.crossing_tokens(SYSTEMS["H200x1"]) is None
    slow = {"A100x2": dataclasses.replace(SYSTEMS["A100x2"], allreduce_busbw=SYSTEMS["A100x2"].allreduce_busbw / 2)}
    fig = plots.plot_compute_vs_allreduce(slow)
    ((t,), _) = _lines(fig)["A100x2 crossing"].get_data()
    assert t == pytest.approx(2 * gpu_predictions.crossing_tokens(SYSTEMS["A100x2"]))
    matplotlib.pyplot.close(fig)


def test_a_reports_sweep_figure_draws_its_summary_left_out_and_fitted_and_says_one_rank_sends_nothing():
    """Three bars per row, in the order measured, left out, fitted, each the summary's milliseconds (none where the
    run has too few points to leave one out); the labels say which point is launch-bound; the title names the
    machine and the single rank."""
    for report in schema.read_reports(committed_results("gpu")):
        rows = summary.of_report(report)["sweep"]
        fig = plots.plot_report_sweep(report | {"summary": {"sweep": rows}})
        ax = fig.axes[0]
        bars = [patch.get_width() for patch in ax.patches]
        for k, key in enumerate(("measured_s", "left_out_s", "model_s")):
            assert bars[k * len(rows) : (k + 1) * len(rows)] == pytest.approx(
                [0.0 if r[key] is None else 1e3 * r[key] for r in rows]
            )
        assert [text.get_text() for text in ax.get_legend().get_texts()] == [
            "measured", "cost model, this point left out of its fit", "fit: every point in it, this one too"
        ]  # fmt: skip
        labels = [tick.get_text() for tick in ax.get_yticklabels()]
        bound = [schema.regime(r) == "launch-bound" for r in rows]
        assert [label.endswith("(launch-bound)") for label in labels] == bound
        assert ax.get_title() == f"Measured on {schema.label(report)}, 1 rank: nothing sent between ranks"
        matplotlib.pyplot.close(fig)


def test_the_bytes_per_value_table_is_the_cost_models_collectives():
    """The chapter's table of bytes per value on the wire (per (n-1)/n), computed as the page computes it, from
    collective_calls on units with no root: 8, 12, 8, 6, 6, 4; and the same from the exercise's library reference."""
    units, n, values = [[(512, 512)]] * 4 + [[]], 2, 4 * 512 * 512

    def per_value(strategy, reduce_bytes, gather_bytes):
        calls = costmodel.collective_calls(strategy, units, n, "nccl", reduce_bytes, gather_bytes=gather_bytes)
        return sum(size * costmodel.RING_FACTOR[c](n) for c, _, size in calls) / ((n - 1) / n) / values

    wires = [("ddp", 4, 4), ("fsdp", 4, 4), ("fsdp", 4, 2), ("fsdp", 2, 2), ("fsdp-no-reshard", 4, 2), ("ddp", 2, 2)]
    assert [per_value(*w) for w in wires] == [8, 12, 8, 6, 6, 4]
    text = PAGE.read_text()
    cell = text[text.index("(ddp-vs-fsdp-wire)=") : text.index("### Exercise 2:")]
    assert 'costmodel.collective_calls(strategy, units, n, "nccl", reduce_bytes, gather_bytes=gather_bytes)' in cell
    assert "units, n = [[(512, 512)]] * 4 + [[]], 2" in cell


@pytest.mark.slow  # a page's torchrun program (CONTRIBUTING: torchrun itself); the build runs it too
def test_the_chapters_first_program_prints_what_each_strategy_really_holds_and_sends(tmp_path):
    """The page's program on two gloo ranks: DDP holds the whole 4.01 MiB and sends it in one all-reduce; FSDP2
    holds half and sends 1.5x in one dtype, 8 all-gathers (each of 4 units in forward and backward) and 4
    reduce-scatters; every rank prints one line per strategy, the lines unmixed."""
    done = run_page_program("ddp_vs_fsdp.md", "ddp_or_fsdp.py", tmp_path)
    assert len((tmp_path / "ddp_or_fsdp.py").read_text().splitlines()) <= 36
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == [
        "rank 0 DDP: holds 4.01 MiB of parameters, sent 4.01 MiB in 1 all_reduce",
        "rank 0 FSDP2: holds 2.00 MiB of parameters, sent 6.01 MiB in 8 all_gather, 4 reduce_scatter",
        "rank 1 DDP: holds 4.01 MiB of parameters, sent 4.01 MiB in 1 all_reduce",
        "rank 1 FSDP2: holds 2.00 MiB of parameters, sent 6.01 MiB in 8 all_gather, 4 reduce_scatter",
    ]
    parameters = 4 * (512 * 512 + 512)
    assert f"{parameters * 4 / 2**20:.2f}" == "4.01"  # fp32, all on every DDP rank; FSDP2 keeps half, sends 1.5x
    assert f"{1.5 * parameters * 4 / 2**20:.2f}" == "6.01"
    # the page opens on this run drawn in the course's grammar: from the very lines it printed
    layers = [(f"layer {i}", [(512, 512), (512,)]) for i in range(4)]
    fig = plots.plot_ddp_or_fsdp_run(done.stdout, layers)
    ddp, fsdp = fig.axes
    assert "4.01 MiB" in ddp.get_title() and "1 all_reduce" in ddp.get_title().replace("\n", " ")
    assert "6.01 MiB in 8 all_gather, 4 reduce_scatter" in fsdp.get_title().replace("\n", " ")
    matplotlib.pyplot.close(fig)


MLP = [(f"layer {i}", [(512, 512), (512,)]) for i in range(4)]
PRINTED = "\n".join(
    f"rank {r} DDP: holds 4.01 MiB of parameters, sent 4.01 MiB in 1 all_reduce\n"
    f"rank {r} FSDP2: holds 2.00 MiB of parameters, sent 6.01 MiB in 8 all_gather, 4 reduce_scatter"
    for r in range(2)
)


def _cells(ax) -> list[list[str]]:
    """Each rank's row of cell labels, top to bottom, as plot_holdings placed them."""
    rows: dict[float, list] = {}
    for text in ax.texts:
        x, y = text.get_position()
        rows.setdefault(-y, []).append((x, text.get_text()))
    return [[label for _, label in sorted(row)] for _, row in sorted(rows.items())]


def test_the_ddp_or_fsdp_picture_draws_what_each_rank_of_the_run_holds_and_sends():
    """Rows are the ranks, columns the layers: DDP's cells whole, FSDP2's each rank's rows (Shard(0)); every cell red
    (every layer's bytes go into the collectives); under each layer what a rank sends for it, which adds up to
    what the run printed; the titles are the run's own numbers."""
    records = plots.ddp_or_fsdp_records(PRINTED)
    assert list(records) == ["DDP", "FSDP2"] and records["FSDP2"][1]["calls"] == {"all_gather": 8, "reduce_scatter": 4}
    fig = plots.plot_ddp_or_fsdp_run(PRINTED, MLP)
    ddp, fsdp = fig.axes
    assert _cells(ddp) == [["whole\n1.00 MiB"] * 4] * 2
    assert _cells(fsdp) == [["rows 0-255\n0.50 MiB"] * 4, ["rows 256-511\n0.50 MiB"] * 4]
    for ax in (ddp, fsdp):
        outlined = [p for p in ax.patches if type(p).__name__ == "Rectangle" and not p.get_fill()]
        assert len(outlined) == 2 * 4
    assert [t.get_text() for t in ddp.get_xticklabels()][0] == "layer 0\nsends 1.00 MiB\n(AR)"
    assert [t.get_text() for t in fsdp.get_xticklabels()][3] == "layer 3\nsends 1.50 MiB\n(2 AG + 1 RS)"
    assert "each rank holds 2.00 MiB of parameters (its rows of each layer)" in fsdp.get_title().replace("\n", " ")
    matplotlib.pyplot.close(fig)


def test_the_ddp_or_fsdp_picture_refuses_layers_that_are_not_the_runs():
    with pytest.raises(ValueError, match="DDP rank 0 sent 4.01 MiB; its layers give 3.01 MiB"):
        plots.plot_ddp_or_fsdp_run(PRINTED, MLP[:3])
    with pytest.raises(ValueError, match="pass the output of the ddp_or_fsdp.py run"):
        plots.ddp_or_fsdp_records("W1207 a torchrun warning and nothing else")
    matplotlib.pyplot.close("all")


def test_the_crossing_legend_says_which_systems_line_is_under_another():
    """8x H100 and 8x H200 draw the same lines (the same peak, bus bandwidths 1% apart): the legend says the H100's
    are under the H200's, and says it of no other system."""
    fig = plots.plot_compute_vs_allreduce()
    labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert "8x H100 80 GB (under the 8x H200 141 GB line)" in labels
    assert [label for label in labels if "under" in label] == ["8x H100 80 GB (under the 8x H200 141 GB line)"]
    apart = {key: s for key, s in SYSTEMS.items() if key != "H200x8"}
    fig_apart = plots.plot_compute_vs_allreduce(apart)
    assert not [t.get_text() for t in fig_apart.axes[0].get_legend().get_texts() if "under" in t.get_text()]
    matplotlib.pyplot.close("all")
