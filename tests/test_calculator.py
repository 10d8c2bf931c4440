"""The book's memory calculator computes, in JavaScript, exactly what the library's model computes.

The same inputs go to ``distlab.predict.calculator.memory_per_rank`` and to ``distlabMemoryPerRank`` of
``book/_static/distlab-calculator.js`` (run by ``node`` where it is on PATH, else in Debian's Chromium
through Playwright; skipped only without either); every byte of every row must agree, under every precision
choice. The defaults of the page's fragment (``book/_static/calculator.html``: torch's defaults) and the page's
rules (torch DDP under autocast holds 20 B a parameter with Adam; FULL_SHARD sends DDP's bytes with an fp32
reduce-scatter, three quarters of them with torch's 16-bit default) are checked against arithmetic by hand, and
the bytes sent against :mod:`distlab.predict.traffic` and :data:`distlab.predict.gpu_predictions.POLICIES`.
"""

from __future__ import annotations

import html
import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from distlab.predict.calculator import (
    DEFAULT_PRECISION,
    GIB,
    OPTIMIZERS,
    PRECISIONS,
    ROW_FIELDS,
    STRATEGIES,
    Inputs,
    Transformer,
    activation_bytes,
    largest_fitting_parameters,
    layer_activation_bytes,
    memory_per_rank,
    row_units,
    transformer_from,
    transformer_inputs,
)
from distlab.predict.costmodel import predict_peak_bytes
from distlab.predict.gpu_predictions import POLICIES
from distlab.predict.memory import BYTES_PER_VALUE, STEP_COUNTER_BYTES
from distlab.predict.traffic import expected_bytes_per_step, frozen_crossing

STATIC = Path(__file__).resolve().parents[1] / "book" / "_static"
SCRIPT = STATIC / "distlab-calculator.js"
FRAGMENT = STATIC / "calculator.html"
NODE_RUNNER = """
const calculator = require(process.argv[1]);
const inputs = JSON.parse(require("fs").readFileSync(0, "utf8"));
const attempt = (f) => (i) => { try { return f(i); } catch (e) { return {error: e.message}; } };
process.stdout.write(JSON.stringify({
  rows: inputs.map(attempt(calculator.distlabMemoryPerRank)),
  largest: inputs.map(attempt(calculator.distlabLargestFitting)),
  constants: {
    bytes_per_value: calculator.BYTES_PER_VALUE,
    step_counter_bytes: calculator.STEP_COUNTER_BYTES,
    precisions: calculator.PRECISIONS,
  },
}));
"""
IN_PAGE = """inputs => {
  const attempt = f => i => { try { return f(i); } catch (e) { return {error: e.message}; } };
  return {
    rows: inputs.map(attempt(distlabMemoryPerRank)),
    largest: inputs.map(attempt(distlabLargestFitting)),
    constants: null,
  };
}"""


STRATEGY_ROWS = list(STRATEGIES)


def rows_for(parameters, *machine, **settings) -> list[dict]:
    """The calculator's rows for a model of ``parameters`` on the machine and run the rest describe."""
    return memory_per_rank(parameters, Inputs(*machine, **settings))


