"""The book's memory calculator computes, in JavaScript, exactly what the library's model computes.

The same inputs go to ``distlab.predict.calculator.memory_per_rank`` and to ``distlabMemoryPerRank`` of
``book/_static/distlab-calculator.js`` (run by ``node`` where it is on PATH, else in Debian's Chromium
through Playwright; skipped only without either); every byte of every row must agree, under every precision
choice. The defaults of the page's fragment (``book/_static/calculator.html``: torch's defaults) and the page's
rules (torch DDP under autocast holds 20 B a parameter with Adam; FULL_SHARD sends DDP's bytes with an fp32
reduce-scatter, three quarters of them with torch's 16-bit default) are checked against arithmetic by hand, and
the bytes sent against :mod:`distlab.predict.traffic` and :data:`distlab.predict.gpu_predictions.POLICIES`
(``tests/test_calculator_references.py``, with the rows against hand arithmetic and published estimators).
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
    largest_fitting_parameters,
    memory_per_rank,
    transformer_from,
)
from distlab.predict.memory import BYTES_PER_VALUE, STEP_COUNTER_BYTES

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
