"""Figures, labelled from result files, one module per chapter's subject; every plot_* is here too.

Each figure takes result records (as :func:`distlab.results.read_result` returns them) and labels the
hardware from the records' own environment, or, for a picture of who holds and sends what, the calls a page's
own code made on traced ranks (:func:`distlab.exercises.run_on_ranks`) or the plan it follows. Every figure is
re-exported here: ``from distlab import plots; plots.plot_busbw(...)``. A figure draws records and predictions;
it never imports a benchmark (what it needs of one lives in :mod:`distlab.predict`).

May import: config, results, comm, predict, measure.
"""

from .checkpointing import plot_checkpointing_run as plot_checkpointing_run
from .collectives import (
    LINE_STYLES,
    plot_busbw,
    plot_bytes_per_rank,
    plot_shard_collectives,
    plot_shard_steps,
    plot_step_collectives,
    plot_time_model,
    step_call_order,
)
from .common import jshtml, run_label
from .compile import plot_compiled_backward as plot_compiled_backward
from .ddp import plot_bucket_schedule, plot_gradient_averaging, plot_step_times, plot_timeline, traced_all_reduces
from .fp16 import plot_scaler_run, plot_underflow
from .gpu_report import plot_report_bandwidth, plot_report_sweep
from .hooks import plot_hooks_run as plot_hooks_run
from .memory import (
    MEMORY_COLORS,
    ddp_or_fsdp_records,
    fsdp_unit_frames,
    plot_ddp_or_fsdp_run,
    plot_fsdp_options,
    plot_fsdp_unit_steps,
    plot_memory_timeline,
    plot_state_bars,
    plot_state_per_rank,
)
from .practice import plot_accumulation_run as plot_accumulation_run
from .practice import plot_frozen_base_run as plot_frozen_base_run
from .profile import plot_memory_layers
from .profile import plot_profiled_step as plot_profiled_step
from .ring_animation import plot_holdings, plot_ring_steps, plot_sharding_bridge
from .streams import (
    STREAM_COLORS,
    animate_copy_compute_ratio,
    copy_path_holdings,
    plot_copy_paths,
    plot_host_costs,
    plot_speedup_curves,
    plot_stream_timeline,
    plot_stream_timelines,
    stream_legend,
)
from .sweep import SWEEP_COLORS, plot_compute_vs_allreduce, plot_gpu_predictions, plot_model_against_sweep, plot_sweep
from .training import (
    FOOTPRINT_COLORS,
    LAB_FIGURE_INCHES,
    SAME_TRAINING,
    global_batch,
    largest_step_loss_difference,
    number_range,
    peak_allocated_gib,
    plot_fsdp_step_options,
    plot_loss_curves,
    plot_predicted_footprint,
    plot_state_against_prediction,
    plot_throughput,
    plot_tokens_per_s,
    plot_training_runs,
    same_training,
    step_loss_differences,
    step_losses,
    throughput,
    throughput_speedup,
    training_label,
    warm_step_ms,
)
from .transfer import (
    plot_copy_bandwidth,
    plot_measured_vs_predicted_bandwidth,
    plot_overlap_timeline,
    plot_transfer_against_model,
)

__all__ = [
    "LINE_STYLES",
    "plot_busbw",
    "plot_time_model",
    "plot_shard_collectives",
    "plot_bytes_per_rank",
    "plot_shard_steps",
    "plot_step_collectives",
    "step_call_order",
    "run_label",
    "jshtml",
    "plot_step_times",
    "plot_gradient_averaging",
    "plot_bucket_schedule",
    "traced_all_reduces",
    "plot_underflow",
    "plot_scaler_run",
    "plot_report_bandwidth",
    "plot_report_sweep",
    "plot_timeline",
    "MEMORY_COLORS",
    "plot_memory_layers",
    "plot_memory_timeline",
    "plot_state_per_rank",
    "plot_state_bars",
    "plot_fsdp_options",
    "fsdp_unit_frames",
    "plot_fsdp_unit_steps",
    "ddp_or_fsdp_records",
    "plot_ddp_or_fsdp_run",
    "plot_holdings",
    "plot_ring_steps",
    "plot_sharding_bridge",
    "STREAM_COLORS",
    "plot_host_costs",
    "plot_stream_timeline",
    "stream_legend",
    "plot_stream_timelines",
    "plot_speedup_curves",
    "animate_copy_compute_ratio",
    "copy_path_holdings",
    "plot_copy_paths",
    "SWEEP_COLORS",
    "plot_sweep",
    "plot_model_against_sweep",
    "plot_gpu_predictions",
    "plot_compute_vs_allreduce",
    "plot_loss_curves",
    "plot_throughput",
    "plot_training_runs",
    "LAB_FIGURE_INCHES",
    "throughput",
    "throughput_speedup",
    "step_losses",
    "step_loss_differences",
    "largest_step_loss_difference",
    "training_label",
    "SAME_TRAINING",
    "global_batch",
    "same_training",
    "FOOTPRINT_COLORS",
    "number_range",
    "peak_allocated_gib",
    "warm_step_ms",
    "plot_state_against_prediction",
    "plot_predicted_footprint",
    "plot_tokens_per_s",
    "plot_fsdp_step_options",
    "plot_copy_bandwidth",
    "plot_overlap_timeline",
    "plot_measured_vs_predicted_bandwidth",
    "plot_transfer_against_model",
]
