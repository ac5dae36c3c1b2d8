"""Compare a layout's run with the reference, judge it against its tolerance, and show the
result: a terminal table, a JSON document (``JSON_SCHEMA`` lists its fields) and a plot of
the ratios per step."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


from mfsdp.check.layouts import TOLERANCES, Layout

__all__ = ["StepResult", "LayoutResult", "CheckReport", "compare", "noise_report", "NOISE_FLOOR",
           "JSON_SCHEMA"]


@dataclass
class StepResult:
    """One optimizer step of one layout next to the reference."""

    step: int
    loss: float
    """The sharded run's loss (mean over the global batch)."""
    loss_diff: float
    """``loss_sharded - loss_reference``."""
    grad_norm_ratio: float
    """Global gradient norm, sharded / reference."""
    update_norm_ratio: float
    """``||p_after - p_before||`` over all parameters, sharded / reference."""
    worst_param: str
    """The parameter with the largest relative error after this step."""
    worst_param_error: float
    """``||p_sharded - p_reference|| / ||p_reference - p_initial||`` of that parameter."""


@dataclass
class LayoutResult:
    """One layout's verdict, its steps, and what each rank's memory peaked at."""

    name: str
    description: str
    tolerance: str
    passed: bool
    reason: str = ""
    """Why the layout failed (the first step, metric and parameter outside the tolerance, or
    the error); empty when it passed."""
    error: str | None = None
    """The exception a rank raised (the layout then fails), else ``None``."""
    steps: list[StepResult] = field(default_factory=list)
    max_rss_mib: list[float] = field(default_factory=list)
    """Each rank's peak resident memory while it ran this layout (``VmHWM``, reset as the layout
    starts; the whole process's where the kernel does not allow the reset)."""
    tracked_mib: list[float] = field(default_factory=list)
    """Each rank's sharded buffers plus optimizer state after the last step (bytes mfsdp holds)."""
    seconds: float = 0.0
    noise_dominated: dict[str, dict] = field(default_factory=dict)
    """Parameters with noise-dominated elements (a reference gradient at rounding level, see
    ``NOISE_FLOOR``), left out of the verdict: ``{name: {elements, size, max_reference_grad,
    floor, error}}`` (``mfsdp.check.report.noise_report``)."""
    prediction: dict | None = None
    """The numerics simulator's prediction of the first step, for bf16 gradient communication
    (:func:`~mfsdp.check.predict.predict_bf16_reduction`), else ``None``. Its keys: ``param``
    (the parameter it expects to suffer most), ``error`` (relative error of its reduced
    gradient, as mfsdp reduces on gloo), ``ring_error`` (as an NCCL bf16 ring would) and
    ``measured`` (that parameter's relative error after step 1: the gradient's own under SGD)."""


