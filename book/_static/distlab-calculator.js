/* The memory calculator, in the reader's browser: bytes per rank by strategy, and whether they fit.
 *
 * distlabMemoryPerRank(inputs) is distlab.predict.calculator.memory_per_rank, formula for formula, for a
 * model cut into `shard_units` equal flat units, and distlabLargestFitting(inputs) is
 * largest_fitting_parameters (tests/test_calculator.py runs both sides on a grid of inputs and
 * compares every number). Every <div class="distlab-calculator"> on a page (book/_static/calculator.html)
 * is wired to it. Jupyter Book adds every .js file of book/_static to every page, so this file does
 * nothing where there is no calculator. Under node it exports the pure functions instead.
 */
(function (root) {
  "use strict";

  const GIB = 2 ** 30;
  // distlab.memory.BYTES_PER_VALUE: bytes per value of (parameters, gradients, optimizer state).
  const BYTES_PER_VALUE = {
    "adam,fp32": [4, 4, 8],
    "adamw,fp32": [4, 4, 8],
    "sgd,fp32": [4, 4, 4],
    "adam,mixed": [2, 2, 12],
    "adamw,mixed": [2, 2, 12],
    "sgd,mixed": [2, 2, 8],
  };
  // distlab.memory.STEP_COUNTER_BYTES: Adam's float32 `step` per tensor it steps.
  const STEP_COUNTER_BYTES = { adam: 4, adamw: 4, sgd: 0 };
  /* distlab.predict.calculator.PRECISIONS, each one setup whole: `state`, the precision of BYTES_PER_VALUE the
   * state at rest is held in (DDP and ZeRO-1/2 also send it in those dtypes); FSDP2's `fsdp_gather` (param_dtype,
   * on its all-gathers and in its gathered units) and `fsdp_reduce` (reduce_dtype, on its reduce-scatters), bytes
   * per value; `activations`, "fp32" where they are doubled; `fp32_gradients`, bytes per value stepped of
   * DeepSpeed's fp32 gradient partition, and `zero3_16bit_gradients` false where under ZeRO-3 that partition is
   * the only gradient kept. The labels are the page's <option>s. */
  const PLAIN = { fp32_gradients: 0, zero3_16bit_gradients: true };
  const PRECISIONS = {
    torch: { state: "fp32", fsdp_gather: 2, fsdp_reduce: 2, activations: "16-bit", ...PLAIN },
    course: { state: "fp32", fsdp_gather: 2, fsdp_reduce: 4, activations: "16-bit", ...PLAIN },
    fp32: { state: "fp32", fsdp_gather: 4, fsdp_reduce: 4, activations: "fp32", ...PLAIN },
    "zero-paper": { state: "mixed", fsdp_gather: 2, fsdp_reduce: 2, activations: "16-bit", ...PLAIN },
    deepspeed: {
      state: "mixed",
      fsdp_gather: 2,
      fsdp_reduce: 2,
      activations: "16-bit",
      fp32_gradients: 4,
      zero3_16bit_gradients: false,
    },
  };
  const DEFAULT_PRECISION = "torch";
  const OPTIMIZERS = ["adam", "adamw", "sgd"];
  // distlab.predict.calculator.ZERO_BUCKET_VALUES: ZeRO-2's one bucket of whole gradients (5 MiB of fp32 values).
  const ZERO_BUCKET_VALUES = Math.floor((5 * 2 ** 20) / 4);
  // Row label -> ZeRO stage of distlab.predict.memory.STAGE, torch DDP's second copy of the gradients,
  // and whether FSDP keeps every unit gathered.
  const STRATEGIES = [
    { label: "DDP, torch's default buckets", stage: 0, bucketCopy: true },
    { label: "DDP, gradient_as_bucket_view", stage: 0 },
    { label: "ZeRO-1", stage: 1 },
    { label: "ZeRO-2", stage: 2 },
    { label: "FSDP FULL_SHARD (ZeRO-3)", stage: 3, keepsGathered: false },
    { label: "FSDP SHARD_GRAD_OP", stage: 3, keepsGathered: true },
  ];
  const TRANSFORMER_FIELDS = ["hidden", "heads", "seq_len", "micro_batch"];
  // distlab.predict.calculator.ATTENTION: fused attention stores no s^2 scores (the default); eager does.
  const ATTENTION = ["fused", "eager"];
  const DEFAULT_ATTENTION = "fused";

  // Exact for the whole numbers this page meets (below 2**53): the float quotient is corrected.
  function ceilDiv(a, b) {
    let q = Math.floor(a / b);
    while (q * b < a) q += 1;
    while (q > 0 && (q - 1) * b >= a) q -= 1;
    return q;
  }

  function isWhole(x) {
    return typeof x === "number" && Number.isInteger(x);
  }

  function check(inputs) {
    const { parameters, gpus, memory_gib, precision, optimizer, activations_gib, shard_units } = inputs;
    const { transformer, largest_unit } = inputs;
    if (!isWhole(parameters) || parameters < 1) throw new Error("the model needs at least 1 parameter, a whole number");
    if (!isWhole(gpus) || gpus < 1) throw new Error("GPUs must be a whole number of at least 1");
    if (!(memory_gib > 0)) throw new Error("memory per GPU must be positive");
    if (!Object.hasOwn(PRECISIONS, precision)) {
      throw new Error(`precision must be one of ${Object.keys(PRECISIONS).join(", ")}`);
    }
    if (!OPTIMIZERS.includes(optimizer)) throw new Error(`optimizer must be one of ${OPTIMIZERS.join(", ")}`);
    if (!(activations_gib >= 0)) throw new Error("activations must be 0 GiB or more");
    if (!isWhole(shard_units) || shard_units < 1 || shard_units > parameters) {
      throw new Error("shard units must be a whole number from 1 to the number of parameters");
    }
    if (largest_unit != null && (!isWhole(largest_unit) || largest_unit < 1)) {
      throw new Error("the largest unit must be at least 1 parameter, a whole number, or none");
    }
    if (!(inputs.trainable_fraction > 0 && inputs.trainable_fraction <= 1)) {
      throw new Error("the trainable fraction must be above 0 and at most 1");
    }
    if (transformer != null) {
      for (const name of TRANSFORMER_FIELDS) {
        if (!isWhole(transformer[name]) || transformer[name] < 1) {
          throw new Error(`the transformer's ${name} must be a whole number of at least 1`);
        }
      }
      if (!ATTENTION.includes(transformer.attention ?? DEFAULT_ATTENTION)) {
        throw new Error(`the transformer's attention must be one of ${ATTENTION.join(", ")}`);
      }
    }
  }

  /* distlab.predict.calculator.layer_activation_bytes: 34*s*b*h bytes a layer keeps in 16-bit training with
   * fused attention, Korthikanti et al.'s s*b*h*(34 + 5*a*s/h) with eager attention, or 2*s*b*h with full
   * recomputation. */
  function layerActivationBytes({ hidden: h, heads: a, seq_len: s, micro_batch: b, recompute, attention }) {
    if (recompute) return 2 * s * b * h;
    return 34 * s * b * h + ((attention ?? DEFAULT_ATTENTION) === "eager" ? 5 * a * s * s * b : 0);
  }

  // distlab.predict.calculator.Inputs.activations: typed GiB, or the formula for shard_units layers (doubled in fp32).
  function activationBytes({ activations_gib, shard_units, transformer, precision }) {
    if (transformer == null) return Math.trunc(activations_gib * GIB);
    return shard_units * layerActivationBytes(transformer) * (PRECISIONS[precision].activations === "fp32" ? 2 : 1);
  }

  /* Rows as distlab.predict.calculator.memory_per_rank returns them: {strategy, parameters, gradients,
   * optimizer_state, buckets, gathered, activations, total, fits, sent, sent_vs_ddp}, bytes on rank 0 at its
   * peak, the bytes it sends in one step, and those over DDP's. */
  function withDefaults(inputs) {
    const defaults = {
      precision: DEFAULT_PRECISION,
      optimizer: "adam",
      activations_gib: 0,
      shard_units: 32,
      trainable_fraction: 1,
    };
    return { ...defaults, transformer: null, largest_unit: null, ...inputs };
  }

  function distlabMemoryPerRank(inputs) {
    const full = withDefaults(inputs);
    check(full);
    return rowsFor(full);
  }

  // distlab.predict.calculator._trainable: the bytes of `whole` that belong to the trainable fraction, rounded down.
  function trainable(whole, fraction) {
    return Math.floor(whole * fraction);
  }

  function rowsFor(full) {
    const { parameters, gpus: n, memory_gib, optimizer, shard_units, largest_unit } = full;
    const fraction = full.trainable_fraction; // a frozen base: only this fraction has gradients and optimizer state
    const precision = PRECISIONS[full.precision];
    const perValue = BYTES_PER_VALUE[`${optimizer},${precision.state}`];
    const stepBytes = STEP_COUNTER_BYTES[optimizer];
    /* distlab.predict.calculator.model_units: with a largest unit, first one unit of that many values (at most
     * what leaves one value to each other unit); then equal_units: `larger` units of size+1 values, the rest of
     * `size`, an empty root. */
    const first = largest_unit != null && shard_units > 1 ? Math.min(largest_unit, parameters - (shard_units - 1)) : 0;
    const equalUnits = first > 0 ? shard_units - 1 : shard_units;
    const size = Math.floor((parameters - first) / equalUnits);
    const larger = parameters - first - size * equalUnits;
    const unitShard = (values) => (values > 0 ? ceilDiv(values, n) : 0); // FSDP2 pads each unit's dim 0 to n's multiple
    const fsdpShard = unitShard(first) + larger * unitShard(size + 1) + (equalUnits - larger) * unitShard(size);
    const largestGathered = Math.max(unitShard(first), unitShard(larger > 0 ? size + 1 : size)) * n;
    const flatShard = ceilDiv(parameters, n); // zero1/zero2: one flat buffer (one bucket) padded to a multiple of n
    const activations = activationBytes(full);

    const rows = STRATEGIES.map(({ label, stage, keepsGathered, bucketCopy }) => {
      let values; // [parameters, gradients, optimizer state, step counters], values held by rank 0
      let gathered = 0;
      let buckets = 0;
      // distlab.predict.calculator.bytes_sent: a ring's 2(N-1) or N-1 shards per collective. DDP and ZeRO-1/2
      // send what they hold (gradients; ZeRO also its parameters), FSDP2 in its param_dtype and reduce_dtype.
      let sent;
      if (stage === 0) {
        values = [parameters, parameters, parameters, 1];
        if (bucketCopy) buckets = parameters * perValue[1];
        sent = trainable(2 * (n - 1) * flatShard * perValue[1], fraction);
      } else if (stage < 3) {
        // zero1 keeps its whole flat gradient, padding included; zero2 only its slice, and one bucket whole
        values = [flatShard * n, stage === 2 ? flatShard : flatShard * n, flatShard, 1];
        if (stage === 2) buckets = ceilDiv(Math.min(parameters, ZERO_BUCKET_VALUES), n) * n * perValue[1];
        sent = trainable((n - 1) * flatShard * (perValue[1] + perValue[0]), fraction);
      } else {
        values = [fsdpShard, fsdpShard, fsdpShard, shard_units];
        const gatherBytes = precision.fsdp_gather;
        gathered = (keepsGathered ? fsdpShard * n : largestGathered) * gatherBytes;
        // the largest unit's whole gradient before its reduce-scatter, and its source while cast to a wider dtype
        const castFrom = precision.fsdp_reduce !== gatherBytes ? gatherBytes : 0;
        buckets = largestGathered * (precision.fsdp_reduce + castFrom);
        // every parameter gathered, frozen ones too; only the trainable fraction's gradients reduce-scattered
        const gathers = (n - 1) * fsdpShard * (keepsGathered ? 1 : 2) * gatherBytes;
        sent = gathers + trainable((n - 1) * fsdpShard * precision.fsdp_reduce, fraction);
      }
      // DeepSpeed's fp32 gradient partition, one value per value stepped; under its ZeRO-3 the only gradient kept
      const sixteenBit = stage === 3 && !precision.zero3_16bit_gradients ? 0 : values[1] * perValue[1];
      const row = {
        strategy: label,
        parameters: values[0] * perValue[0],
        gradients: trainable(values[2] * precision.fp32_gradients + sixteenBit, fraction),
        optimizer_state: trainable(values[2] * perValue[2] + values[3] * stepBytes, fraction),
        buckets: trainable(buckets, fraction),
        gathered,
        activations,
      };
      row.total = row.parameters + row.gradients + row.optimizer_state + row.buckets + gathered + activations;
      row.fits = row.total <= memory_gib * GIB;
      row.sent = sent;
      return row;
    });
    // distlab.predict.calculator.memory_per_rank: each row's bytes sent over DDP's (null where DDP sends none)
    const ddpSent = rows[0].sent;
    for (const row of rows) row.sent_vs_ddp = ddpSent > 0 ? row.sent / ddpSent : null;
    return rows;
  }

  // distlab.calculator.LARGEST_SEARCHED: every byte count below it stays an exact integer here.
  const LARGEST_SEARCHED = 1e14;

  /* distlab.calculator.largest_fitting_parameters: {strategy label: the most parameters that fit}, by
   * bisection over the parameter count (totals never fall as it grows). */
  function distlabLargestFitting(inputs) {
    const full = withDefaults(inputs);
    full.parameters = full.shard_units; // the smallest model with that many units: checks the other inputs
    check(full);
    const largest = {};
    STRATEGIES.forEach(({ label }, index) => {
      const fits = (parameters) => rowsFor({ ...full, parameters })[index].fits;
      if (!fits(full.shard_units)) {
        largest[label] = 0;
      } else if (fits(LARGEST_SEARCHED)) {
        largest[label] = LARGEST_SEARCHED;
      } else {
        let fitting = full.shard_units;
        let tooLarge = LARGEST_SEARCHED;
        while (tooLarge - fitting > 1) {
          const middle = Math.floor((fitting + tooLarge) / 2);
          if (fits(middle)) fitting = middle;
          else tooLarge = middle;
        }
        largest[label] = fitting;
      }
    });
    return largest;
  }

  function gib(bytes) {
    return (bytes / GIB).toFixed(2);
  }

  function modelSize(parameters) {
    if (parameters >= LARGEST_SEARCHED) return `at least ${LARGEST_SEARCHED / 1e9} B`;
    if (parameters === 0) return "none";
    return parameters >= 1e9 ? `${(parameters / 1e9).toFixed(2)} B` : `${(parameters / 1e6).toFixed(1)} M`;
  }

  function readInputs(form) {
    const number = (name) => Number(form.elements[name].value);
    return {
      parameters: Math.round(number("billions") * 1e9),
      gpus: number("gpus"),
      memory_gib: number("memory_gib"),
      precision: form.elements.precision.value,
      optimizer: form.elements.optimizer.value,
      activations_gib: number("activations_gib"),
      shard_units: number("shard_units"),
      trainable_fraction: number("trainable_fraction"),
      largest_unit: number("largest_millions") > 0 ? Math.round(number("largest_millions") * 1e6) : null,
      transformer: form.elements.activations_from.value === "formula" ? readTransformer(form, number) : null,
    };
  }

  // The layer Korthikanti et al.'s formula counts; its inputs are shown only when the formula is chosen.
  function readTransformer(form, number) {
    const layer = { recompute: form.elements.recompute.checked, attention: form.elements.attention.value };
    for (const name of TRANSFORMER_FIELDS) layer[name] = number(name);
    return layer;
  }

  function showActivationInputs(calculator) {
    const form = calculator.querySelector("form");
    const formula = form.elements.activations_from.value === "formula";
    for (const part of calculator.querySelectorAll("[data-activations]")) {
      part.hidden = (part.dataset.activations === "formula") !== formula;
    }
  }

  function answer(inputs, rows) {
    const fitting = rows.filter((row) => row.fits).map((row) => row.strategy);
    const smallest = rows.reduce((best, row) => (row.total < best.total ? row : best));
    const where = `${inputs.gpus} GPU${inputs.gpus === 1 ? "" : "s"} of ${inputs.memory_gib} GiB`;
    const need = `the smallest, ${smallest.strategy}, needs ${gib(smallest.total)} GiB per GPU`;
    if (!fitting.length) return `Nothing fits on ${where}: ${need}.`;
    return `Fits on ${where} with ${fitting.join(", ")}; ${need}.`;
  }

  function render(calculator) {
    const form = calculator.querySelector("form");
    const output = calculator.querySelector("output");
    const body = calculator.querySelector("tbody");
    showActivationInputs(calculator);
    const inputs = readInputs(form);
    let rows;
    try {
      rows = distlabMemoryPerRank(inputs);
    } catch (error) {
      output.textContent = `Check the inputs: ${error.message}.`;
      body.replaceChildren();
      return;
    }
    const { parameters, ...sameMachine } = inputs;
    const largest = distlabLargestFitting(sameMachine);
    output.textContent = answer(inputs, rows);
    body.replaceChildren(
      ...rows.map((row) => {
        const tr = document.createElement("tr");
        const sizes = ["parameters", "gradients", "optimizer_state", "buckets", "gathered", "activations", "total"];
        const fitText = row.fits ? "yes" : "no";
        const ratio = row.sent_vs_ddp === null ? "" : ` (${row.sent_vs_ddp.toFixed(2)}x DDP)`;
        const cells = [row.strategy, ...sizes.map((key) => gib(row[key])), fitText, gib(row.sent) + ratio];
        cells.push(modelSize(largest[row.strategy]));
        for (const text of cells) {
          const td = document.createElement("td");
          td.textContent = text;
          tr.append(td);
        }
        tr.className = row.fits ? "distlab-fits" : "distlab-does-not-fit";
        return tr;
      }),
    );
  }

  function wireAll(document) {
    for (const calculator of document.querySelectorAll(".distlab-calculator")) {
      const form = calculator.querySelector("form");
      if (!form || !calculator.querySelector("output") || !calculator.querySelector("tbody")) continue;
      form.addEventListener("submit", (event) => event.preventDefault());
      form.addEventListener("input", () => render(calculator));
      form.addEventListener("change", () => render(calculator));
      render(calculator);
    }
  }

  const api = { distlabMemoryPerRank, distlabLargestFitting, BYTES_PER_VALUE, STEP_COUNTER_BYTES, PRECISIONS, GIB };
  if (typeof module === "object" && module.exports) {
    module.exports = api;
  } else {
    root.distlabMemoryPerRank = distlabMemoryPerRank;
    root.distlabLargestFitting = distlabLargestFitting;
    if (root.document.readyState === "loading") {
      root.document.addEventListener("DOMContentLoaded", () => wireAll(root.document));
    } else {
      wireAll(root.document);
    }
  }
})(typeof window === "undefined" ? globalThis : window);
