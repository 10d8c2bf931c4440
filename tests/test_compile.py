"""The compile chapter (book/compile.md): DDPOptimizer's bucket rule, as the library predicts it, against the graphs
a counting backend receives on real gloo ranks; which order of compiling and wrapping compiles anything, under DDP
and FSDP2; the check that refuses a run that compiled nothing; and the page's program and picture."""

from __future__ import annotations

import io
import re
import struct

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.errors import DistlabError  # noqa: E402
from distlab.parallel.compiled import GraphCounter, strip_compiled_prefix  # noqa: E402
from distlab.predict.compiled_ddp import MIB, ddp_optimizer_buckets, ddp_optimizer_graphs, linear_layer_bytes  # noqa: E402
from support import run_page_program  # noqa: E402

PAGE_MODEL = linear_layer_bytes([512] * 9)  # 8 x Linear(512, 512): 1 MiB and 2 KiB each


def test_the_bucket_rule_on_the_pages_model_and_its_corners():
    """Counted from the last layer, the first bucket 1 MiB, a bucket closed once it holds its cap (so a layer may
    overflow it), a parameter-free preamble fused into the graph after it."""
    assert [ddp_optimizer_graphs(PAGE_MODEL, cap * MIB) for cap in (1, 4, 25)] == [8, 3, 2]
    assert ddp_optimizer_buckets(PAGE_MODEL, 25 * MIB) == [[0, 1, 2, 3, 4, 5, 6], [7]]
    # the last layer fills the 1 MiB first bucket; the 30 MiB layer overflows the second, which closes after it
    assert ddp_optimizer_buckets([2 * MIB, 30 * MIB, MIB, MIB], 5 * MIB) == [[0], [1, 2], [3]]
    assert ddp_optimizer_buckets([0, MIB, 0, MIB], 1 * MIB) == [[0, 1, 2], [3]]
    assert ddp_optimizer_graphs(PAGE_MODEL, 25 * MIB, first_bucket_cap=25 * MIB) == 1
    with pytest.raises(ValueError, match="First bucket should be smaller/equal"):
        ddp_optimizer_graphs(PAGE_MODEL, MIB // 2)


def test_a_run_that_compiled_nothing_is_refused_in_one_line():
    """torch says nothing when no graph reaches the backend; the counter says what to do."""
    counter = GraphCounter()
    with pytest.raises(DistlabError) as refused:
        counter.require_graphs("fully_shard(block), then block.compile()")
    message = str(refused.value)
    assert message.startswith("compiled nothing: fully_shard(block), then block.compile() handed the compiler no graph")
    assert "torch.compile(block) and then fully_shard it" in message and "\n" not in message
    counter(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), [])
    assert counter.require_graphs("anything") == 1
    assert strip_compiled_prefix("blocks.0._orig_mod.fc.weight") == "blocks.0.fc.weight"


class _MLP(torch.nn.Module):
    """A model class of the test's own: its forward is not in torch/nn, so dynamo compiles it as a frame."""

    def __init__(self, widths):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _sequential(widths):
    return torch.nn.Sequential(
        *[m for a, b in zip(widths, widths[1:]) for m in (torch.nn.Linear(a, b), torch.nn.ReLU())]
    )


