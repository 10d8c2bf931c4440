"""The book's memory calculator computes, in JavaScript, exactly what the library's model computes.

The same inputs go to ``distlab.predict.calculator.memory_per_rank`` and to ``distlabMemoryPerRank`` of
``book/_static/distlab-calculator.js`` (run by ``node`` where it is on PATH, else in Debian's Chromium
through Playwright; skipped only without either); every byte of every row must agree. The defaults of
the page's fragment (``book/_static/calculator.html``) are checked against the arithmetic by hand.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from distlab.predict.calculator import (
    GIB,
    OPTIMIZERS,
    PRECISIONS,
    REDUCE_DTYPES,
    ROW_FIELDS,
    STRATEGIES,
    Inputs,
    Transformer,
    largest_fitting_parameters,
    layer_activation_bytes,
    memory_per_rank,
    transformer_from,
    transformer_inputs,
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
  constants: {bytes_per_value: calculator.BYTES_PER_VALUE, step_counter_bytes: calculator.STEP_COUNTER_BYTES},
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
    {"hidden": 12288, "heads": 96, "seq_len": 2048, "micro_batch": 3, "recompute": False},
]


def _grid() -> list[dict]:
    """Sizes from 1e6 to 7e10, odd ones included (their shards pad), on 1 to 8 GPUs, every precision, optimizer
    and reduce dtype, activations typed or counted by the formula."""
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
            "reduce_dtype": list(REDUCE_DTYPES)[index % 2],
            "transformer": LAYERS[index % len(LAYERS)],
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


def test_the_largest_model_that_fits_is_the_threshold():
    largest = largest_fitting_parameters(Inputs(2, 16.0, "mixed", "adam", 0.5, 32))
    for label, parameters in largest.items():
        index = list(STRATEGIES).index(label)
        assert rows_for(parameters, 2, 16.0, "mixed", "adam", 0.5, 32)[index]["fits"], label
        assert not rows_for(parameters + 1, 2, 16.0, "mixed", "adam", 0.5, 32)[index]["fits"], label
    assert largest["DDP, gradient_as_bucket_view"] == (16 * GIB - GIB // 2 - 4) // 16  # 16 B/param, one step counter
    assert largest["DDP, torch's default buckets"] == (16 * GIB - GIB // 2 - 4) // 18  # and 2 B of buckets


def _fragment_defaults() -> dict:
    """The inputs the page opens with, read from the fragment's <input value> and <option selected>."""
    html = FRAGMENT.read_text()
    values = dict(re.findall(r'<input name="(\w+)"[^>]*\svalue="([^"]*)"', html))
    for name, options in re.findall(r'<select name="(\w+)">(.*?)</select>', html, re.S):
        values[name] = re.search(r'<option value="(\w+)" selected>', options).group(1)
    return {
        "parameters": round(float(values.pop("billions")) * 1e9),
        "gpus": int(values.pop("gpus")),
        "memory_gib": float(values.pop("memory_gib")),
        "activations_gib": float(values.pop("activations_gib")),
        "shard_units": int(values.pop("shard_units")),
        "transformer": None if values.pop("activations_from") == "typed" else "formula",
        **{name: values.pop(name) for name in ("precision", "optimizer", "reduce_dtype")},
    }


