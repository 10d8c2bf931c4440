"""The checkpointing chapter (book/checkpointing.md): the activations the course's tracker measures under DDP, with
and without checkpointing each block, are the model's to the byte; the DDP table of reentrant checkpointing against
find_unused_parameters is the one torch's source explains; the page's picture draws its run in the book's column."""

from __future__ import annotations

import io
import struct
from functools import partial

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.plots.checkpointing import checkpointing_records  # noqa: E402
from distlab.predict.checkpointing import (  # noqa: E402
    checkpointed_activation_bytes,
    mlp_activation_peak_bytes,
    mlp_block_bytes,
)
from support import run_page_program  # noqa: E402

BATCH, WIDTH, HIDDEN, BLOCKS = 256, 64, 256, 4  # the page's model


def _peak_activations(runtime, checkpointed: bool, batch: int, width: int, hidden: int, blocks: int) -> int:
    """The page's measurement on a pool rank: DDP over an embedding and ``blocks`` MLP blocks, each checkpointed
    (non-reentrant) or not; the most activation bytes the tracker counts in the third step."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    from distlab.measure.memory import MemoryTracker

    torch.manual_seed(0)
    layers = [
        torch.nn.Sequential(
            torch.nn.Linear(width, hidden, bias=False), torch.nn.GELU(), torch.nn.Linear(hidden, width, bias=False)
        )
        for _ in range(blocks)
    ]
    if checkpointed:
        for block in layers:
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    net = DDP(torch.nn.Sequential(torch.nn.Embedding(256, width), *layers))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    tokens = torch.randint(0, 256, (batch,), generator=torch.Generator().manual_seed(runtime.rank))

    def step():
        net(tokens).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(), step()  # DDP rebuilds its buckets, in forward, in the second step
    named = lambda: {"gradients": [p.grad for p in net.parameters() if p.grad is not None]}  # noqa: E731
    with MemoryTracker(named, net) as tracker:
        step()
    return max(sample.by_category["activations"] for sample in tracker.timeline)


@pytest.mark.parametrize("shape", [(BATCH, WIDTH, HIDDEN, BLOCKS), (96, 40, 120, 3)])
def test_the_tracker_measures_what_the_model_predicts_to_the_byte(ranks2, shape):
    """Without checkpointing every block's input and inside; with each block checkpointed every input and one
    inside; on top of either the last block's backward and the loss: on each of two DDP ranks, exactly."""
    for checkpointed in (False, True):
        measured = ranks2.run(_peak_activations, checkpointed, *shape)
        assert measured == [mlp_activation_peak_bytes(*shape, checkpointed)] * 2, (shape, checkpointed)


def test_one_block_or_the_whole_model_checkpointed_saves_nothing_at_the_peak():
    input_bytes, inside_bytes = mlp_block_bytes(BATCH, WIDTH, HIDDEN)
    assert (input_bytes, inside_bytes) == (BATCH * WIDTH * 4, 2 * BATCH * HIDDEN * 4)
    everything = BLOCKS * (input_bytes + inside_bytes)
    assert checkpointed_activation_bytes(input_bytes, everything - input_bytes, 1, True) == everything
    assert checkpointed_activation_bytes(input_bytes, inside_bytes, BLOCKS, True) == everything - 3 * inside_bytes
    with pytest.raises(ValueError, match="blocks must be 1 or more"):
        checkpointed_activation_bytes(1, 1, 0, True)


@pytest.mark.slow  # a page's torchrun program (CONTRIBUTING: torchrun itself); the build runs it too
def test_reentrant_checkpointing_fails_under_find_unused_parameters_and_the_rest_train(tmp_path):
    """The page's DDP table, as its program prints it on two gloo ranks: the reentrant checkpoint's blocks are
    unreached by find_unused_parameters' walk, marked ready in advance, and marked again by the nested backward."""
    done = run_page_program("checkpointing.md", "ddp_checkpointing.py", tmp_path)
    assert len((tmp_path / "ddp_checkpointing.py").read_text().splitlines()) <= 40
    rows = [line.split(maxsplit=2) for line in done.stdout.splitlines() if line.startswith("use_reentrant=")]
    assert [row[:2] for row in rows] == [
        [f"use_reentrant={r}", f"find_unused_parameters={f}"] for r in (True, False) for f in (False, True)
    ]
    results = [row[2] for row in rows]
    assert results[1] == "RuntimeError: Expected to mark a variable ready only once"
    for trained in (results[0], results[2], results[3]):
        first, second = trained.removeprefix("trains: the weights sum to ").split(" on rank 0, ")
        assert second == f"{first} on rank 1", trained  # one model on both ranks


def _printed(activations: dict[tuple[str, str], int]) -> str:
    return "\n".join(
        f"rank {rank} {strategy}, checkpointing {where}: activations at the peak {held:,} B; step 9.5 ms "
        "(median of 3, CPU)"
        for (strategy, where), held in activations.items()
        for rank in (0, 1)
    )


def _check_picture(printed: str) -> None:
    """Under each column what one rank holds of it, from the model, adding up to the measured peak in the title;
    in the book's 688 px column with text of 9 pt or more."""
    fig = plots.plot_checkpointing_run(printed)
    labels = [t.get_text() for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    input_bytes, inside_bytes = mlp_block_bytes(BATCH, WIDTH, HIDDEN)
    assert f"block 0\n{input_bytes + inside_bytes:,} B" in labels
    assert f"block 0\n{input_bytes:,} B" in labels and f"block 3\n{input_bytes + inside_bytes:,} B" in labels
    for checkpointed in (False, True):
        peak = mlp_activation_peak_bytes(BATCH, WIDTH, HIDDEN, BLOCKS, checkpointed)
        assert any(f"measured {peak:,} B" in label and f"(predicted {peak:,} B)" in label for label in labels)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    width = struct.unpack(">I", buffer.getvalue()[16:20])[0]
    assert width <= 688 and min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 9
    plt.close("all")


def test_the_picture_draws_the_run_in_the_column():
    peaks = {
        ("DDP", w): mlp_activation_peak_bytes(BATCH, WIDTH, HIDDEN, BLOCKS, w != "none") for w in ("none", "each block")
    }
    _check_picture(_printed(peaks))
    with pytest.raises(ValueError, match="pass the output of the checkpointing.py run"):
        plots.plot_checkpointing_run("rank 0 DDP: nothing")


@pytest.mark.slow
def test_the_page_program_measures_every_granularity(tmp_path):
    """The page's own program on two gloo ranks: DDP's peaks are the model's; under FSDP2 each block checkpointed
    holds the least, the whole model and each Linear about as much as nothing."""
    done = run_page_program("checkpointing.md", "checkpointing.py", tmp_path)
    records = checkpointing_records(done.stdout)
    for where in ("none", "each block"):
        predicted = mlp_activation_peak_bytes(BATCH, WIDTH, HIDDEN, BLOCKS, where == "each block")
        assert [records["DDP", where][r]["activations"] for r in (0, 1)] == [predicted] * 2
    for rank in (0, 1):  # FSDP2's own buffers vary by a block's weights from run to run: compared, not counted
        fsdp = {where: records["FSDP2", where][rank]["activations"] for where in ("none", "each block")}
        fsdp |= {where: records["FSDP2", where][rank]["activations"] for where in ("whole model", "each Linear")}
        assert fsdp["each block"] < 0.6 * fsdp["none"]
        assert min(fsdp["whole model"], fsdp["each Linear"]) > 0.9 * fsdp["none"]
    _check_picture(done.stdout)
