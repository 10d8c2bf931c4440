"""The communication hooks chapter (book/comm_hooks.md): its timing program counts what the prediction says for
every hook and trains as fp32 does; its picture draws from the lines the program prints; the PowerSGD prediction
equals what torch's powerSGD_hook all-reduces."""

from __future__ import annotations

import io
import math
import struct
import subprocess
import sys
import textwrap

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.predict.traffic import powersgd_bytes_per_step, powersgd_values  # noqa: E402
from support import run_page_program  # noqa: E402

PRINTED = """\
no all-reduce (no_sync): sent 0 B a step (predicted 0 B); step 8.2 ms median of 30 (7.6 to 9.9); loss 2.312 -> 2.137
  losses: 2.3122 2.3213 2.1371
fp32 (no hook): sent 5,292,072 B a step (predicted 5,292,072 B); step 20.9 ms median of 30 (16.6 to 28.7); loss 2.312 -> 2.134
  losses: 2.3122 2.3066 2.1337
fp16_compress_hook: sent 2,646,036 B a step (predicted 2,646,036 B); step 19.7 ms median of 30 (16.5 to 36.7); loss 2.312 -> 2.134
  losses: 2.3122 2.3066 2.1337
"""  # noqa: E501 (the program's own lines)


def test_the_picture_draws_the_printed_lines_within_the_column():
    records = plots.hooks.hook_records(PRINTED)
    assert list(records) == ["no all-reduce (no_sync)", "fp32 (no hook)", "fp16_compress_hook"]
    assert records["fp16_compress_hook"]["sent"] * 2 == records["fp32 (no hook)"]["sent"]
    fig = plots.plot_hooks_run(PRINTED)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    assert struct.unpack(">I", buffer.getvalue()[16:20])[0] <= 688
    assert min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 9
    plt.close(fig)
    with pytest.raises(ValueError, match="hooks_timed.py"):
        plots.hooks.hook_records("fp32 (no hook): nothing")


def test_powersgd_compresses_only_where_it_saves_more_than_half():
    assert powersgd_values((1024,), 4) == (1024, False)  # a bias: 1024 x 1, sent whole
    assert powersgd_values((1024, 1024), 4) == ((1024 + 1024) * 4, True)
    assert powersgd_values((64, 3, 3, 3), 4) == ((64 + 27) * 4, True)  # out_channels x in_channels * 3 * 3
    assert powersgd_values((10, 16), 4) == (160, False)  # (10 + 16) * 4 * 2 = 208 is not below 160
    assert powersgd_bytes_per_step([(1024, 1024), (1024,)], 1, 2) == (2048 + 1024) * 4


# What torch's hook itself counts (PowerSGDState.compression_stats: the values it all-reduced), on one gloo rank and
# one bucket: on gloo ranks the hook's callbacks start its next all-reduces, which hung with more than one bucket
# and broke the ranks' matching on two ranks (the page says so); TrafficCounter, a dispatch mode of the thread that
# runs backward, does not see the all-reduces those callbacks start on gloo's thread.
POWERSGD_ON_ONE_RANK = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for rank in (1, 4, 32):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.Flatten(), torch.nn.Linear(64 * 6 * 6, 512),
                                  torch.nn.ReLU(), torch.nn.Linear(512, 10), torch.nn.Linear(10, 16))
        model = DDP(net, bucket_cap_mb=100)  # one bucket
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        for step in range(3):  # two plain all-reduces, then one compressed step
            model(torch.randn(4, 3, 8, 8)).sum().backward()
        _, before, after = state.compression_stats()
        print("powersgd", rank, before, after, [tuple(p.shape) for p in net.parameters()])
    dist.destroy_process_group()
""")


def test_the_prediction_is_what_torchs_powersgd_hook_all_reduces():
    done = subprocess.run([sys.executable, "-c", POWERSGD_ON_ONE_RANK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # torch 2.10's gloo prints its own lines too ("[Gloo] Rank 0 is connected to 0 peer ranks")
    lines = [line.split(" ", 4)[1:] for line in done.stdout.splitlines() if line.startswith("powersgd ")]
    assert [int(rank) for rank, *_ in lines] == [1, 4, 32]
    for rank, before, after, shapes in lines:
        shapes = eval(shapes)  # noqa: S307 (the shapes our own program printed)
        assert int(before) == sum(math.prod(s) for s in shapes)  # every value, as if uncompressed
        assert int(after) == sum(powersgd_values(s, int(rank))[0] for s in shapes), rank
        assert float(after) * 4 == powersgd_bytes_per_step(shapes, int(rank), 2)


@pytest.mark.slow
def test_the_pages_program_counts_the_predicted_bytes_and_trains_as_fp32(tmp_path):
    job = run_page_program("comm_hooks.md", "hooks_timed.py", tmp_path)
    runs = plots.hooks.hook_records(job)
    assert list(runs) == ["no all-reduce (no_sync)", "fp32 (no hook)", "fp16_compress_hook", "bf16_compress_hook"]
    for name, run in runs.items():
        assert run["sent"] == run["predicted"], name
    fp32 = runs["fp32 (no hook)"]
    assert runs["fp16_compress_hook"]["sent"] * 2 == fp32["sent"] == runs["bf16_compress_hook"]["sent"] * 2
    for name in ("fp16_compress_hook", "bf16_compress_hook"):
        assert max(abs(a - b) for a, b in zip(runs[name]["losses"], fp32["losses"])) < 1e-2, name
    assert fp32["losses"][-1] < fp32["losses"][0]  # it learns