def test_the_page_opens_on_7b_on_two_16_gib_gpus_where_nothing_fits():
    """The notes' "7B on 2 GPUs: ~14 GB each, fits" counts only the weights; with Adam nothing fits."""
    defaults = _fragment_defaults()
    assert defaults == {
        "parameters": 7_000_000_000,
        "gpus": 2,
        "memory_gib": 16.0,
        "precision": "mixed",
        "optimizer": "adam",
        "activations_gib": 0.0,
        "shard_units": 32,
        "reduce_dtype": "fp32",
        "transformer": None,
    }
    rows = {row["strategy"]: row for row in rows_for(**defaults)}
    p, half = 7_000_000_000, 3_500_000_000
    unit_whole = 2 * -(-(p // 32) // 2) * 2  # one 218,750,000-value block, padded to 2 ranks, in bf16
    assert rows["DDP, gradient_as_bucket_view"]["total"] == 16 * p + 4  # 2 + 2 + 12 B/param, one Adam step counter
    assert rows["DDP, torch's default buckets"]["total"] == 18 * p + 4  # and every 16-bit gradient again
    assert rows["ZeRO-1"]["total"] == 2 * p + 2 * p + 12 * half + 4
    assert rows["ZeRO-2"]["total"] == 2 * p + 2 * half + 12 * half + 4 + 2 * (5 * 2**20 // 4)  # one bucket whole
    assert rows["FSDP FULL_SHARD (ZeRO-3)"]["total"] == 16 * half + 32 * 4 + unit_whole
    assert rows["FSDP SHARD_GRAD_OP"]["total"] == 16 * half + 32 * 4 + 2 * p
    assert not any(row["fits"] for row in rows.values())
    assert min(rows.values(), key=lambda row: row["total"])["strategy"] == "FSDP FULL_SHARD (ZeRO-3)"
    assert rows["FSDP FULL_SHARD (ZeRO-3)"]["total"] > 3 * 16 * GIB  # over three times a T4's memory
    assert run_calculator_js([defaults])["rows"][0] == list(rows.values())


def test_the_reduce_dtype_choices_say_whose_they_are():
    """fp32 reductions are DDP's under autocast and the course's FSDP2 policy, not torch's FSDP2 default: its
    MixedPrecisionPolicy leaves reduce_dtype None, which reduces in the 16-bit param_dtype
    (tests/test_gpu_predictions.py runs it on gloo ranks)."""
    select = re.search(r'<select name="reduce_dtype">(.*?)</select>', FRAGMENT.read_text(), re.S).group(1)
    labels = dict(re.findall(r'<option value="([\w-]+)"[^>]*>([^<]*)</option>', select))
    assert set(labels) == set(REDUCE_DTYPES)
    assert "the course's policy" in labels["fp32"] and "autocast" in labels["fp32"]
    assert "torch's default" not in labels["fp32"]
    assert "FSDP2's default" in labels["16-bit"] and "param_dtype" in labels["16-bit"]


def test_memory_per_gpu_decides_fits_at_the_byte():
    row = rows_for(1_000_000, 1, 1.0, "fp32", "sgd")[1]  # DDP: 12 bytes a parameter, no step counter
    exactly = row["total"] / GIB
    assert rows_for(1_000_000, 1, exactly, "fp32", "sgd")[1]["fits"]
    assert not rows_for(1_000_000, 1, exactly * (1 - 1e-9), "fp32", "sgd")[1]["fits"]


def test_torch_ddp_under_autocast_holds_20_bytes_a_parameter_with_adam():
    """fp32 parameters (autocast leaves them), gradients, buckets, two moments: 4 + 4 + 4 + 8."""
    rows = {row["strategy"]: row for row in rows_for(10**9, 2, 80.0, "fp32", "adam")}
    assert rows["DDP, torch's default buckets"]["total"] == 20 * 10**9 + 4
    assert rows["DDP, gradient_as_bucket_view"]["total"] == 16 * 10**9 + 4


def test_bytes_sent_are_the_rings():
    """DDP sends 2(N-1)/N of the gradients; ZeRO-1/2 as much, half of it the gathered parameters; FULL_SHARD
    gathers twice, SHARD_GRAD_OP once. One GPU sends nothing."""
    p, n = 8_000_000, 4
    sent = {row["strategy"]: row["sent"] for row in rows_for(p, n, 80.0, "mixed", "adam", shard_units=8)}
    assert sent["DDP, torch's default buckets"] == sent["DDP, gradient_as_bucket_view"] == 2 * 3 * (p // 4) * 4
    assert sent["ZeRO-1"] == sent["ZeRO-2"] == 3 * (p // 4) * (4 + 2)  # fp32 reduce-scatter, 16-bit gather
    assert sent["FSDP FULL_SHARD (ZeRO-3)"] == 3 * (p // 4) * (4 + 2 * 2)  # as many bytes as DDP, not 1.5x
    assert sent["FSDP SHARD_GRAD_OP"] == 3 * (p // 4) * (4 + 2)
    halved = rows_for(p, n, 80.0, "mixed", "adam", shard_units=8, reduce_dtype="16-bit")
    assert halved[0]["sent"] == sent["DDP, torch's default buckets"] // 2
    assert halved[4]["sent"] == 3 * (p // 4) * 2 * 3  # in one dtype FULL_SHARD sends 1.5x DDP's bytes
    assert all(row["sent"] == 0 for row in rows_for(p, 1, 80.0))


def test_activations_by_korthikanti_et_al():
    """34sbh + 5as^2b bytes a layer (section 4.1), 2sbh with full recomputation, one layer per shard unit."""
    gpt3_layer = Transformer(hidden=12288, heads=96, seq_len=2048, micro_batch=1)
    assert layer_activation_bytes(gpt3_layer) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    recomputed = Transformer(hidden=12288, heads=96, seq_len=2048, micro_batch=1, recompute=True)
    assert layer_activation_bytes(recomputed) == 2 * 2048 * 12288
    rows = rows_for(10**9, 2, 80.0, "mixed", shard_units=96, transformer=gpt3_layer)
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
        ({"reduce_dtype": "fp8"}, "reduce"),
        ({"transformer": {"hidden": 0, "heads": 1, "seq_len": 1, "micro_batch": 1}}, "hidden"),
    ],
)
def test_bad_input_is_one_line_on_both_sides(bad, says):
    inputs = {"parameters": 1_000_000, "gpus": 2, "memory_gib": 16, "precision": "fp32", "optimizer": "adam"} | bad
    with pytest.raises(ValueError, match=says) as raised:
        rows_for(**_library(inputs))
    assert "\n" not in str(raised.value)
    assert "error" in run_calculator_js([inputs])["rows"][0]
