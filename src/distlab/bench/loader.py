"""The DataLoader end to end: the course's CNN trained under DDP with each input pipeline on the same GPU(s),
pin_memory and non_blocking on and off, and the device-resident loader; part of :mod:`distlab.bench.transfer`'s
result. Needs CUDA."""

from __future__ import annotations

from .harness import require_cuda, summarize_times, take_turns

_ON = {False: "off", True: "on"}
LOADER_VARIANTS = {
    f"pin_memory {_ON[pin]}, non_blocking {_ON[non_blocking]}": dict(pin_memory=pin, non_blocking=non_blocking)
    for pin in (False, True)
    for non_blocking in (False, True)
} | {"device-resident": dict(loader="device")}
CNN_UNDER_DDP = dict(strategy="ddp", model="cnn", dataset="synthetic", device="cuda", num_workers=2, log_every=-1)
"""The run every variant shares (as ``distlab.train``'s flags): the course CNN under DDP on synthetic images."""


def loader_end_to_end(
    runtime,
    epochs: int = 1,
    batch_size: int = 128,
    max_steps: int = 0,
    synthetic_size: int = 60000,
    repeats: int = 3,
    warmup_steps: int = 20,
) -> list[dict]:
    """Train the course CNN with each input pipeline on the same GPU(s):
    pin_memory and non_blocking on and off, and the device-resident loader.

    A warm-up round first (``warmup_steps`` steps of every variant, untimed:
    lazy CUDA loading, cuDNN, the allocator, worker start-up), then
    ``repeats`` rounds in which the variants take turns. Returns the median
    samples/s per variant with its quartiles."""
    require_cuda("the DataLoader end-to-end comparison")
    from ..config import TrainConfig
    from ..train import train

    sizes = dict(epochs=epochs, batch_size=batch_size, synthetic_size=synthetic_size)

    def config(name: str, steps: int) -> TrainConfig:
        return TrainConfig.from_flags(**CNN_UNDER_DDP, **sizes, max_steps=steps, **LOADER_VARIANTS[name])

    epochs_seen: dict[str, list[dict]] = {name: [] for name in LOADER_VARIANTS}

    def run(name: str) -> float:
        record = train(config(name, max_steps), runtime).history[-1]
        epochs_seen[name].append(record)
        return record["samples_per_s"]

    warm = lambda name: train(config(name, warmup_steps), runtime)
    rates = take_turns(list(LOADER_VARIANTS), run, repeats=repeats, warmup=1, warmup_run=warm)
    rows = []
    for name, samples in rates.items():
        stats = summarize_times(samples)  # quartiles of a list of numbers: here samples/s
        rows.append(
            {
                "variant": name,
                "samples_per_s": stats["time_s"],
                "samples_per_s_q1": stats["time_q1_s"],
                "samples_per_s_q3": stats["time_q3_s"],
                "samples_per_s_runs": samples,
                "epoch_time_s": summarize_times([r["epoch_time_s"] for r in epochs_seen[name]])["time_s"],
                "data_wait_s": summarize_times([r["data_wait_s"] for r in epochs_seen[name]])["time_s"],
                "repeats": repeats,
                "config": config(name, max_steps).to_dict(),
            }
        )
        runtime.log(f"  {name:<34} {rows[-1]['samples_per_s']:>10,.0f} samples/s (median of {repeats})")
    return rows
