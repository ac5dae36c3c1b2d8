"""Sphinx directive ``mfsdp-planner-calculator``: the planner page's interactive calculator.

Usage in MyST::

    ```{mfsdp-planner-calculator}
    ```

The directive writes the form (one drop-down list per input of
:data:`mfsdp.tools.plan_export.GRID`, the layer among them: ``mfsdp plan --transformer-impl``,
then the GPU of :data:`~mfsdp.tools.plan_export.DEVICES`
and the compute efficiency of :data:`~mfsdp.tools.plan_export.EFFICIENCY`) and the default
inputs' result, looked up in the same tables the page's script reads, so the page shows numbers
before the script runs and without JavaScript. ``docs/_static/mfsdp-planner.js`` then fills the
result in the browser from ``_static/planner-tables.json``, which this extension writes at build
time from :func:`mfsdp.tools.plan_export.export`: the planner's own numbers, looked up, never
recomputed by a second implementation. :func:`result_html` writes the markup of the script's
``resultHtml``; ``tests/test_plan_calculator.py`` holds the two to the same numbers.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

TABLES = "planner-tables.json"

LABELS = {
    "preset": "Model",
    "world_size": "GPUs (world size)",
    "strategy": "Sharding strategy",
    "dp_outer": "Outer size (outer data-parallel groups)",
    "outer_strategy": "Outer sharding (no_shard: HSDP, optim: HFSDP)",
    "tp": "Tensor parallel (TP)",
    "cp": "Context parallel (CP)",
    "ep": "Expert parallel (EP)",
    "sequence_parallel": "Sequence parallel (SP)",
    "micro_batch": "Micro-batch (sequences)",
    "seq_length": "Sequence length (tokens)",
    "recompute": "Recompute",
    "transformer_impl": "Layer (activations and loss)",
    "device": "GPU (memory, peak and links)",
    "efficiency": "Compute efficiency (fraction of peak)",
}
DEFAULTS = {"preset": "llama3-8b", "world_size": 64, "seq_length": 4096, "device": "H100",
            "efficiency": 0.4}  # mfsdp plan's (its world size is 8; the guide's examples use 64)
TERMS = ["weights", "main_weights", "grads", "optimizer", "gathered", "grad_buffers",
         "activations", "logits"]
COLOURS = ["#0072b2", "#56b4e9", "#009e73", "#f0e442", "#e69f00", "#d55e00", "#cc79a7",
           "#999999"]  # the script's, one per memory term
LAYERS = {"local": "mfsdp train (measured)",
          "transformer_engine": "Megatron-LM with Transformer Engine (Megatron-LM's estimate)"}
"""The layer choices (``mfsdp plan --transformer-impl``) as the form names them."""
_TABLES: dict = {}


def _option(value, selected: bool, text=None) -> str:
    if text is None:
        text = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
    data = json.dumps(value)
    return (f'<option value="{html.escape(data)}"{" selected" if selected else ""}>'
            f"{html.escape(str(text))}</option>")


def choices() -> dict[str, list]:
    """The form's drop-down lists: each input's values, in the form's order."""
    from mfsdp.tools.plan_export import DEVICES, EFFICIENCY, GRID

    return {**GRID, "device": list(DEVICES), "efficiency": list(EFFICIENCY)}


def defaults() -> dict:
    """The inputs the form starts with (the pre-rendered result's)."""
    return {name: DEFAULTS.get(name, values[0]) for name, values in choices().items()}


def tables() -> dict:
    """:func:`mfsdp.tools.plan_export.export`'s tables, computed once per process."""
    if not _TABLES:
        from mfsdp.tools.plan_export import export

        _TABLES.update(export())
    return _TABLES