def _ddp_graphs(widths, cap_mb, order, model_kind):
    """Graphs a counting backend receives in one DDP step, compiled in ``order``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    counter, model = GraphCounter(), (_MLP if model_kind == "own class" else _sequential)(widths)
    if order == "compile, then wrap":
        net = DDP(torch.compile(model, backend=counter), bucket_cap_mb=cap_mb)
    else:
        net = torch.compile(DDP(model, bucket_cap_mb=cap_mb), backend=counter)
    net(torch.randn(2, widths[0])).sum().backward()
    torch._dynamo.reset()
    return len(counter.graphs)


WIDTHS = {"the page's 8 layers of 1 MiB": [512] * 9, "uneven layers": [256, 1024, 512, 128, 1024, 256]}
CAPS_MB = (1, 3, 25)


def _every_ddp_count(runtime):
    counted = {
        (name, cap_mb): _ddp_graphs(widths, cap_mb, "compile, then wrap", "own class")
        for name, widths in WIDTHS.items()
        for cap_mb in CAPS_MB
    }
    counted["own class, wrapped first"] = _ddp_graphs(WIDTHS["uneven layers"], 3, "wrap, then compile", "own class")
    counted["Sequential, wrapped first"] = _ddp_graphs(WIDTHS["uneven layers"], 25, "wrap, then compile", "Sequential")
    return counted


@pytest.mark.slow
def test_the_prediction_counts_the_graphs_dynamo_hands_the_backend(ranks2):
    """DDPOptimizer's rule, written without torch, against real compiles inside DDP for several caps. Wrapped first,
    a model class of the test's own is still compiled (its forward is a frame of its own after the graph breaks in
    DDP's code), and cut the same; torch's own Sequential is never traced as a frame: nothing compiles."""
    counted = ranks2.run(_every_ddp_count)
    assert counted[0] == counted[1]
    for name, widths in WIDTHS.items():
        for cap_mb in CAPS_MB:
            predicted = ddp_optimizer_graphs(linear_layer_bytes(widths), int(cap_mb * MIB))
            assert counted[0][name, cap_mb] == predicted, (name, cap_mb, counted[0][name, cap_mb], predicted)
    uneven = ddp_optimizer_graphs(linear_layer_bytes(WIDTHS["uneven layers"]), 3 * MIB)
    assert counted[0]["own class, wrapped first"] == uneven
    assert counted[0]["Sequential, wrapped first"] == 0


def _fsdp_graphs(how):
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    counter, blocks = GraphCounter(), _sequential([64] * 5)
    for i in range(0, len(blocks), 2):
        if how == "fully_shard, then block.compile()":
            fully_shard(blocks[i])
            blocks[i].compile(backend=counter)
        elif how == "block.compile(), then fully_shard":
            blocks[i].compile(backend=counter)
            fully_shard(blocks[i])
        else:
            blocks[i] = torch.compile(blocks[i], backend=counter)
            fully_shard(blocks[i])
    model = fully_shard(blocks)
    for _ in range(2):
        model(torch.randn(2, 64)).sum().backward()
    keys = list(model.state_dict())
    torch._dynamo.reset()
    return len(counter.graphs), keys[0]


def _every_fsdp_count(runtime):
    hows = ("fully_shard, then block.compile()", "block.compile(), then fully_shard")
    return {how: _fsdp_graphs(how) for how in (*hows, "torch.compile(block), then fully_shard")}


@pytest.mark.slow
def test_block_compile_compiles_nothing_under_fully_shard_in_either_order(ranks2):
    """nn.Module.compile compiles the module's whole call, FSDP's dynamo-disabled hooks included, so the order does
    not matter; torch.compile(block) puts the hooks on a wrapper, outside the compiled frame, and adds _orig_mod."""
    counted = ranks2.run(_every_fsdp_count)[0]
    assert counted["fully_shard, then block.compile()"] == (0, "0.weight")
    assert counted["block.compile(), then fully_shard"] == (0, "0.weight")
    graphs, key = counted["torch.compile(block), then fully_shard"]
    assert graphs > 0 and key == "0._orig_mod.weight"


@pytest.mark.slow
def test_the_pages_program_prints_the_predicted_graphs_and_the_overlap(tmp_path):
    """The page's run, and its picture drawn from the lines it printed: at cap 1 each graph's backward is followed
    by its bucket's all-reduce, before the next graph's backward (overlap); at 25 the one bucket waits for both."""
    done = run_page_program("compile.md", "compiled_step.py", tmp_path)
    records = {r["label"]: r for r in plots.compile.compiled_step_records(done.stdout)}
    one, many = records["compile, then DDP, bucket_cap_mb=1"], records["compile, then DDP, bucket_cap_mb=25"]
    assert len(one["graphs"]) == ddp_optimizer_graphs(PAGE_MODEL, MIB) == 8
    assert len(many["graphs"]) == ddp_optimizer_graphs(PAGE_MODEL, 25 * MIB) == 2
    kinds = [kind for kind, _ in one["events"]]
    assert kinds[:4] == ["backward", "all-reduce", "backward", "all-reduce"]
    assert [kind for kind, _ in many["events"]] == ["backward", "backward", "all-reduce"]
    wrapped = records["DDP, then compile, bucket_cap_mb=25"]
    assert wrapped["graphs"] == [] and wrapped["breaks"] > 0
    assert re.search(
        r"FSDP2, fully_shard\(block\), then block.compile\(\): DistlabError: compiled nothing", done.stdout
    )
    assert re.search(
        r"FSDP2, torch.compile\(block\), then fully_shard: \d+ graphs; keys 0._orig_mod.weight", done.stdout
    )
    fig = plots.plot_compiled_backward(done.stdout)
    labels = [t.get_text() for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    assert "compile, then DDP, bucket_cap_mb=1: 8 graphs" in labels and "eager backward: nothing compiled" in labels
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    width = struct.unpack(">I", buffer.getvalue()[16:20])[0]
    assert width <= 688 and min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 9
    plt.close("all")


def test_a_compile_backend_without_compile_is_refused_in_one_line():
    """Parse only: the backend of a compile that is not asked for would be silently ignored."""
    from distlab.config import TrainConfig

    with pytest.raises(DistlabError, match="--compile-backend eager needs --compile: add --compile"):
        TrainConfig.from_flags(compile_backend="eager")
    assert TrainConfig.from_flags(compile=True, compile_backend="aot_eager", strategy="fsdp").model.compile


def test_a_checkpoint_of_compiled_blocks_loads_into_the_uncompiled_model():
    """torch.compile(block) adds _orig_mod. to the module's own state-dict keys; the course's checkpoint state
    (torch's get_state_dict, which skips the compiler's prefix) names the tensors as the uncompiled model does, so
    a checkpoint saved from one order loads in the other."""
    from distlab.parallel.checkpoint_state import CheckpointState

    def blocks(seed: int, compiled: bool) -> torch.nn.Sequential:
        torch.manual_seed(seed)
        model = _sequential([8, 8, 8])
        if compiled:
            model[0] = torch.compile(model[0], backend="eager")
        return model

    saved, loaded = blocks(0, compiled=True), blocks(1, compiled=False)
    assert "0._orig_mod.weight" in saved.state_dict()
    source = CheckpointState(saved, torch.optim.SGD(saved.parameters(), lr=0.1))
    target = CheckpointState(loaded, torch.optim.SGD(loaded.parameters(), lr=0.1))
    assert sorted(source.tensors["model"]) == sorted(target.tensors["model"]) == sorted(loaded.state_dict())
    for key, tensor in source.tensors["model"].items():
        target.tensors["model"][key].copy_(tensor)
    target.apply()
    assert all(torch.equal(loaded.state_dict()[strip_compiled_prefix(k)], v) for k, v in saved.state_dict().items())


def _trained_weights(runtime, strategy: str, compiled: bool) -> dict:
    from distlab.config import TrainConfig
    from distlab.parallel import full_state_dict
    from distlab.train import train

    flags = dict(model="cnn", dataset="synthetic", device="cpu", synthetic_size=256, batch_size=8, max_steps=3)
    flags |= dict(optimizer="sgd", lr=0.05, num_workers=0, log_every=-1, eval_batch_size=64, strategy=strategy)
    if compiled:
        flags |= dict(compile=True, compile_backend="aot_eager")
    torch._dynamo.reset()
    state = full_state_dict(train(TrainConfig.from_flags(**flags), runtime).model)
    torch._dynamo.reset()
    return state


def _eager_and_compiled(runtime, strategy):
    return _trained_weights(runtime, strategy, False), _trained_weights(runtime, strategy, True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compile_trains_the_same_weights_as_eager(ranks2, strategy):
    """--compile (aot_eager: dynamo and AOTAutograd, no C++ compiler) against the same run eager, within the
    equivalence tests' tolerance."""
    from distlab.testing import assert_same_state

    eager, compiled = ranks2.run(_eager_and_compiled, strategy)[0]
    assert_same_state(compiled, eager, label=f"{strategy} --compile")