@dataclass
class CheckReport:
    """What ``mfsdp.check`` found: one :class:`~mfsdp.check.report.LayoutResult` per layout run."""

    model: str
    engine: str
    """The engine that ran the sharded side (``mfsdp``, ``fsdp2``, ``megatron_fsdp``)."""
    engine_version: str
    """Its version (``mfsdp 0.1.0``, ``torch 2.13.0``, ``megatron-fsdp 0.6.1``)."""
    replacements: list[str]
    """What the check replaced around the engine so that it runs here (upstream's CUDA calls
    and NCCL-only options on CPU ranks); empty when nothing was."""
    nproc: int
    steps: int
    optimizer: str
    lr: float
    units: list[str]
    layouts: list[LayoutResult]
    skipped: list[str] = field(default_factory=list)
    """The layouts not run (default layouts that need more ranks than ``nproc``, and TP, CP or EP
    layouts the model does not allow)."""
    skip_reasons: dict[str, str] = field(default_factory=dict)
    """Why each skipped layout was skipped (one line each)."""
    bypassed_units: list[str] = field(default_factory=list)
    """Unit modules whose weights got gradients without their ``forward`` running."""
    recursive_gather: list[str] = field(default_factory=list)
    """Classes passed as ``recursive_gather_modules``."""

    @property
    def passed(self) -> bool:
        """Every layout passed."""
        return all(r.passed for r in self.layouts)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``mfsdp.check.report.JSON_SCHEMA`` lists the fields)."""
        d = asdict(self)
        d["passed"] = self.passed
        d["tolerances"] = {k: asdict(v) for k, v in TOLERANCES.items()}
        return d

    def save_json(self, path: str | Path) -> None:
        """Write ``to_dict()`` to ``path`` as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def table(self) -> str:
        """The terminal table: one row per layout and step, then the verdicts."""
        head = (f"{'layout':<19} {'step':>4} {'loss diff':>10} {'grad ratio':>10} "
                f"{'upd ratio':>10}  {'worst parameter (rel. error)'}")
        lines = [head, "-" * len(head)]
        for r in self.layouts:
            if r.error is not None and not r.steps:
                lines.append(f"{r.name:<19} {'-':>4} {'error':>10}")
            for s in r.steps:
                lines.append(f"{r.name:<19} {s.step:>4} {s.loss_diff:>10.2e} "
                             f"{s.grad_norm_ratio:>10.5f} {s.update_norm_ratio:>10.5f}  "
                             f"{s.worst_param} ({s.worst_param_error:.1e})")
        lines.append("")
        for r in self.layouts:
            verdict = "PASS" if r.passed else "FAIL"
            memory = (f"max RSS {max(r.max_rss_mib):6.0f} MiB  sharded state "
                      f"{max(r.tracked_mib):8.3f} MiB" if r.max_rss_mib else
                      f"{'(no memory figures: it raised)':<46}")
            lines.append(f"{verdict} {r.name:<19} tol {r.tolerance:<9} {memory}  "
                         f"{r.seconds:5.1f} s"
                         + (f"\n     {r.reason}" if r.reason else ""))
            for name, noisy in r.noise_dominated.items():
                lines.append(f"     noise-dominated, not judged: {name} ({noisy['elements']} of "
                             f"{noisy['size']} elements: reference gradient at most "
                             f"{noisy['max_reference_grad']:.1e}, floor {noisy['floor']:.1e}; "
                             f"their relative error {noisy['error']:.1e})")
            if r.prediction:
                pr = r.prediction
                lines.append(f"     numerics simulator, step 1: {pr['param']} predicted "
                             f"{pr['error']:.2e} (an NCCL bf16 ring: {pr['ring_error']:.2e}), "
                             f"measured {pr['measured']:.2e}")
        for name in self.skipped:
            lines.append(f"skip {name:<19} {self.skip_reasons.get(name, 'needs more ranks')}")
        lines.append(f"engine: {self.engine} ({self.engine_version})")
        if self.replacements:
            lines.append("replaced so that it runs on CPU ranks:")
            lines += [f"     {what}" for what in self.replacements]
        if self.bypassed_units:
            shown = ", ".join(self.bypassed_units[:4]) + (
                f" and {len(self.bypassed_units) - 4} more" if len(self.bypassed_units) > 4 else "")
            lines.append("note: these FSDP units compute without their forward (a fused parent "
                         "reads their weights): " + shown + (
                             f"; gathered by --recursive-gather {' '.join(self.recursive_gather)}"
                             if self.recursive_gather else ""))
        return "\n".join(lines)

    def plot(self, path: str | Path) -> None:
        """Save a figure of the gradient-norm and update-norm ratios per step to ``path``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharex=True)
        for r in self.layouts:
            if not r.steps:
                continue
            x = [s.step for s in r.steps]
            style = "o-" if r.passed else "s--"
            axes[0].plot(x, [s.grad_norm_ratio for s in r.steps], style, label=r.name)
            axes[1].plot(x, [s.update_norm_ratio for s in r.steps], style, label=r.name)
        for ax, title in zip(axes, ("gradient-norm ratio (sharded / reference)",
                                    "update-norm ratio (sharded / reference)")):
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.set_xticks(range(1, self.steps + 1))
            ax.ticklabel_format(axis="y", useOffset=False)
        axes[1].legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _ratio(a: float, b: float) -> float:
    if b == 0.0:
        return 1.0 if a == 0.0 else math.inf
    return a / b


# [Note: noise-dominated elements] A parameter element whose true gradient is zero (the key
# third of nn.MultiheadAttention's in_proj_bias: the softmax cancels a bias shared by every key)
# gets rounding instead, about 1e-9 of the largest gradient in fp32. Both runs round
# differently, and AdamW divides each update by the gradient's own size, so the element moves a
# full, random step in each run: a healthy model would fail. An element is noise-dominated when
# at every step so far its gradient, in the reference and in the sharded run alike, is at most
# NOISE_FLOOR (by compute dtype) times the largest reference gradient element of that step:
# 2^-21 in fp32 (4 roundings of 2^-23; the key bias sits near 2^-27 of it) and 2^-14 in bf16.
# Those elements are left out of the parameter's relative error and reported apart with their
# own error; a fault that gives them a real gradient on one side lifts them over the floor and
# they are judged again.
NOISE_FLOOR: dict[str, float] = {"fp32": 2.0 ** -21, "bf16": 2.0 ** -14}


def _noise_masks(layout: Layout, ref: dict, got: dict) -> list[dict[str, Any]]:
    """Per step, ``{name: (mask, floor)}`` of the elements noise-dominated so far (see the
    note); empty when either side recorded no gradients."""
    import torch

    out: list[dict[str, Any]] = []
    if not ref.get("grads") or not got.get("grads"):
        return [{} for _ in ref["params"]]
    floor_of = NOISE_FLOOR[layout.compute_dtype]
    masks: dict[str, Any] = {}
    moved: dict[str, Any] = {}  # some gradient, on either side, was not exactly zero
    for i, (gr, gs) in enumerate(zip(ref["grads"], got["grads"])):
        if not gr or not gs:
            return [{} for _ in ref["params"]]
        top = max(float(g.abs().max()) for g in gr.values() if g.numel())
        floor = floor_of * top
        step = {}
        for n, g in gr.items():
            if n not in gs or gs[n].shape != g.shape:
                continue
            other = gs[n].float()
            low = (g.abs() <= floor) & (other.abs() <= floor)
            nonzero = (g != 0) | (other != 0)
            masks[n] = masks[n] & low if n in masks else low
            moved[n] = moved[n] | nonzero if n in moved else nonzero
            mask = masks[n] & moved[n]  # exact zeros on both sides are not noise: judged
            if bool(mask.any()):
                step[n] = (mask, floor)
        out.append(step)
    return out


def compare(layout: Layout, ref: dict, got: dict) -> tuple[list[StepResult], str]:
    """The per-step comparison of ``got`` (rank 0 of :func:`~mfsdp.check.run.run_layout`) with
    ``ref`` (:func:`~mfsdp.check.run.run_reference`), and ('' or) why it fails its tolerance.
    Noise-dominated elements (see ``NOISE_FLOOR``) are left out of each parameter's error;
    :func:`noise_report` describes them."""
    tol = TOLERANCES[layout.tolerance]
    missing = sorted(set(ref["initial"]) - set(got["initial"]))
    if missing:
        return [], f"the sharded model has no parameter {missing[0]!r}"
    steps, reason = [], ""
    noise = _noise_masks(layout, ref, got)
    prev_r, prev_s = ref["initial"], got["initial"]
    for i, (pr, ps) in enumerate(zip(ref["params"], got["params"])):
        names = list(pr)
        upd_r = _norm(pr[n] - prev_r[n] for n in names)
        upd_s = _norm(ps[n].float() - prev_s[n].float() for n in names)
        worst, worst_err = names[0], -1.0
        for n in names:
            d = ps[n].float() - pr[n]
            m = pr[n] - ref["initial"][n]
            if n in noise[i]:
                keep = ~noise[i][n][0]
                d, m = d[keep], m[keep]
            diff, moved = float(d.norm()), float(m.norm())
            err = diff / moved if moved > 0 else (0.0 if diff == 0 else math.inf)
            if err > worst_err:
                worst, worst_err = n, err
        loss_ref = ref["losses"][i]
        s = StepResult(step=i + 1, loss=got["losses"][i], loss_diff=got["losses"][i] - loss_ref,
                       grad_norm_ratio=_ratio(got["grad_norms"][i], ref["grad_norms"][i]),
                       update_norm_ratio=_ratio(upd_s, upd_r), worst_param=worst,
                       worst_param_error=worst_err)
        steps.append(s)
        prev_r, prev_s = pr, ps
        if not reason:
            reason = _outside(s, loss_ref, tol)
    return steps, reason


def noise_report(layout: Layout, ref: dict, got: dict) -> dict[str, dict[str, Any]]:
    """The noise-dominated elements after the last step, by parameter: ``elements`` (how many),
    ``size`` (of how many), ``max_reference_grad`` (their largest reference gradient at any
    step), ``floor`` (the last step's), ``error`` (their own relative error after the last step,
    not judged)."""
    noise = _noise_masks(layout, ref, got)
    if not noise or not noise[-1]:
        return {}
    out = {}
    last_r, last_s = ref["params"][-1], got["params"][-1]
    for n, (mask, floor) in noise[-1].items():
        d = (last_s[n].float() - last_r[n])[mask]
        m = (last_r[n] - ref["initial"][n])[mask]
        diff, moved = float(d.norm()), float(m.norm())
        out[n] = {"elements": int(mask.sum()), "size": mask.numel(),
                  "max_reference_grad": max(float(g[n][mask].abs().max()) for g in ref["grads"]),
                  "floor": floor,
                  "error": diff / moved if moved > 0 else (0.0 if diff == 0 else math.inf)}
    return out


def param_error(ref: dict, got: dict, name: str, step: int = 1) -> float:
    """``name``'s relative error after ``step`` (1-based), as :func:`compare` measures it."""
    diff = float((got["params"][step - 1][name].float() - ref["params"][step - 1][name]).norm())
    moved = float((ref["params"][step - 1][name] - ref["initial"][name]).norm())
    return diff / moved if moved > 0 else (0.0 if diff == 0 else math.inf)