def _bar_html(got: dict, device_gib: float) -> str:
    scale = 1.05 * max(got["total"], device_gib)
    at_loss = got["logits"] >= got["grad_buffers"] + got["logits_grad"]
    start, segs, legend, label = 0.0, [], [], []
    for i, name in enumerate(TERMS):
        gib = 0.0 if name == "grad_buffers" and at_loss else got[name]
        if name == "logits" and not at_loss:
            name, gib = "logits' gradient", got["logits_grad"]
        width = 100 * gib / scale
        segs.append(f'<span class="mfsdp-calc-seg" style="left:{start}%;width:{width}%;'
                    f'background:{COLOURS[i]}" title="{html.escape(name)}: {gib:.2f} GiB">'
                    "</span>")
        legend.append(f'<li><span class="mfsdp-calc-swatch" style="background:{COLOURS[i]}">'
                      f"</span>{html.escape(name)} {gib:.1f}</li>")
        label.append(f"{name} {gib:.1f}")
        start += width
    limit = 100 * device_gib / scale
    return (f'<div class="mfsdp-calc-bar" role="img" aria-label="GiB per GPU: '
            f'{html.escape(", ".join(label))}; total {got["total"]:.1f} of {device_gib:g}">'
            f'<div class="mfsdp-calc-track">{"".join(segs)}'
            f'<span class="mfsdp-calc-limit" style="left:{limit}%"></span>'
            f'<span class="mfsdp-calc-limit-label" style="left:{limit}%">{device_gib:g} GiB GPU'
            f'</span></div><ul class="mfsdp-calc-legend">{"".join(legend)}</ul></div>')


def command(inputs: dict, tables: dict) -> str:
    """The ``mfsdp plan`` command the script's ``command`` prints for ``inputs``."""
    parts = [f"mfsdp plan {inputs['preset']} --world-size {inputs['world_size']}"]
    flags = [("strategy", "optim_grads_params", "--data-parallel-sharding-strategy"),
             ("dp_outer", 1, "--num-distributed-optimizer-instances"),
             ("outer_strategy", "no_shard", "--outer-dp-sharding-strategy"),
             ("tp", 1, "--tensor-model-parallel-size"), ("sequence_parallel", False, None),
             ("cp", 1, "--context-parallel-size"), ("ep", 1, "--expert-model-parallel-size"),
             ("micro_batch", 1, "--micro-batch-size"), ("seq_length", 4096, "--seq-length"),
             ("recompute", "none", "--recompute-granularity"),
             ("transformer_impl", "local", "--transformer-impl")]
    for name, default, flag in flags:
        if inputs[name] != default:
            parts.append(f"{flag} {inputs[name]}" if flag else "--sequence-parallel")
    device = tables["devices"][inputs["device"]]
    if device["gpu"] != "h100":  # --device-gib follows --gpu: the device's memory
        parts.append(f"--gpu {device['gpu']}")
    if inputs["efficiency"] != tables["efficiency"]["default"]:
        parts.append(f"--compute-efficiency {inputs['efficiency']:g}")
    return " \\\n    ".join(parts)


