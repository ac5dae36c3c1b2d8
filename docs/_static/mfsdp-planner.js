/* The planner page's calculator (docs/_ext/planner_calculator.py writes its form).
 *
 * It estimates nothing itself: the docs build writes _static/planner-tables.json from
 * mfsdp.tools.plan_export.export(), the numbers of `mfsdp plan` (mfsdp/tools/plan.py and
 * plan_time.py) over every input this form offers, split by what each number depends on. This
 * script looks the three rows up and combines them as mfsdp.tools.plan_export.lookup does (the
 * total is the larger of the step's two moments; the compute is the FLOPs over the GPU's peak
 * times the chosen efficiency; the FSDP collectives overlap the compute, the others add to it).
 * The directive pre-renders the default inputs' result (docs/_ext/planner_calculator.py's
 * result_html, the same markup as resultHtml here), so the page shows numbers before this
 * script runs, and without it.
 * tests/test_plan_calculator.py holds compute() and the memory bar (bar()) to the planner in
 * Chromium or node, and
 * tests/test_browser.py holds the page's numbers to `mfsdp plan` in Chromium. */
(function () {
  "use strict";

  function row(tables, table, inputs) {
    const preset = inputs.preset;
    let index = 0;
    for (const axis of tables.axes[table]) {
      const values = axis === "ep" ? tables.ep[preset] : tables.grid[axis];
      const at = values.indexOf(inputs[axis]);
      if (at < 0) throw new Error(`${axis}=${inputs[axis]} is not one of ${values}`);
      index = index * values.length + at;
    }
    const got = tables[table][preset][index];
    return typeof got === "number" ? tables.errors[got] : got;
  }

  /* One layout's numbers (memory in GiB, times in seconds) on inputs.device's GPU at
     inputs.efficiency, or the planner's error message. */
  function compute(tables, inputs) {
    const device = tables.devices[inputs.device];
    if (!device) throw new Error(`device=${inputs.device} is not one of ` +
                                 Object.keys(tables.devices));
    const gpu = device.timed;  // the GPU whose columns and peak time it (an H200: h100)
    const rows = ["state", "activations", "time"].map(t => row(tables, t, inputs));
    for (const r of rows) if (typeof r === "string") return r;
    const [state, act, time] = rows.map((r, i) => {
      const named = {};
      tables.columns[["state", "activations", "time"][i]].forEach((c, j) => { named[c] = r[j]; });
      return named;
    });
    const sent = {}, comm = {}, links = {};
    for (const r of [state, time]) {
      for (const g of tables.groups) {
        if (r[`sent:${g}`] === undefined || r[`sent:${g}`] === null) continue;
        sent[g] = r[`sent:${g}`];
        comm[g] = r[`s:${gpu}:${g}`];
        links[g] = tables.links[r[`link:${gpu}:${g}`]];
      }
    }
    const peak = tables.peak_tflops[gpu] * 1e12;
    const compute_s = time.flops_hw / (peak * inputs.efficiency);
    let fsdp = 0, exposed = 0;
    for (const [g, s] of Object.entries(comm)) {
      if (g === "dp_shard" || g === "dp_outer") fsdp += s; else exposed += s;
    }
    const step = Math.max(compute_s, fsdp) + exposed;
    const out = {};
    tables.memory.forEach(name => { out[name] = state[name]; });
    out.activations = act.activations;
    out.logits = act.logits;
    out.logits_grad = act.logits_grad;
    /* The peak: the larger of the loss's moment (logits, no gradient buffers yet) and the
       backward's (gradient buffers and the logits' bf16 gradient), as Plan.moments. */
    const common = tables.memory.reduce(
      (sum, name) => name === "grad_buffers" ? sum : sum + out[name], 0) + out.activations;
    out.total = common + Math.max(out.logits, out.grad_buffers + out.logits_grad);
    Object.assign(out, {compute_s, step_s: step, tokens_per_gpu_s: time.tokens / step,
                        model_tflops_per_gpu: time.flops_model / step / 1e12,
                        mfu: time.flops_model / step / peak, sent, comm_s: comm, links,
                        fsdp_s: fsdp, exposed_s: exposed});
    return out;
  }

  /* The `mfsdp plan` command that prints the same estimate (a flag only where it is not the
     default). */
  function command(inputs, tables) {
    const parts = [`mfsdp plan ${inputs.preset} --world-size ${inputs.world_size}`];
    if (inputs.strategy !== "optim_grads_params")
      parts.push(`--data-parallel-sharding-strategy ${inputs.strategy}`);
    if (inputs.dp_outer > 1) parts.push(`--num-distributed-optimizer-instances ${inputs.dp_outer}`);
    if (inputs.outer_strategy !== "no_shard")
      parts.push(`--outer-dp-sharding-strategy ${inputs.outer_strategy}`);
    if (inputs.tp > 1) parts.push(`--tensor-model-parallel-size ${inputs.tp}`);
    if (inputs.sequence_parallel) parts.push("--sequence-parallel");
    if (inputs.cp > 1) parts.push(`--context-parallel-size ${inputs.cp}`);
    if (inputs.ep > 1) parts.push(`--expert-model-parallel-size ${inputs.ep}`);
    if (inputs.micro_batch > 1) parts.push(`--micro-batch-size ${inputs.micro_batch}`);
    if (inputs.seq_length !== 4096) parts.push(`--seq-length ${inputs.seq_length}`);
    if (inputs.recompute !== "none") parts.push(`--recompute-granularity ${inputs.recompute}`);
    if (inputs.transformer_impl !== "local")
      parts.push(`--transformer-impl ${inputs.transformer_impl}`);
    // --device-gib follows --gpu: the device's memory is its default
    const device = tables.devices[inputs.device];
    if (device.gpu !== "h100") parts.push(`--gpu ${device.gpu}`);
    if (inputs.efficiency !== tables.efficiency.default)
      parts.push(`--compute-efficiency ${inputs.efficiency}`);
    // one flag per line, as the guide's commands are written, so the block fits the page
    return parts.join(" \\\n    ");
  }

  const TERMS = ["weights", "main_weights", "grads", "optimizer", "gathered", "grad_buffers",
                 "activations", "logits"];

  /* The memory bar of one result (compute()'s): one segment per memory term, in TERMS order,
     each from where the last ends, as live at the step's peak (the loss's: no grad_buffers yet;
     or the backward's: the logits' gradient in place of the logits), and the device's limit, all as percentages of the bar's
     scale (the larger of the total and the device, plus a twentieth for the limit's label). */
  function bar(got, deviceGib) {
    const scale = 1.05 * Math.max(got.total, deviceGib);
    const loss = atLoss(got);
    let start = 0;
    const segments = TERMS.map(name => {
      let gib = got[name];
      if (name === "grad_buffers" && loss) gib = 0;
      if (name === "logits" && !loss) { name = "logits' gradient"; gib = got.logits_grad; }
      const width = 100 * gib / scale;
      const seg = {name, gib, start, width};
      start += width;
      return seg;
    });
    return {segments, end: start, limit: 100 * deviceGib / scale, scale};
  }

  /* Whether the step's peak is the loss's (Plan.peak_moment "loss"), not the backward's. */
  function atLoss(got) {
    return got.logits >= got.grad_buffers + got.logits_grad;
  }

  // one colour per memory term (Okabe and Ito's palette, distinct for colour-blind readers)
  const COLOURS = ["#0072b2", "#56b4e9", "#009e73", "#f0e442", "#e69f00", "#d55e00",
                   "#cc79a7", "#999999"];

  /* x with d decimals as Python's format() writes it: JavaScript's toFixed rounds a value
     exactly halfway (17.125, a binary fraction) away from zero, Python to the even digit. */
  function fixed(x, d) {
    const rounded = x.toFixed(d);
    const exact = Math.abs(x).toFixed(Math.min(100, d + 60));  // every digit of the double
    const dot = exact.indexOf(".");
    if (!/^50*$/.test(exact.slice(dot + 1 + d))) return rounded;
    const down = exact.slice(0, d ? dot + 1 + d : dot);
    return Number(down[down.length - 1]) % 2 ? rounded : (x < 0 ? "-" : "") + down;
  }
  const grouped = n => fixed(n, 0).replace(/\B(?=(\d{3})+(?!\d))/g, ",");

  const escape = text => String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;")
    .replace(/>/g, "&gt;");

  /* A result (compute()'s) as HTML: the memory table, its bar, whether it fits the GPU, the
     step time, each group's traffic and whether the FSDP traffic hides under the compute, and
     the command. planner_calculator.result_html writes the same for the page's default. */
  function resultHtml(got, inputs, tables) {
    const name = inputs.device;
    const gib = tables.devices[name].device_gib;
    const pct = fixed(100 * inputs.efficiency, 0);
    const rows = TERMS.map(t => `<tr><td>${t}</td><td data-out="${t}">${fixed(got[t], 2)}</td></tr>`);
    rows.push(`<tr class="mfsdp-calc-total"><td>total</td>` +
              `<td data-out="total">${fixed(got.total, 2)}</td></tr>`);
    rows.push(`<tr><td colspan="2" data-out="peak">` + (atLoss(got) ?
      "at the loss's peak (no grad_buffers yet)" :
      `in backward (+ ${fixed(got.logits_grad, 2)} logits' grad, no logits)`) + `</td></tr>`);
    const fits = got.total <= gib - 4;
    // as mfsdp plan says: less than 5 GiB to spare is tight (the planner measured 0.8% high
    // once, on one 6-layer run)
    const tight = fits && got.total > gib - 4 - 5 ?
      " Tight: within 5 GiB of the limit; on the one GPU run compared the plan was 0.8% " +
      "high, but it is one run of 6 layers." : "";
    const traffic = Object.keys(got.sent).map(g =>
      `<tr><td>${g}</td><td data-out="sent ${g}">${fixed(got.sent[g], 2)}</td>` +
      `<td data-out="seconds ${g}">${fixed(got.comm_s[g], 2)}</td>` +
      `<td data-out="links ${g}">${got.links[g]}</td></tr>`);
    const fsdp = `The FSDP traffic (${fixed(got.fsdp_s, 2)} s) is ` + (got.fsdp_s <= got.compute_s ?
      `hidden under the compute (${fixed(got.compute_s, 2)} s).` :
      `exposed: it outlasts the compute (${fixed(got.compute_s, 2)} s), so the step waits ` +
      `for it.`);
    const exposed = got.exposed_s > 0 ?
      ` TP, CP and EP traffic adds ${fixed(got.exposed_s, 2)} s to the step.` : "";
    return `<table class="mfsdp-calc-memory"><thead><tr><th>memory term</th>` +
      `<th>GiB per GPU</th></tr></thead><tbody>${rows.join("")}</tbody></table>` +
      barHtml(got, gib) +
      `<p class="mfsdp-calc-fits" data-out="fits">${fits ? "Fits" : "Does not fit"} on ` +
      `${name} (${gib} GiB: total at most ${gib - 4} GiB, 4 GiB stay with the CUDA context ` +
      `and the allocator).${tight}</p>` +
      `<p class="mfsdp-calc-time">Predicted step on ${name}s at ${pct}% of the peak: ` +
      `<b data-out="step_s">${fixed(got.step_s, 2)}</b> s (compute <span data-out="compute_s">` +
      `${fixed(got.compute_s, 2)}</span> s), <span data-out="tokens_per_gpu_s">` +
      `${grouped(got.tokens_per_gpu_s)}</span> tokens/s per GPU, <span data-out="tflops">` +
      `${grouped(got.model_tflops_per_gpu)}</span> model TFLOP/s per GPU, MFU ` +
      `<span data-out="mfu">${fixed(100 * got.mfu, 1)}</span>%. When the compute sets the ` +
      `step, the MFU is the ${pct}% efficiency picked above (less with recomputation: the ` +
      `recomputed forward takes time but is not the model's work), an assumption, not a ` +
      `measurement.</p>` +
      `<table class="mfsdp-calc-traffic"><thead><tr><th>traffic</th><th>GiB sent per GPU ` +
      `and step</th><th>seconds</th><th>links</th></tr></thead><tbody>${traffic.join("")}` +
      `</tbody></table><p data-out="overlap">${fsdp}${exposed}</p>` +
      `<p>The same estimate in a terminal:</p>` +
      `<pre class="mfsdp-calc-command">${escape(command(inputs, tables))}</pre>`;
  }

  if (typeof module !== "undefined" && module.exports) {
    module.exports = {compute, command, bar, resultHtml};
    return;
  }

  function render(root, tables) {
    const form = root.querySelector("form");
    const inputs = {};
    for (const select of form.querySelectorAll("select")) inputs[select.name] = JSON.parse(select.value);
    const ep = form.querySelector('select[name="ep"]');
    const experts = tables.ep[inputs.preset].length > 1;
    ep.disabled = !experts;
    if (!experts) { ep.value = "1"; inputs.ep = 1; }
    const out = root.querySelector(".mfsdp-calc-result");
    const got = compute(tables, inputs);
    if (typeof got === "string") {
      out.innerHTML = "";
      const p = document.createElement("p");
      p.className = "mfsdp-calc-error";
      p.dataset.out = "error";
      p.textContent = `This layout is not valid: ${got}`;
      out.appendChild(p);
      return;
    }
    out.innerHTML = resultHtml(got, inputs, tables);
  }

  /* The memory bar as HTML: a stacked bar with the device's limit as a line, and a legend. */
  function barHtml(got, deviceGib) {
    const b = bar(got, deviceGib);
    const segs = b.segments.map((s, i) =>
      `<span class="mfsdp-calc-seg" style="left:${s.start}%;width:${s.width}%;` +
      `background:${COLOURS[i]}" title="${s.name}: ${fixed(s.gib, 2)} GiB"></span>`).join("");
    const legend = b.segments.map((s, i) =>
      `<li><span class="mfsdp-calc-swatch" style="background:${COLOURS[i]}"></span>` +
      `${s.name} ${fixed(s.gib, 1)}</li>`).join("");
    const label = b.segments.map(s => `${s.name} ${fixed(s.gib, 1)}`).join(", ");
    return `<div class="mfsdp-calc-bar" role="img" aria-label="GiB per GPU: ${label}; ` +
      `total ${fixed(got.total, 1)} of ${deviceGib}">` +
      `<div class="mfsdp-calc-track">${segs}` +
      `<span class="mfsdp-calc-limit" style="left:${b.limit}%"></span>` +
      `<span class="mfsdp-calc-limit-label" style="left:${b.limit}%">${deviceGib} GiB GPU` +
      `</span></div><ul class="mfsdp-calc-legend">${legend}</ul></div>`;
  }

  async function start(root) {
    const base = document.documentElement.dataset.content_root || "";
    const file = "_static/" + root.dataset.tables;
    // the result holds the default inputs' numbers, written at build time; the status line
    // says what happens until the tables arrive, and why if they do not
    const status = root.querySelector(".mfsdp-calc-status");
    status.textContent = "Loading the planner's tables...";
    let tables;
    try {
      const response = await fetch(base + file);
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      tables = await response.json();
    } catch (e) {
      // (a page opened as a file cannot fetch: serve the guide, make serve)
      status.className = "mfsdp-calc-status mfsdp-calc-error";
      status.dataset.out = "error";
      status.textContent = `The calculator could not load ${file} (${e.message || e}): the ` +
                           "result below is for the default inputs only; run mfsdp plan " +
                           "instead, or serve the guide over http (make serve).";
      for (const select of root.querySelectorAll("select")) select.disabled = true;
      return;
    }
    status.textContent = "";
    root.querySelector("form").addEventListener("change", () => render(root, tables));
    render(root, tables);
    root.dataset.ready = "1";
  }

  function init() { document.querySelectorAll(".mfsdp-calculator").forEach(start); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