def test_the_committed_compile_bench_says_what_it_measured():
    """The page's sentence about compiled against eager comes from the committed result: a median outside eager's
    quartiles is a difference, one inside them is none this run can show."""
    from distlab.bench.compile import summary
    from distlab.results import committed_results, read_result

    record = read_result(committed_results("compile", "compile-inductor-2xcpu.json"))
    said = summary(record["metrics"])
    assert record["environment"]["world_size"] == 2 and record["config"]["compile_backend"] == "inductor"
    assert said["compiled"].startswith("first step ") and said["verdict"] in (
        "faster than eager",
        "slower than eager",
        "within eager's quartiles: no difference this run can show",
    )
    fake = {"rows": [dict(r) for r in record["metrics"]["rows"]]}
    fake["rows"][1]["time_s"] = fake["rows"][0]["time_q1_s"] / 2
    assert summary(fake)["verdict"] == "faster than eager"


def test_the_gpu_tiers_compile_command_line_parses_on_the_cpu():
    """The GPU tier's bench command (tests/test_gpu_compile.py, which only a GPU runs) parses here, before any rank
    would start: a refused flag would otherwise show first on a GPU."""
    from distlab.cli import parse_or_refuse
    from distlab.labs.launch import entry_config
    from test_gpu_compile import CUDA_ARGS

    cfg = parse_or_refuse(entry_config("distlab.bench.compile"), [*CUDA_ARGS, "--out", "x"], "distlab.bench.compile")
    assert (cfg.where.device, cfg.repeats) == ("cuda", 10)
