"""The sweep of strategies on GPT presets, the cost model against it, and the model on cited GPUs (the
DDP-vs-FSDP chapter).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from .common import _hardware_title

SWEEP_COLORS = {"ddp": "C0", "zero1": "C1", "zero2": "C2", "zero3": "C3", "fsdp": "C4", "fsdp-no-reshard": "C5"}


def point_label(preset: dict, sized: bool) -> str:
    """A sweep point's tick: its preset, and where the run sized its points, its batch and its label."""
    if not sized:
        return preset["model"]
    label = f"{preset['model']}\n{preset['batch_size']}x{preset['seq_len']}"
    return label + {"launch-bound": "\nlaunch-bound", "fsdp2-sized": "\nFSDP2 alone"}.get(preset.get("point"), "")


def plot_sweep(records: Sequence[dict]):
    """The sweep, measured: step time, peak memory per rank and bytes sent per rank per step,
    for every strategy and preset, one column per world size (one result file each). A point sized for the
    GPU is labelled with its batch; the launch-bound point says so."""
    records = sorted(records, key=lambda r: r["environment"]["world_size"])
    fig, axes = plt.subplots(3, len(records), figsize=(4.2 * len(records), 8.5), squeeze=False)
    measures = (
        ("step time (ms, slowest rank)", lambda row: 1e3 * row["time_s"]),
        ("peak memory per rank (MiB)", lambda row: max(r["peak"] for r in row["memory"]["ranks"]) / 2**20),
        ("MiB sent per rank per step", lambda row: sum(t["bytes_sent"] for t in row["traffic"].values()) / 2**20),
    )
    for column, record in zip(axes.T, records):
        presets = record["metrics"]["presets"]
        sized = any(p.get("point") for p in presets)
        variants = [row["variant"] for row in presets[0]["variants"]]
        width = 0.8 / len(variants)
        for ax, (label, value) in zip(column, measures):
            for i, variant in enumerate(variants):
                ran = [(k, row) for k, p in enumerate(presets) for row in p["variants"] if row["variant"] == variant]
                xs = [k + (i - (len(variants) - 1) / 2) * width for k, _ in ran]  # the FSDP2 point runs FSDP2 alone
                ax.bar(xs, [value(row) for _, row in ran], width, color=SWEEP_COLORS.get(variant), label=variant)
            ax.set_xticks(range(len(presets)), [point_label(p, sized) for p in presets], fontsize=8)
            if any(patch.get_height() > 0 for patch in ax.patches):
                ax.set_yscale("log")
            else:
                ax.text(0.5, 0.5, "nothing to send on one rank", transform=ax.transAxes, ha="center", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
        column[0].set_title(f"{record['environment']['world_size']} rank(s)", fontsize=9)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(_hardware_title(records), fontsize=9)
    fig.tight_layout()
    return fig


def plot_model_against_sweep(rows: Sequence[dict], time_band: float = 0.15, memory_band: float = 0.05, title: str = ""):
    """The cost model's step time and peak memory (y) against the measured ones (x), every point of the
    sweep; the shaded bands are the model's goals (within 15 % in time, 5 % in memory). ``title`` says what the
    model saw (each point left out of its fit, or a fit)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    markers = {1: "o", 2: "s", 4: "^", 8: "D"}
    for ax, (measured, predicted, band, scale, unit) in zip(
        axes,
        (("measured_s", "predicted_s", time_band, 1e3, "step time (ms)"),
         ("measured_peak", "predicted_peak", memory_band, 2**-20, "peak memory per rank (MiB)")),
    ):  # fmt: skip
        xs = [r[measured] * scale for r in rows]
        low, high = min(xs) / 1.5, max(xs) * 1.5
        line = [low, high]
        ax.fill_between(line, [v * (1 - band) for v in line], [v * (1 + band) for v in line], color="0.9")
        ax.plot(line, line, color="0.5", lw=0.8)
        for r, x in zip(rows, xs):
            ax.scatter(
                x,
                r[predicted] * scale,
                color=SWEEP_COLORS.get(r["variant"]),
                marker=markers.get(r["world_size"], "x"),
                s=22,
            )
        ax.set(xscale="log", yscale="log", xlabel=f"measured {unit}", ylabel=f"predicted {unit}", xlim=line, ylim=line)
        ax.set_title(f"within {band:.0%}: shaded", fontsize=9)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=v) for v, c in SWEEP_COLORS.items()]
    handles += [plt.Line2D([], [], color="0.3", marker=m, ls="", label=f"{n} rank(s)") for n, m in markers.items()
                if any(r["world_size"] == n for r in rows)]  # fmt: skip
    axes[1].legend(handles=handles, fontsize=7, ncol=2, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_gpu_predictions(rows: Sequence[dict]):
    """PREDICTED, from cited specifications: tokens per second (a bar from no overlap to the best
    overlap) and memory per GPU against what the GPU holds, per system, preset and strategy."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(2, len(systems), figsize=(4.4 * len(systems), 6.5), squeeze=False)
    for column, system in zip(axes.T, systems):
        mine = [r for r in rows if r["system"] == system]
        models = list(dict.fromkeys(r["model"] for r in mine))
        variants = list(dict.fromkeys(r["variant"] for r in mine))
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            chosen = [next(r for r in mine if r["model"] == m and r["variant"] == variant) for m in models]
            xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(models))]
            low = [r["tokens_per_s_no_overlap"] for r in chosen]
            high = [r["tokens_per_s_best_overlap"] for r in chosen]
            color = SWEEP_COLORS.get(variant)
            column[0].bar(xs, [h - lo for h, lo in zip(high, low)], width, bottom=low, color=color, label=variant)
            column[0].scatter(xs, low, color=color, marker="_", s=60)
            column[1].bar(xs, [r["peak_bytes"] / 2**30 for r in chosen], width, color=color, hatch="//", alpha=0.8)
        usable = mine[0]["usable_memory_bytes"] / 2**30
        column[1].axhline(usable, color="k", lw=1, ls="--", label=f"{usable:.1f} GiB per GPU")
        for ax in column:
            ax.set_xticks(range(len(models)), models, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
        column[0].set(yscale="log", ylabel="tokens/s, all GPUs (PREDICTED)")
        column[1].set(yscale="log", ylabel="peak GiB per GPU (PREDICTED)")
        column[0].set_title(f"{mine[0]['gpus']}x {mine[0]['gpu']}", fontsize=9)
        column[1].legend(fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("PREDICTED by the cost model from cited specifications; not measured", fontsize=10, color="C3")
    fig.tight_layout()
    return fig


def _coincide(a: tuple, b: tuple, within: float = 0.02) -> bool:
    """Whether two systems' (compute line, all-reduce level) are drawn on top of each other."""
    (compute_a, allreduce_a), (compute_b, allreduce_b) = a, b
    pairs = zip([*compute_a, allreduce_a], [*compute_b, allreduce_b])
    return all(abs(x - y) <= within * max(abs(x), abs(y)) for x, y in pairs)


def plot_compute_vs_allreduce(systems=None, tokens: Sequence[float] | None = None):
    """PREDICTED, from cited specifications: per parameter of any model, the time a step computes (6 FLOPs per
    parameter per token at the GPU's peak times its MFU, :func:`distlab.predict.gpu_predictions.achieved_flops`)
    and the time DDP's fp32 ring all-reduce takes with nothing hidden (2 (n-1)/n x 4 bytes per parameter at the bus
    bandwidth), against tokens per GPU, for each multi-GPU system (``gpu_predictions.SYSTEMS`` by default). The two
    cross at :func:`distlab.predict.gpu_predictions.crossing_tokens`, marked: above it compute covers the
    all-reduce, whatever the model's size. Each system's lines carry ``gid`` ``"<key> compute"``, ``"<key>
    all-reduce"`` and ``"<key> crossing"``, in seconds per billion parameters."""
    from ..predict import gpu_predictions
    from ..predict.gpu_specs import SYSTEMS

    systems = {k: s for k, s in (systems or SYSTEMS).items() if s.count > 1}  # one GPU sends nothing
    tokens = list(tokens or [2**k for k in range(5, 18)])
    fig, ax = plt.subplots(figsize=(6.8, 5.0))
    billion = 1e9
    names = {key: f"{s.count}x {s.gpu.name.split(' (')[0].removeprefix('NVIDIA ')}" for key, s in systems.items()}
    lines = {
        key: (
            [6 * billion * t / gpu_predictions.achieved_flops(s.gpu) for t in tokens],
            2 * (s.count - 1) / s.count * 4 * billion / s.allreduce_busbw,
        )
        for key, s in systems.items()
    }
    for index, (key, system) in enumerate(systems.items()):
        color = f"C{index}"
        compute, allreduce = lines[key]
        # a system whose two lines a later one draws over (within 2%: 8x H100 and 8x H200) says so in the legend
        over = [names[k] for k in list(systems)[index + 1 :] if _coincide(lines[key], lines[k])]
        name = names[key] + (f" (under the {over[0]} line)" if over else "")
        width = 3.2 - 0.6 * index  # systems with the same GPU draw the same compute line: the wider shows under
        ax.plot(tokens, compute, color=color, lw=width, gid=f"{key} compute", label=f"{name}: compute")
        ax.plot(tokens, [allreduce] * len(tokens), color=color, lw=width * 0.8, ls="--", gid=f"{key} all-reduce",
                label=f"{name}: fp32 all-reduce, nothing hidden")  # fmt: skip
        t = gpu_predictions.crossing_tokens(system)
        ax.plot([t], [allreduce], "o", color=color, ms=6, gid=f"{key} crossing")
        ax.annotate(f"{t:,.0f}", (t, allreduce), textcoords="offset points", xytext=(4, 5 + 8 * (index % 2)),
                    fontsize=8, color=color)  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="tokens per GPU per step",
           ylabel="seconds per billion parameters")  # fmt: skip
    ax.set_title("PREDICTED from cited specifications: compute against DDP's unhidden fp32 all-reduce;\n"
                 "they cross at t = 8(n-1)/n x peak x MFU / (6 x busbw) tokens per GPU, marked",
                 fontsize=9, color="C3")  # fmt: skip
    handles = [plt.Line2D([], [], color=f"C{i}", lw=2, label=line.get_label().removesuffix(": compute"))
               for i, line in enumerate(ln for ln in ax.lines if ln.get_gid().endswith(" compute"))]  # fmt: skip
    handles += [plt.Line2D([], [], color="0.3", lw=2, label="compute"),
                plt.Line2D([], [], color="0.3", lw=2, ls="--", label="fp32 all-reduce, nothing hidden")]  # fmt: skip
    ax.legend(handles=handles, fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
