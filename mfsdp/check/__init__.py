"""``mfsdp check``: a parity doctor for your own model.

Trains the model for a few steps on every layout (each ZeRO strategy, HSDP, HFSDP, bf16 compute, bf16
gradient communication, a resume into another strategy, and where the model allows them TP 2, TP 2 +
SP, CP 2 and EP 2) on ``nproc`` gloo ranks and, next to it, in one process on the same
global batch; then reports per layout and step the loss difference, the gradient-norm and
update-norm ratios (sharded / reference), the parameter furthest off, and a verdict against the
tolerances of ``mfsdp.check.layouts.TOLERANCES``::

    mfsdp check llama-tiny --nproc 2 --steps 3 --optimizer sgd --json check.json --plot check.png

or, from Python, ``mfsdp.check.check("llama-tiny", nproc=2, steps=3)``. ``--engine fsdp2`` or
``--engine megatron_fsdp`` (``engine=``) runs the sharded side with PyTorch FSDP2 or upstream
Megatron-FSDP instead of mfsdp (:mod:`mfsdp.check.engines`). The guide page is
``docs/check.md``; the fault models it is tested on are in ``mfsdp.check.faults``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from mfsdp.check.layouts import LAYOUTS, TOLERANCES, ranks_reason, select_layouts
from mfsdp.check.report import CheckReport, LayoutResult

__all__ = ["check", "CheckReport", "LayoutResult", "LAYOUTS", "TOLERANCES"]

DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}


def check(model: Any, *, nproc: int = 2, steps: int = 3, optimizer: str = "sgd",
          lr: float | None = None, layouts: list[str] | None = None,
          units: list[str] | None = None, optimizer_factory: Callable | str | None = None,
          recursive_gather: list[str] | None = None, resume_fn: Callable | str | None = None,
          global_batch: int | None = None,
          seq_len: int = 16, seed: int = 0, json_path: str | None = None,
          plot_path: str | None = None, progress: Callable[[str], Any] | None = print,
          timeout: float = 300.0, engine: str = "mfsdp",
          after_shard: Callable | str | None = None) -> CheckReport:
    """Check that ``model`` trains the same sharded as in one process; return the report.

    Args:
        model: ``"package.module:factory"``, a Hugging Face config directory, a trainer preset
            (``"llama-tiny"``), or a module-level zero-argument function returning the model.
            The model maps token ids ``[B, S]`` to logits ``[B, S, V]``.
        nproc: ranks per layout (gloo processes on this machine); ``hsdp`` and ``hfsdp`` need 4.
        steps: optimizer steps per layout.
        optimizer: ``"sgd"`` (shows a scale error as it is) or ``"adamw"`` (what you train
            with; it normalises gradient scale away, so run SGD too).
        lr: learning rate (default 0.1 for SGD, 1e-3 for AdamW).
        layouts: names from ``mfsdp.check.LAYOUTS`` (default: all that fit ``nproc``). A TP,
            CP or EP layout the model does not allow (not mfsdp's GPT, a dense model for
            ``ep``, a size that does not divide) is skipped, with its reason in the report.
        units: FSDP unit class names (default: the class of the modules in the ``ModuleList``
            that holds most of the parameters: the layers).
        optimizer_factory: ``fn(module, lr) -> torch.optim.Optimizer`` (or its
            ``"package.module:fn"``), the optimizer your script builds; called on the module
            before ``mfsdp.fully_shard``, in every layout. The reference always trains every
            parameter with ``optimizer`` and ``lr``, so the factory must build the same kind.
        recursive_gather: class names for ``fully_shard(recursive_gather_modules=...)``.
        resume_fn: ``fn(path, model, optimizer)`` loading a checkpoint the way your script
            resumes (or its ``"package.module:fn"``; default
            ``mfsdp.checkpoint.load_checkpoint``), used by the ``resume`` layout.
        global_batch: sequences per step over all ranks (default ``2 * nproc``).
        seq_len: tokens per sequence (random ids, fixed by ``seed``).
        json_path, plot_path: where to write the JSON report and the ratio plot.
        progress: called with one line per layout as it finishes (``None``: silent).
        timeout: seconds one layout may take before its ranks are killed (it then fails).
        engine: what shards the model: ``"mfsdp"`` (``mfsdp.fully_shard``), ``"fsdp2"``
            (PyTorch's ``torch.distributed.fsdp.fully_shard``) or ``"megatron_fsdp"`` (the
            installed ``megatron_fsdp`` package, ``pip install mfsdp[upstream]``). Same
            reference, steps and report; a layout the engine lacks is skipped with the reason
            (``mfsdp.check.engines``).
        after_shard: ``fn(model, optimizer)`` (or its ``"package.module:fn"``) your script
            calls right after sharding, run on every rank once the engine has sharded (not
            after the ``resume`` layout's load): a workaround such as
            ``mfsdp.check.engines.upstream:reset_optimizer_step``.
    """
    from mfsdp.check.models import build_model, bypassed_units, make_batches, resolve_units
    from mfsdp.check.models import check_model_spec, vocab_size
    from mfsdp.check.run import Settings
    from mfsdp.launch import RankPool

    if optimizer not in DEFAULT_LR:
        raise ValueError(f"--optimizer={optimizer!r}: use sgd or adamw")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps={steps!r}: give a positive number of steps")
    if lr is not None and not lr > 0:
        raise ValueError(f"--lr={lr!r}: give a positive learning rate")
    if seq_len < 2:
        raise ValueError(f"--seq-len={seq_len}: next-token loss needs 2 tokens or more")
    for what, fn in (("MODEL", model), ("optimizer_factory", optimizer_factory),
                     ("resume_fn", resume_fn), ("after_shard", after_shard)):
        if callable(fn) and getattr(fn, "__module__", None) == "__main__":
            raise ValueError(f"{what}={fn.__qualname__} is defined in __main__, which the ranks "
                             "cannot import; move it into a module and pass it (or "
                             "'module:function')")
    from mfsdp.check.engines import get_engine

    adapter = get_engine(engine)
    if adapter.missing():
        raise ValueError(adapter.missing())
    if isinstance(after_shard, str):
        from mfsdp.check.models import load_callable

        load_callable(after_shard, "--after-shard")
    chosen, skipped = select_layouts(layouts, nproc, steps)
    global_batch = global_batch or 2 * nproc
    if global_batch % nproc:
        raise ValueError(f"global_batch={global_batch} is not divisible by --nproc {nproc}")
    check_model_spec(model)
    probe = build_model(model, seed)
    unit_classes = resolve_units(probe, units)
    if recursive_gather:
        resolve_units(probe, recursive_gather)
    tokens = make_batches(vocab_size(probe), 1, global_batch, seq_len, seed)[0]
    bypassed = bypassed_units(probe, unit_classes, tokens)
    parent = _fused_parent(probe, bypassed[0]) if bypassed else ""
    skip_reasons = {name: ranks_reason(LAYOUTS[name], nproc, steps) for name in skipped}
    from mfsdp.check.parallel import model_refuses

    for layout in list(chosen):  # TP, CP and EP where the model allows them, else skipped
        reason = adapter.refuses(layout)
        if reason is not None:
            reason = f"not a {adapter.title} layout: {reason}"
        else:
            reason = model_refuses(layout, probe, nproc, global_batch, seq_len)
        if reason is not None:
            chosen.remove(layout)
            skipped.append(layout.name)
            skip_reasons[layout.name] = reason
    del probe
    s = Settings(model=model, optimizer=optimizer, lr=lr or DEFAULT_LR[optimizer], steps=steps,
                 global_batch=global_batch, seq_len=seq_len, seed=seed,
                 units=[c.__name__ for c in unit_classes], optimizer_factory=optimizer_factory,
                 recursive_gather=recursive_gather, resume_fn=resume_fn, engine=engine,
                 after_shard=after_shard)
    references: dict[str, dict] = {}
    results = []
    version, replaced = adapter.version(), []  # as the ranks report them, once one has run
    with RankPool(nproc) as pool:
        for i, layout in enumerate(chosen, start=1):
            result, ran = _check_layout(pool, s, layout, references, bypassed, parent,
                                        recursive_gather, timeout)
            results.append(result)
            if ran is not None:
                version, replaced = ran
            if progress is not None:
                summary = _summary(result)
                summary = summary if len(summary) <= 150 else summary[:147] + "..."
                count = f"[{i}/{len(chosen)}]"  # padded so the names line up past [9/10]
                progress(f"{count:<{2 * len(str(len(chosen))) + 3}} {layout.name:<19} "
                         f"{'PASS' if result.passed else 'FAIL'}  {summary}  "
                         f"({result.seconds:.1f} s)")
    report = CheckReport(model=model if isinstance(model, str) else _qualname(model),
                         engine=engine, engine_version=version, replacements=replaced,
                         nproc=nproc, steps=steps, optimizer=optimizer, lr=s.lr,
                         units=s.units, layouts=results, skipped=skipped,
                         skip_reasons=skip_reasons,
                         bypassed_units=bypassed, recursive_gather=list(recursive_gather or []))
    if json_path:
        report.save_json(json_path)
    if plot_path:
        report.plot(plot_path)
    return report


def _check_layout(pool, s, layout, references: dict, bypassed: list, parent: str,
                  recursive_gather, timeout: float) -> tuple[LayoutResult, tuple | None]:
    """One layout's result and the engine's version and replacements as its ranks report them
    (``None`` when they raised). The ranks' steps (in ``pool``'s ranks, kept between layouts)
    are compared with the one-process reference of the layout's compute dtype (run once, kept
    in ``references``). A layout that raises in ranks that ran another layout before is run
    again in fresh ranks: what an earlier layout left in the processes never fails it."""
    from mfsdp.check.report import compare, noise_report, param_error
    from mfsdp.check.run import run_layout, run_reference
    from mfsdp.launch import LaunchTimeout, RankError

    start = time.perf_counter()
    dtype = layout.compute_dtype
    if dtype not in references:
        references[dtype] = run_reference(s, dtype)
    result = LayoutResult(layout.name, layout.describe(), layout.tolerance, passed=False)
    ran = None
    fresh = pool.fresh
    try:
        try:
            ranks = pool.run(run_layout, args=(s, layout), timeout=timeout)
        except RankError:
            if fresh:
                raise
            ranks = pool.run(run_layout, args=(s, layout), timeout=timeout)  # in fresh ranks
    except (RankError, LaunchTimeout) as exc:
        result.error = _one_line(exc)
        result.reason = f"raised: {result.error}"
    else:
        ran = ranks[0]["engine_version"], ranks[0]["replacements"]
        result.steps, result.reason = compare(layout, references[dtype], ranks[0])
        result.noise_dominated = noise_report(layout, references[dtype], ranks[0])
        result.passed = not result.reason
        result.max_rss_mib = [r["max_rss_mib"] for r in ranks]
        if ranks[0].get("prediction"):
            pred = ranks[0]["prediction"]
            result.prediction = {
                "param": pred["param"], "error": pred["error"],
                "ring_error": pred["ring_error"],
                "measured": param_error(references[dtype], ranks[0], pred["param"])}
        result.tracked_mib = [r["tracked_mib"] for r in ranks]
    if not result.passed and bypassed and not recursive_gather:
        result.reason += (f"; FSDP unit {bypassed[0]} computes without its forward (its "
                          f"parent {parent} reads its weights): pass --recursive-gather "
                          f"{parent} (docs/fused-experts.md)")
    result.seconds = time.perf_counter() - start
    return result, ran


def _fused_parent(model, name: str) -> str:
    """The class name of the nearest ancestor of ``name`` that is not a container."""
    from torch import nn

    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        m = model.get_submodule(".".join(parts[:cut]))
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return type(m).__name__
    return type(model).__name__


def _one_line(exc: BaseException) -> str:
    """A rank's exception (or the timeout) in one line."""
    if getattr(exc, "message", None) is not None:
        first = exc.message.strip().splitlines()[0] if exc.message.strip() else ""
        return f"rank {exc.rank} {exc.exc_type}: {first}"
    return str(exc).splitlines()[0]


def _summary(r: LayoutResult) -> str:
    if r.error is not None:
        return r.reason
    worst = max(r.steps, key=lambda s: max(abs(s.grad_norm_ratio - 1),
                                           abs(s.update_norm_ratio - 1)))
    return (f"grad ratio {worst.grad_norm_ratio:.4f}, update ratio "
            f"{worst.update_norm_ratio:.4f} (step {worst.step})")


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