def _in_chromium(inputs: list[dict]) -> dict:
    chromium = shutil.which("chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="neither node nor playwright to run the calculator")
    if chromium is None:
        pytest.skip("neither node nor Chromium to run the calculator's JavaScript")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.set_content("<!doctype html><html><body></body></html>")
        page.add_script_tag(content=SCRIPT.read_text())
        answer = page.evaluate(IN_PAGE, inputs)
        browser.close()
    return answer


def run_calculator_js(inputs: list[dict]) -> dict:
    """``{"rows": [...], "largest": [...]}``, one answer (or ``{"error": message}``) per input, and
    ``"constants"``: the script's tables (None when run in a page)."""
    node = shutil.which("node")
    if node is None:
        return _in_chromium(inputs)
    done = subprocess.run(
        [node, "-e", NODE_RUNNER, str(SCRIPT)], input=json.dumps(inputs), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


LAYERS = [
    None,
    {"hidden": 4096, "heads": 32, "seq_len": 2048, "micro_batch": 1, "recompute": False},
    {"hidden": 768, "heads": 12, "seq_len": 1024, "micro_batch": 8, "recompute": True},
    {"hidden": 12288, "heads": 96, "seq_len": 2048, "micro_batch": 3, "recompute": False, "attention": "eager"},
    {"hidden": 4096, "heads": 32, "seq_len": 4096, "micro_batch": 2, "recompute": False, "attention": "fused"},
    {"hidden": 5120, "heads": 40, "seq_len": 8192, "micro_batch": 1, "recompute": False, "attention": "eager"},
]
LARGEST_UNITS = [None, 131_072_000, 1, None, 7_000_000]
"""A model's largest layer, given a unit of its own or not: a 7B Llama's embedding, one value (smaller than every
other unit), and one that is the largest only of small models."""
TRAINABLE_FRACTIONS = [1.0, 0.01, 1 / 3, 0.125]
"""Every parameter training, and frozen bases with adapters: 1 %, a third (whose products round), an eighth."""


def _grid() -> list[dict]:
    """Sizes from 1e6 to 7e10, odd ones included (their shards pad), on 1 to 8 GPUs, every precision choice and
    optimizer, activations typed or counted by the formula (fused and eager attention), units equal or one the
    largest."""
    sizes = [1_000_000, 1_234_567, 124_439_808, 7_000_000_000, 13_000_000_007, 70_000_000_000]
    memories, activations, units = [16, 40, 80], [0.0, 1.5, 0.3], [1, 32, 7]
    cases = itertools.product(sizes, range(1, 9), PRECISIONS, OPTIMIZERS)
    return [
        {
            "parameters": size,
            "gpus": gpus,
            "memory_gib": memories[index % 3],
            "precision": precision,
            "optimizer": optimizer,
            "activations_gib": activations[index % 3],
            "shard_units": units[index % 3],
            "transformer": LAYERS[index % len(LAYERS)],
            "largest_unit": LARGEST_UNITS[index % len(LARGEST_UNITS)],
            "trainable_fraction": TRAINABLE_FRACTIONS[index % len(TRAINABLE_FRACTIONS)],
        }
        for index, (size, gpus, precision, optimizer) in enumerate(cases)
    ]


def _library(inputs: dict) -> dict:
    """The page's inputs as the library takes them (its transformer a dataclass)."""
    return inputs | {"transformer": transformer_from(inputs.get("transformer"))}


def test_the_page_and_the_library_agree_to_the_byte():
    grid = _grid()
    answer = run_calculator_js(grid)
    differ = []
    for inputs, browser_rows in zip(grid, answer["rows"], strict=True):
        library_rows = rows_for(**_library(inputs))
        if browser_rows != library_rows:
            differ.append(f"{inputs}: library {library_rows} page {browser_rows}")
    assert not differ, f"{len(differ)} of {len(grid)} inputs differ, e.g. {differ[0]}"
    assert all(len(rows) == len(STRATEGIES) and set(rows[0]) == set(ROW_FIELDS) for rows in answer["rows"])
    if answer["constants"] is not None:
        assert answer["constants"]["bytes_per_value"] == {f"{o},{p}": list(v) for (o, p), v in BYTES_PER_VALUE.items()}
        assert answer["constants"]["step_counter_bytes"] == STEP_COUNTER_BYTES
        assert answer["constants"]["precisions"] == {
            key: {name: value for name, value in vars(precision).items() if name != "label"}
            for key, precision in PRECISIONS.items()
        }
    assert {inputs["precision"] for inputs in grid} == set(PRECISIONS)
    layers = [case["transformer"] for case in grid if case["transformer"] and not case["transformer"]["recompute"]]
    assert {layer.get("attention", "default") for layer in layers} == {"default", "fused", "eager"}


def test_the_page_and_the_library_agree_on_the_largest_model_that_fits():
    machines = [
        inputs | {"memory_gib": memory, "activations_gib": activations}
        for inputs, memory, activations in zip(
            [case for case in _grid() if case["parameters"] == 7_000_000_000],
            itertools.cycle([16, 80, 40.5]),
            itertools.cycle([0.0, 2.5, 0.3, 0.0]),
        )
    ]
    machines += [machines[0] | {"memory_gib": 0.5, "activations_gib": 1.0}]  # nothing fits at all
    machines += [machines[0] | {"gpus": 1024, "memory_gib": 100_000}]  # FSDP fits the largest model tried
    answer = run_calculator_js(machines)["largest"]
    differ = []
    for inputs, page in zip(machines, answer, strict=True):
        library = largest_fitting_parameters(Inputs(**{k: v for k, v in _library(inputs).items() if k != "parameters"}))
        if page != library:
            differ.append(f"{inputs}: library {library} page {page}")
    assert not differ, f"{len(differ)} of {len(machines)} differ, e.g. {differ[0]}"


@pytest.mark.parametrize("precision, buckets", [("torch", 4), ("zero-paper", 2)])
def test_the_largest_model_that_fits_is_the_threshold(precision, buckets):
    machine = (2, 16.0, precision, "adam", 0.5, 32)
    largest = largest_fitting_parameters(Inputs(*machine))
    for label, parameters in largest.items():
        index = list(STRATEGIES).index(label)
        assert rows_for(parameters, *machine)[index]["fits"], label
        assert not rows_for(parameters + 1, *machine)[index]["fits"], label
    assert largest["DDP, gradient_as_bucket_view"] == (16 * GIB - GIB // 2 - 4) // 16  # 16 B/param, one step counter
    assert largest["DDP, torch's default buckets"] == (16 * GIB - GIB // 2 - 4) // (16 + buckets)  # and the buckets


def _fragment_defaults() -> dict:
    """The inputs the page opens with, read from the fragment's <input value> and <option selected>."""
    page = FRAGMENT.read_text()
    values = dict(re.findall(r'<input name="(\w+)"[^>]*\svalue="([^"]*)"', page))
    for name, options in re.findall(r'<select name="(\w+)">(.*?)</select>', page, re.S):
        assert len(re.findall(r"<option [^>]*selected", options)) == 1, f"{name}: one option selected"
        values[name] = re.search(r'<option value="([\w-]+)" selected>', options).group(1)
    return {
        "parameters": round(float(values.pop("billions")) * 1e9),
        "gpus": int(values.pop("gpus")),
        "memory_gib": float(values.pop("memory_gib")),
        "activations_gib": float(values.pop("activations_gib")),
        "shard_units": int(values.pop("shard_units")),
        "largest_unit": round(float(values.pop("largest_millions")) * 1e6) or None,
        "transformer": None if values.pop("activations_from") == "typed" else "formula",
        "attention": values.pop("attention"),
        **{name: values.pop(name) for name in ("precision", "optimizer")},
    }


P, HALF = 7_000_000_000, 3_500_000_000
UNIT = P // 32  # one of a 7B model's 32 blocks: 218,750,000 values, which 2 and 8 ranks divide evenly
ZERO_BUCKET = 5 * 2**20 // 4  # the course's ZeRO-2 holds one 5 MB bucket of fp32-sized values whole


def test_the_page_opens_on_torch_defaults_7b_on_two_16_gib_gpus_where_nothing_fits():
    """The notes' "7B on 2 GPUs: ~14 GB each, fits" counts only the weights; with Adam nothing fits. The page
    opens on torch's own setups: DDP under autocast holds fp32 state, 20 B a parameter with its default buckets,
    and FSDP2 with a 16-bit param_dtype and reduce_dtype=None sends three quarters of DDP's bytes."""
    defaults = _fragment_defaults()
    assert defaults == {
        "parameters": P,
        "gpus": 2,
        "memory_gib": 16.0,
        "precision": "torch",
        "optimizer": "adam",
        "activations_gib": 0.0,
        "shard_units": 32,
        "largest_unit": None,
        "transformer": None,
        "attention": "fused",
    }
    assert DEFAULT_PRECISION == "torch" and Inputs(2, 16.0).precision == "torch"
    assert Transformer(4096, 32, 2048, 1).attention == defaults.pop("attention")  # the formula opens on fused
    rows = {row["strategy"]: row for row in rows_for(**defaults)}
    held = {label: row["total"] for label, row in rows.items()}
    assert held["DDP, torch's default buckets"] == 4 * P + 4 * P + 8 * P + 4 + 4 * P  # 20 B/param, one step counter
    assert held["DDP, gradient_as_bucket_view"] == 16 * P + 4
    assert held["ZeRO-1"] == 4 * P + 4 * P + 8 * HALF + 4  # fp32 parameters and flat gradients whole, Adam halved
    assert held["ZeRO-2"] == 4 * P + 4 * HALF + 8 * HALF + 4 + 4 * ZERO_BUCKET
    # fp32 shards, one bf16 block gathered, and one block's bf16 gradient before its reduce-scatter
    assert held["FSDP FULL_SHARD (ZeRO-3)"] == 16 * HALF + 32 * 4 + 2 * UNIT + 2 * UNIT
    assert held["FSDP SHARD_GRAD_OP"] == 16 * HALF + 32 * 4 + 2 * P + 2 * UNIT  # every block gathered in bf16
    sent = {label: row["sent"] for label, row in rows.items()}
    assert sent["DDP, torch's default buckets"] == sent["DDP, gradient_as_bucket_view"] == 2 * 1 * HALF * 4
    assert sent["ZeRO-1"] == sent["ZeRO-2"] == 1 * HALF * (4 + 4)  # fp32 reduce-scatter, fp32 parameters gathered
    assert sent["FSDP FULL_SHARD (ZeRO-3)"] == 1 * HALF * (2 + 2 * 2) == 3 * P  # 16-bit, 0.75x DDP's 4 B/param
    assert sent["FSDP SHARD_GRAD_OP"] == 1 * HALF * (2 + 2)
    assert rows["FSDP FULL_SHARD (ZeRO-3)"]["sent_vs_ddp"] == 0.75
    assert not any(row["fits"] for row in rows.values())
    assert min(rows.values(), key=lambda row: row["total"])["strategy"] == "FSDP FULL_SHARD (ZeRO-3)"
    assert rows["FSDP FULL_SHARD (ZeRO-3)"]["total"] > 3 * 16 * GIB  # over three times a T4's memory
    no_precision = {k: v for k, v in defaults.items() if k != "precision"}
    assert run_calculator_js([defaults, no_precision])["rows"] == [list(rows.values())] * 2  # the JS opens there too


# The page's own wiring (wireAll, readInputs, render) under node, on a stand-in for the fragment's DOM: its form's
# elements hold the fragment's values, and the table's rows come back as the text of their cells.
RENDER_RUNNER = """
const [script, fragment, precision] = process.argv.slice(1);
const fs = require("fs");
const page = fs.readFileSync(fragment, "utf8");
const elements = {};
for (const [, name, rest] of page.matchAll(/<input name="(\\w+)"([^>]*)>/g)) {
  elements[name] = { value: (/\\svalue="([^"]*)"/.exec(rest) || [0, ""])[1], checked: false };
}
for (const [, name, options] of page.matchAll(/<select name="(\\w+)">([\\s\\S]*?)<\\/select>/g)) {
  elements[name] = { value: /<option value="([\\w-]+)" selected>/.exec(options)[1] };
}
if (precision) elements.precision.value = precision;
const output = { textContent: "" }, rows = [];
const tbody = { replaceChildren: (...trs) => rows.splice(0, rows.length, ...trs) };
const form = { elements, addEventListener() {} };
const parts = { form, output, tbody };
const calculator = { querySelector: (s) => parts[s] ?? null, querySelectorAll: () => [] };
const cell = () => ({ children: [], textContent: "", append(c) { this.children.push(c); } });
const window = { document: { readyState: "complete", querySelectorAll: () => [calculator], createElement: cell } };
new Function("window", "document", "module", fs.readFileSync(script, "utf8"))(window, window.document, undefined);
const cells = rows.map((tr) => tr.children.map((td) => td.textContent));
process.stdout.write(JSON.stringify({ output: output.textContent, rows: cells }));
"""


def render_page(precision: str | None = None) -> dict:
    """What the page shows when it opens (or with ``precision`` chosen): its <output> and its table's cells."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to run the page's wiring")
    done = subprocess.run(
        [node, "-e", RENDER_RUNNER, str(SCRIPT), str(FRAGMENT), precision or ""], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_page_shows_torch_defaults_when_it_opens():
    """The table the reader first sees: torch DDP at 20 B a parameter (130.39 GiB for 7B), FULL_SHARD sending
    0.75x DDP's bytes; with the course's policy 1x, in fp32 1.5x."""
    shown = render_page()
    assert shown["output"].startswith("Nothing fits on 2 GPUs of 16 GiB")
    cells = {row[0]: row for row in shown["rows"]}
    assert list(cells) == list(STRATEGIES)
    assert cells["DDP, torch's default buckets"][7] == f"{(20 * P + 4) / GIB:.2f}"
    assert cells["FSDP FULL_SHARD (ZeRO-3)"][9] == f"{3 * P / GIB:.2f} (0.75x DDP)"
    assert render_page("course")["rows"][4][9] == f"{4 * P / GIB:.2f} (1.00x DDP)"
    assert render_page("fp32")["rows"][4][9] == f"{6 * P / GIB:.2f} (1.50x DDP)"


def test_seven_billion_on_eight_80_gib_gpus_by_hand():
    """8 x 80 GiB: DDP does not fit in any precision (at least 16 B/param is 104 GiB), ZeRO-1 and on do; FULL_SHARD
    sends 0.75x DDP's bytes with torch's defaults, 1x with the course's fp32 reduce, 1.5x in one dtype."""
    eighth, n = P // 8, 8
    by = {precision: {r["strategy"]: r for r in rows_for(P, n, 80.0, precision)} for precision in PRECISIONS}
    # one block's gradient before its reduce-scatter: bf16 with torch's default, bf16 and its fp32 cast with the
    # course's reduce_dtype=torch.float32
    for precision, reducing in (("torch", 2 * UNIT), ("course", (2 + 4) * UNIT)):
        rows = by[precision]
        assert rows["DDP, torch's default buckets"]["total"] == 20 * P + 4
        assert rows["ZeRO-1"]["total"] == 8 * P + 8 * eighth + 4
        assert rows["ZeRO-2"]["total"] == 4 * P + 12 * eighth + 4 + 4 * ZERO_BUCKET
        assert rows["FSDP FULL_SHARD (ZeRO-3)"]["total"] == 16 * eighth + 32 * 4 + 2 * UNIT + reducing
        assert rows["FSDP SHARD_GRAD_OP"]["total"] == 16 * eighth + 32 * 4 + 2 * P + reducing
        assert rows["DDP, torch's default buckets"]["sent"] == 2 * 7 * eighth * 4 == 7 * P
    assert by["torch"]["FSDP FULL_SHARD (ZeRO-3)"]["sent"] == 7 * eighth * (2 + 2 * 2)
    assert by["course"]["FSDP FULL_SHARD (ZeRO-3)"]["sent"] == 7 * eighth * (4 + 2 * 2)
    assert by["fp32"]["FSDP FULL_SHARD (ZeRO-3)"]["sent"] == 7 * eighth * (4 + 2 * 4)
    assert by["zero-paper"]["DDP, torch's default buckets"]["total"] == 18 * P + 4  # 2 + 2 + 12, and 2 B of buckets
    assert by["zero-paper"]["DDP, torch's default buckets"]["sent"] == 2 * 7 * eighth * 2
    ratios = {precision: rows["FSDP FULL_SHARD (ZeRO-3)"]["sent_vs_ddp"] for precision, rows in by.items()}
    assert ratios == {"torch": 0.75, "course": 1.0, "fp32": 1.5, "zero-paper": 1.5, "deepspeed": 1.5}
    for rows in by.values():
        assert [label for label, row in rows.items() if not row["fits"]] == list(STRATEGIES)[:2]


def test_the_precision_choices_say_whose_setup_they_are():
    """Each option is one setup, named for whose it is, with the library's label. torch's default for FSDP2's
    reduce_dtype is None, which reduces in the 16-bit param_dtype (tests/test_gpu_predictions.py runs it on gloo
    ranks); fp32 is the course's policy. The ZeRO paper's 2 + 2 + 12 B is named as the paper's alone, DeepSpeed's
    estimators (which count more) as theirs."""
    select = re.search(r'<select name="precision">(.*?)</select>', FRAGMENT.read_text(), re.S).group(1)
    found = re.findall(r'<option value="([\w-]+)"[^>]*>([^<]*)<', select)
    options = [(key, html.unescape(text)) for key, text in found]
    assert options == [(key, precision.label) for key, precision in PRECISIONS.items()]
    labels = dict(options)
    assert labels["torch"].startswith("torch's defaults") and "reduce_dtype=None" in labels["torch"]
    assert "autocast" in labels["torch"] and "16-bit reduce" in labels["torch"]
    assert "this course's policy" in labels["course"] and "reduce_dtype=torch.float32" in labels["course"]
    assert "torch's default" not in labels["course"]
    assert labels["fp32"].startswith("fp32 everywhere")
    assert labels["zero-paper"].startswith("the ZeRO paper's") and "fp32 master weights" in labels["zero-paper"]
    assert "DeepSpeed" not in labels["zero-paper"]
    assert labels["deepspeed"].startswith("DeepSpeed's memory estimators") and "fp32 gradient" in labels["deepspeed"]
    for key in ("zero-paper", "deepspeed"):
        assert BYTES_PER_VALUE["adam", PRECISIONS[key].state] == (2, 2, 12)
    assert all(BYTES_PER_VALUE["adam", PRECISIONS[key].state] == (4, 4, 8) for key in ("torch", "course", "fp32"))


def test_memory_per_gpu_decides_fits_at_the_byte():
    row = rows_for(1_000_000, 1, 1.0, "fp32", "sgd")[1]  # DDP: 12 bytes a parameter, no step counter
    exactly = row["total"] / GIB
    assert rows_for(1_000_000, 1, exactly, "fp32", "sgd")[1]["fits"]
    assert not rows_for(1_000_000, 1, exactly * (1 - 1e-9), "fp32", "sgd")[1]["fits"]


@pytest.mark.parametrize("precision", ["torch", "course", "fp32"])
def test_torch_ddp_under_autocast_holds_20_bytes_a_parameter_with_adam(precision):
    """fp32 parameters (autocast leaves them), gradients, buckets, two moments: 4 + 4 + 4 + 8."""
    rows = {row["strategy"]: row for row in rows_for(10**9, 2, 80.0, precision, "adam")}
    assert rows["DDP, torch's default buckets"]["total"] == 20 * 10**9 + 4
    assert rows["DDP, gradient_as_bucket_view"]["total"] == 16 * 10**9 + 4
    assert rows["DDP, torch's default buckets"]["buckets"] == 4 * 10**9


@pytest.mark.parametrize(
    "precision, ddp, zero, full_shard, shard_grad_op",
    [  # bytes per value of (DDP's all-reduce, ZeRO's reduce-scatter + gather, FULL_SHARD's, SHARD_GRAD_OP's)
        ("torch", 4, 4 + 4, 2 + 2 * 2, 2 + 2),  # FSDP2 reduces in its 16-bit param_dtype: 0.75x DDP
        ("course", 4, 4 + 4, 4 + 2 * 2, 4 + 2),  # reduce_dtype=fp32: DDP's bytes
        ("fp32", 4, 4 + 4, 4 + 2 * 4, 4 + 4),  # one dtype: 1.5x
        ("zero-paper", 2, 2 + 2, 2 + 2 * 2, 2 + 2),  # one dtype, 16 bits: 1.5x
        ("deepspeed", 2, 2 + 2, 2 + 2 * 2, 2 + 2),  # as the paper's: DeepSpeed's fp32 partition is never sent
    ],
)
def test_bytes_sent_are_the_rings(precision, ddp, zero, full_shard, shard_grad_op):
    """DDP sends 2(N-1)/N of the gradients; ZeRO-1/2 as much, half of it the gathered parameters; FULL_SHARD
    gathers twice, SHARD_GRAD_OP once, each collective in its own dtype. One GPU sends nothing."""
    p, n = 8_000_000, 4
    sent = {row["strategy"]: row["sent"] for row in rows_for(p, n, 80.0, precision, "adam", shard_units=8)}
    assert sent["DDP, torch's default buckets"] == sent["DDP, gradient_as_bucket_view"] == 2 * 3 * (p // 4) * ddp
    assert sent["ZeRO-1"] == sent["ZeRO-2"] == 3 * (p // 4) * zero
    assert sent["FSDP FULL_SHARD (ZeRO-3)"] == 3 * (p // 4) * full_shard
    assert sent["FSDP SHARD_GRAD_OP"] == 3 * (p // 4) * shard_grad_op
    assert all(row["sent"] == 0 and row["sent_vs_ddp"] is None for row in rows_for(p, 1, 80.0, precision))


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_bytes_sent_are_the_traffic_models(precision):
    """Every row's bytes sent is :func:`distlab.predict.traffic.expected_bytes_per_step` over the padded values, in
    the row's dtypes (a FULL_SHARD whose reduce-scatter is wider than its gathers adds the difference on one
    reduce-scatter), and torch's and the course's FSDP2 wires are :data:`distlab.predict.gpu_predictions.POLICIES`."""
    setup = PRECISIONS[precision]
    parameter_bytes, gradient_bytes, _ = BYTES_PER_VALUE["adam", setup.state]
    if precision in POLICIES:
        policy = POLICIES[precision]
        assert policy["ddp"][0] == gradient_bytes
        assert policy["fsdp"] == policy["fsdp-no-reshard"] == (setup.fsdp_reduce, setup.fsdp_gather)
    for p, n, units in [(1_234_567, 3, 7), (124_439_808, 8, 12), (7_000_000_000, 2, 32), (13_000_000_007, 5, 40)]:
        rows = rows_for(p, n, 80.0, precision, "adam", shard_units=units)
        flat = -(-p // n) * n
        size, larger = divmod(p, units)
        sharded = (larger * -(-(size + 1) // n) + (units - larger) * -(-size // n)) * n
        assert parameter_bytes == gradient_bytes  # DDP and ZeRO send in one dtype
        for row in rows:
            strategy = STRATEGIES[row["strategy"]]
            if strategy in ("ddp", "zero1", "zero2"):
                assert row["sent"] == expected_bytes_per_step(strategy, flat, n, gradient_bytes), row["strategy"]
            else:
                one_dtype = expected_bytes_per_step(strategy, sharded, n, setup.fsdp_gather)
                wider = (setup.fsdp_reduce - setup.fsdp_gather) * sharded * (n - 1) / n
                assert row["sent"] == one_dtype + wider, row["strategy"]


def test_activations_by_korthikanti_et_al():
    """34sbh + 5as^2b bytes a layer with eager attention (section 4.1), 34sbh with fused attention (the default),
    2sbh with full recomputation, one layer per shard unit."""
    gpt3_layer = Transformer(hidden=12288, heads=96, seq_len=2048, micro_batch=1, attention="eager")
    assert layer_activation_bytes(gpt3_layer) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    fused = Transformer(hidden=12288, heads=96, seq_len=2048, micro_batch=1)
    assert fused.attention == "fused" and layer_activation_bytes(fused) == 34 * 2048 * 12288
    recomputed = Transformer(hidden=12288, heads=96, seq_len=2048, micro_batch=1, recompute=True)
    assert layer_activation_bytes(recomputed) == 2 * 2048 * 12288
    for precision in ("torch", "course", "zero-paper"):  # autocast's activations are 16-bit
        rows = rows_for(10**9, 2, 80.0, precision, shard_units=96, transformer=gpt3_layer)
        assert {row["activations"] for row in rows} == {96 * layer_activation_bytes(gpt3_layer)}
    fp32 = rows_for(10**9, 2, 80.0, "fp32", shard_units=96, transformer=gpt3_layer)
    assert fp32[0]["activations"] == 2 * rows[0]["activations"]
    assert transformer_from(transformer_inputs(gpt3_layer)) == gpt3_layer


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"parameters": 0}, "parameters"),
        ({"gpus": 1.5}, "gpus"),
        ({"memory_gib": 0}, "memory_gib"),
        ({"precision": "bf16"}, "precision"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"shard_units": 2_000_000}, "shard_units"),
        ({"precision": "mixed"}, "precision"),
        ({"transformer": {"hidden": 0, "heads": 1, "seq_len": 1, "micro_batch": 1}}, "hidden"),
        ({"transformer": {"hidden": 8, "heads": 1, "seq_len": 1, "micro_batch": 1, "attention": "flash"}}, "attention"),
        ({"largest_unit": 0}, "largest_unit"),
        ({"largest_unit": 2.5}, "largest_unit"),
        ({"trainable_fraction": 0}, "trainable_fraction"),
        ({"trainable_fraction": 1.5}, "trainable_fraction"),
    ],
)
def test_bad_input_is_one_line_on_both_sides(bad, says):
    inputs = {"parameters": 1_000_000, "gpus": 2, "memory_gib": 16, "precision": "fp32", "optimizer": "adam"} | bad
    with pytest.raises(ValueError, match=says) as raised:
        rows_for(**_library(inputs))
    assert "\n" not in str(raised.value)
    assert "error" in run_calculator_js([inputs])["rows"][0]


# DeepSpeed's estimators, no offload, one node (deepspeedai/DeepSpeed edaa722): estimate_zero2_model_states_mem_needs
# (deepspeed/runtime/zero/stage_1_and_2.py:3081-3098) and estimate_zero3_model_states_mem_needs
# (deepspeed/runtime/zero/stage3.py:3744-3780), in GB as they print them. GPT-2 XL's largest layer is its 50257 x 1600
# embedding, Llama-2-7B's its 32000 x 4096 one; DeepSpeed's ZeRO-3 gathers module by module, and both models have
# 291 modules with parameters of their own (GPT-2 XL: 2 embeddings, 6 in each of 48 blocks, the last norm;
# Llama-2-7B: the embedding, 9 in each of 32 blocks, the last norm and the head).
DEEPSPEED = [  # parameters, largest layer, GPUs, ZeRO-2 GB, ZeRO-3 GB
    (1_557_611_200, 50257 * 1600, 2, 17.134, 14.340),
    (1_557_611_200, 50257 * 1600, 8, 6.620, 3.826),
    (6_738_415_616, 32000 * 4096, 2, 74.123, 61.170),
    (6_738_415_616, 32000 * 4096, 8, 28.638, 15.686),
]


@pytest.mark.parametrize("parameters, largest, gpus, zero2_gb, zero3_gb", DEEPSPEED)
def test_the_deepspeed_setting_is_deepspeeds_estimators(parameters, largest, gpus, zero2_gb, zero3_gb):
    """ZeRO-2: 2Ψ + 18Ψ/N, the row's model states (its parameters, gradients and optimizer state: the estimator
    leaves out buckets); ZeRO-3: 4 B x the largest layer + 18Ψ/N, the FULL_SHARD row's total without activations
    (the largest unit gathered and its gradient, both 16-bit). The ZeRO paper's setting holds 4Ψ/N less under
    ZeRO-2 (no fp32 gradient partition): DeepSpeed's estimator counts 13-22 % more."""
    inputs = {"precision": "deepspeed", "shard_units": 291, "largest_unit": largest}
    rows = {row["strategy"]: row for row in rows_for(parameters, gpus, 80.0, **inputs)}
    zero2, full_shard = rows["ZeRO-2"], rows["FSDP FULL_SHARD (ZeRO-3)"]
    assert round((zero2["parameters"] + zero2["gradients"] + zero2["optimizer_state"]) / 1e9, 3) == zero2_gb
    assert round(full_shard["total"] / 1e9, 3) == zero3_gb
    assert full_shard["gathered"] == full_shard["buckets"] == 2 * largest  # the largest layer, 16-bit, whole
    assert round((2 * parameters + 18 * parameters // gpus) / 1e9, 3) == zero2_gb  # the estimators' own formulas
    assert round((4 * largest + 18 * parameters // gpus) / 1e9, 3) == zero3_gb
    paper = {row["strategy"]: row for row in rows_for(parameters, gpus, 80.0, **inputs | {"precision": "zero-paper"})}
    paper_state = sum(paper["ZeRO-2"][part] for part in ("parameters", "gradients", "optimizer_state"))
    assert zero2["gradients"] - paper["ZeRO-2"]["gradients"] == 4 * -(-parameters // gpus)
    assert 1.13 < zero2_gb * 1e9 / paper_state < 1.23  # DeepSpeed's estimator counts 13-22 % more
    page = run_calculator_js([{"parameters": parameters, "gpus": gpus, "memory_gib": 80.0} | inputs])["rows"][0]
    assert page == list(rows.values())


PLAYBOOK_8B_GIB = {1024: 4.25, 4096: 17.0, 16384: 68.0}
"""The Ultra-Scale Playbook's activations of an 8B model (32 layers, h 4096, 32 heads) for one sequence: 34·s·b·h
bytes a layer, no s^2 term."""


def test_fused_attention_by_default_is_the_playbooks_8b_activations():
    """Fused attention (torch's SDPA, which the course's GPT calls) stores no s^2 scores: the Playbook's figures,
    linear in the tokens. Eager attention adds 5·a·s^2·b a layer: more than three times the bytes for twice the
    tokens. The page computes both as the library does."""
    inputs = []
    for seq_len, gib in PLAYBOOK_8B_GIB.items():
        fused = Transformer(hidden=4096, heads=32, seq_len=seq_len, micro_batch=1)
        eager = Transformer(hidden=4096, heads=32, seq_len=seq_len, micro_batch=1, attention="eager")
        assert activation_bytes(32, fused, "mixed") == gib * GIB
        assert activation_bytes(32, eager, "mixed") == gib * GIB + 32 * 5 * 32 * seq_len**2
        inputs += [
            {"parameters": 8 * 10**9, "gpus": 8, "memory_gib": 80.0, "transformer": transformer_inputs(layer)}
            for layer in (fused, eager)
        ]
    page = run_calculator_js(inputs)["rows"]
    assert page == [rows_for(**_library(case)) for case in inputs]
    assert [rows[0]["activations"] / GIB for rows in page[::2]] == list(PLAYBOOK_8B_GIB.values())
    eager_1k, eager_4k = page[1][0]["activations"], page[3][0]["activations"]
    assert eager_4k > 4 * eager_1k  # eager grows faster than the tokens


# The rows the peak model covers, and its variant for each: torch DDP's default buckets are its "ddp".
PEAK_MODEL = {
    "DDP, torch's default buckets": "ddp",
    "ZeRO-1": "zero1",
    "ZeRO-2": "zero2",
    "FSDP FULL_SHARD (ZeRO-3)": "fsdp",
    "FSDP SHARD_GRAD_OP": "fsdp-no-reshard",
}
SAME_DTYPES = {"fp32": "fp32", "zero-paper": "mixed"}
"""The calculator's precision settings the peak model can state (one dtype held, gathered and reduced): its
``precision`` for each."""


@pytest.mark.parametrize("precision", list(SAME_DTYPES))
@pytest.mark.parametrize(
    "parameters, gpus, units, largest",
    [(1_234_567, 3, 7, None), (1_000_000, 2, 32, 80_000), (124_439_808, 4, 12, None), (7_000_000_000, 8, 32, None)],
)
def test_the_calculator_is_the_course_peak_model(precision, parameters, gpus, units, largest):
    """Every row the peak model (:func:`distlab.predict.costmodel.predict_peak_bytes`) covers, on the same units
    (:func:`row_units`) and activations: the same state, gathered parameters and in-flight gradients (ZeRO-2's
    bucket, FSDP's largest unit's gradient before its reduce-scatter), and a total that is the peak model's start of
    backward plus the gradient shards, which the calculator keeps from the last step and the peak model frees
    (zero_grad) until the optimizer step. ZeRO-1/2 only where the model is one of the course's 5 MB buckets: the
    calculator cuts its flat model into none, the peak model into 5 MB ones."""
    activations = 3 * 10**8
    inputs = Inputs(gpus, 80.0, precision, shard_units=units, activations_gib=activations / GIB, largest_unit=largest)
    rows = {row["strategy"]: row for row in memory_per_rank(parameters, inputs)}
    for label, variant in PEAK_MODEL.items():
        if variant.startswith("zero") and parameters > ZERO_BUCKET:
            continue
        row, units_of_row = rows[label], row_units(label, parameters, inputs)
        peak = predict_peak_bytes(variant, gpus, units_of_row, row["activations"], precision=SAME_DTYPES[precision])
        assert [row[k] for k in ("parameters", "gradients", "optimizer_state")] == [
            peak[k] for k in ("parameters", "gradients", "optimizer_state")
        ], label
        assert row["gathered"] == peak["gathered"], label
        in_flight = {"ddp": peak["buckets"], "zero1": 0}.get(variant, peak["in_flight"])
        assert row["buckets"] == in_flight, label
        kept_apart = 0 if variant == "zero1" else peak["gradients"]  # ZeRO-1's flat gradients are in its kept state
        assert row["total"] == peak["start_of_backward"] + kept_apart, label
    full_shard = rows["FSDP FULL_SHARD (ZeRO-3)"]
    assert full_shard["buckets"] > 0 and full_shard["buckets"] == full_shard["gathered"]  # one dtype: a unit each


@pytest.mark.parametrize("fraction", [0.01, 0.25])
def test_a_frozen_base_holds_its_weights_and_sends_its_trainable_gradients(fraction):
    """Frozen values keep only their weights: gradients, optimizer state and DDP's bucket copy shrink to the trainable
    fraction, the parameters do not. DDP all-reduces only the trainable gradients; FSDP still gathers every parameter
    twice and reduce-scatters the fraction: :func:`distlab.predict.traffic.expected_bytes_per_step` with
    ``trainable``, to the byte, and the page computes the same."""
    p, n = 8_000_000, 4
    whole = {row["strategy"]: row for row in rows_for(p, n, 80.0, "fp32", "adam", shard_units=8)}
    inputs = {"parameters": p, "gpus": n, "memory_gib": 80.0, "precision": "fp32", "shard_units": 8}
    frozen_rows = rows_for(**inputs, trainable_fraction=fraction)
    frozen = {row["strategy"]: row for row in frozen_rows}
    for label, row in frozen.items():
        assert row["parameters"] == whole[label]["parameters"], label
        assert row["gradients"] == int(whole[label]["gradients"] * fraction), label
        assert row["optimizer_state"] == int(whole[label]["optimizer_state"] * fraction), label
    trainable = int(p * fraction)
    assert frozen["DDP, torch's default buckets"]["buckets"] == 4 * trainable
    assert frozen["DDP, torch's default buckets"]["sent"] == expected_bytes_per_step("ddp", p, n, trainable=trainable)
    assert frozen["FSDP FULL_SHARD (ZeRO-3)"]["sent"] == expected_bytes_per_step("fsdp", p, n, trainable=trainable)
    assert frozen["FSDP SHARD_GRAD_OP"]["sent"] == expected_bytes_per_step("fsdp-no-reshard", p, n, trainable=trainable)
    assert run_calculator_js([inputs | {"trainable_fraction": fraction}])["rows"][0] == frozen_rows


@pytest.mark.parametrize(
    "precision, crossing",
    [("torch", 2 / 3), ("course", 1.0), ("fp32", 2.0), ("zero-paper", 2.0)],
)
def test_fsdp_sends_less_than_ddp_only_above_the_crossing(precision, crossing):
    """DDP sends 2f values of its gradient dtype, FULL_SHARD 2 gathers in param_dtype and f in reduce_dtype:
    equal at :func:`distlab.predict.traffic.frozen_crossing`. Under torch's defaults (16-bit gathers and reduce,
    DDP's fp32 all-reduce) that is f = 2/3; in one dtype f = 2, so over any frozen base FSDP sends more."""
    setup = PRECISIONS[precision]
    ddp_bytes = BYTES_PER_VALUE["adam", setup.state][1]
    assert frozen_crossing(2, setup.fsdp_gather, setup.fsdp_reduce, ddp_bytes) == pytest.approx(crossing)

    def ratio(fraction):
        rows = rows_for(8_000_000, 4, 80.0, precision, shard_units=8, trainable_fraction=fraction)
        return rows[STRATEGY_ROWS.index("FSDP FULL_SHARD (ZeRO-3)")]["sent_vs_ddp"]

    if crossing < 1:
        assert ratio(crossing * 0.99) > 1 > ratio(min(1.0, crossing * 1.01))
    assert ratio(0.01) > 25  # a 1 % adapter: FSDP sends tens of times DDP's bytes