def _outside(s: StepResult, loss_ref: float, tol) -> str:
    """'' when ``s`` is within ``tol``, else which metric is outside it (naming the parameter)."""
    where = f"step {s.step}: "
    worst = f"; worst parameter {s.worst_param} (relative error {s.worst_param_error:.2e})"
    if not abs(s.grad_norm_ratio - 1) <= tol.ratio:
        return where + f"gradient-norm ratio {s.grad_norm_ratio:.4f} (tolerance 1 ± {tol.ratio:g})" + worst
    if not abs(s.update_norm_ratio - 1) <= tol.ratio:
        return where + f"update-norm ratio {s.update_norm_ratio:.4f} (tolerance 1 ± {tol.ratio:g})" + worst
    if not s.worst_param_error <= tol.param:
        return where + f"parameter {s.worst_param} relative error {s.worst_param_error:.2e} " \
                       f"(tolerance {tol.param:g})"
    if not abs(s.loss_diff) <= tol.loss * max(1.0, abs(loss_ref)):
        return where + f"loss differs by {s.loss_diff:.2e} (tolerance {tol.loss:g} relative)" + worst
    return ""


# The fields of the JSON document (``--json``), for tools that read it.
JSON_SCHEMA: dict[str, Any] = {
    "model": str, "engine": str, "engine_version": str, "replacements": list, "nproc": int, "steps": int, "optimizer": str, "lr": float, "units": list,
    "passed": bool, "skipped": list, "skip_reasons": dict, "bypassed_units": list,
    "recursive_gather": list,
    "tolerances": dict,
    "layouts": [{
        "name": str, "description": str, "tolerance": str, "passed": bool, "reason": str,
        "error": (str, type(None)), "max_rss_mib": list, "tracked_mib": list, "seconds": float,
        "prediction": (dict, type(None)), "noise_dominated": dict,
        "steps": [{"step": int, "loss": float, "loss_diff": float, "grad_norm_ratio": float,
                   "update_norm_ratio": float, "worst_param": str,
                   "worst_param_error": float}],
    }],
}