def result_html(got: dict, inputs: dict, tables: dict) -> str:
    """One result (:func:`mfsdp.tools.plan_export.lookup`'s) as the script's ``resultHtml``
    writes it: the same text in the same ``data-out`` elements."""
    name = inputs["device"]
    gib = tables["devices"][name]["device_gib"]
    pct = f"{100 * inputs['efficiency']:.0f}"
    rows = [f'<tr><td>{t}</td><td data-out="{t}">{got[t]:.2f}</td></tr>' for t in TERMS]
    rows.append(f'<tr class="mfsdp-calc-total"><td>total</td>'
                f'<td data-out="total">{got["total"]:.2f}</td></tr>')
    at_loss = got["logits"] >= got["grad_buffers"] + got["logits_grad"]
    peak = ("at the loss's peak (no grad_buffers yet)" if at_loss else
            f"in backward (+ {got['logits_grad']:.2f} logits' grad, no logits)")
    rows.append(f'<tr><td colspan="2" data-out="peak">{html.escape(peak, quote=False)}</td></tr>')
    fits = got["total"] <= gib - 4
    tight = (" Tight: within 5 GiB of the limit; on the one GPU run compared the plan was 0.8% "
             "high, but it is one run of 6 layers." if fits and got["total"] > gib - 4 - 5
             else "")
    traffic = "".join(
        f'<tr><td>{g}</td><td data-out="sent {g}">{got["sent"][g]:.2f}</td>'
        f'<td data-out="seconds {g}">{got["comm_s"][g]:.2f}</td>'
        f'<td data-out="links {g}">{got["links"][g]}</td></tr>' for g in got["sent"])
    fsdp = f"The FSDP traffic ({got['fsdp_s']:.2f} s) is " + (
        f"hidden under the compute ({got['compute_s']:.2f} s)." if got["fsdp_s"] <= got[
            "compute_s"] else f"exposed: it outlasts the compute ({got['compute_s']:.2f} s), "
        "so the step waits for it.")
    exposed = (f" TP, CP and EP traffic adds {got['exposed_s']:.2f} s to the step."
               if got["exposed_s"] > 0 else "")
    return (
        '<table class="mfsdp-calc-memory"><thead><tr><th>memory term</th>'
        f'<th>GiB per GPU</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
        + _bar_html(got, gib) +
        f'<p class="mfsdp-calc-fits" data-out="fits">{"Fits" if fits else "Does not fit"} on '
        f"{name} ({gib:g} GiB: total at most {gib - 4:g} GiB, 4 GiB stay with the CUDA context "
        f"and the allocator).{tight}</p>"
        f'<p class="mfsdp-calc-time">Predicted step on {name}s at {pct}% of the peak: '
        f'<b data-out="step_s">{got["step_s"]:.2f}</b> s (compute <span data-out="compute_s">'
        f'{got["compute_s"]:.2f}</span> s), <span data-out="tokens_per_gpu_s">'
        f'{got["tokens_per_gpu_s"]:,.0f}</span> tokens/s per GPU, <span data-out="tflops">'
        f'{got["model_tflops_per_gpu"]:,.0f}</span> model TFLOP/s per GPU, MFU '
        f'<span data-out="mfu">{100 * got["mfu"]:.1f}</span>%. When the compute sets the '
        f"step, the MFU is the {pct}% efficiency picked above (less with recomputation: the "
        "recomputed forward takes time but is not the model's work), an assumption, not a "
        "measurement.</p>"
        '<table class="mfsdp-calc-traffic"><thead><tr><th>traffic</th><th>GiB sent per GPU '
        f'and step</th><th>seconds</th><th>links</th></tr></thead><tbody>{traffic}'
        f'</tbody></table><p data-out="overlap">{fsdp}{exposed}</p>'
        "<p>The same estimate in a terminal:</p>"
        f'<pre class="mfsdp-calc-command">{html.escape(command(inputs, tables), quote=False)}'
        "</pre>")


def form_html(prerender: bool = True) -> str:
    """The calculator's form, its status line and the default inputs' result, as HTML (without
    ``prerender``, an empty result: no export needed)."""
    from mfsdp.tools.plan_export import DEVICES, lookup

    start = defaults()
    fields = []
    for name, values in choices().items():
        shown = {"efficiency": lambda v: f"{v:.2f}", "device": lambda v: (
            f"{v} ({DEVICES[v][0]:g} GiB)"), "transformer_impl": LAYERS.get}.get(
            name, lambda v: None)
        options = "".join(_option(v, v == start[name], shown(v)) for v in values)
        fields.append(f'<label class="mfsdp-calc-field"><span>{LABELS[name]}</span>'
                      f'<select name="{name}">{options}</select></label>')
    result = ""
    if prerender:
        got = lookup(tables(), **start)
        result = result_html(got, start, tables())
    # autocomplete off: a reloaded page's form shows the defaults the result was written for
    return (f'<div class="mfsdp-calculator" data-tables="{TABLES}">'
            f'<form class="mfsdp-calc-inputs" autocomplete="off">{"".join(fields)}</form>'
            # the script writes "Loading the planner's tables..." here when it starts, then
            # nothing, or the file it could not load; without JavaScript the <noscript> shows
            '<p class="mfsdp-calc-status" data-out="status" aria-live="polite">'
            "<noscript>The calculator needs JavaScript to follow the inputs: below is the "
            "result for the default ones; for others, run <code>mfsdp plan</code>.</noscript>"
            "</p>"
            f'<div class="mfsdp-calc-result" aria-live="polite">{result}</div></div>')


class PlannerCalculator(SphinxDirective):
    """The calculator, where the directive stands."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(Path(__file__)))
        return [nodes.raw("", form_html(), format="html")]


def _write_tables(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / TABLES).write_text(json.dumps(tables(), separators=(",", ":")))


def setup(app):
    app.add_directive("mfsdp-planner-calculator", PlannerCalculator)
    app.connect("build-finished", _write_tables)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
