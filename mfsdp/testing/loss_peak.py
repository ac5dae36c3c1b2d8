"""The loss's bytes at a training step's peak, measured: one real step of the trainer's model.

:func:`measured_step` builds a preset with ``mfsdp train``'s flags and model builder on the
ranks of the current (gloo) process group, runs one step as the trainer does (forward, the
trainer's loss, backward, optimizer step) inside :class:`LiveBytes`, and returns the peak of the
bytes its live tensor storages held and what was live at that peak, by the phase that allocated
it. The planner's ``logits`` term (:func:`mfsdp.tools.plan_terms.logits`) is checked against it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "measured_step"]

PHASES = ("build", "forward", "loss", "loss backward", "backward", "optimizer")


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage an operator creates while it is active, until
    the storage is freed (a weak reference's callback), as PyTorch's ``MemTracker`` does; keeps
    the peak and, at the peak, the live bytes by the ``phase`` that allocated them; and the same
    for the peak within each phase (``phase_peaks``: phase -> (bytes, live bytes by phase))."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "build"
        self.live: dict[int, tuple[int, str]] = {}  # storage key -> (bytes, phase)
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.peak_phase = ""
        self.at_peak: dict[str, int] = {}
        self.phase_peaks: dict[str, tuple[int, dict[str, int]]] = {}

    def _forget(self, key: int) -> None:
        nbytes, _ = self.live.pop(key, (0, ""))
        self._refs.pop(key, None)
        self.current -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live or st.nbytes() == 0 or t.device.type == "meta":
            return
        self.live[key] = (st.nbytes(), self.phase)
        self._refs[key] = weakref.ref(st, lambda _, k=key: self._forget(k))
        self.current += st.nbytes()
        if self.current > self.phase_peaks.get(self.phase, (0, None))[0]:
            by_phase: dict[str, int] = {}
            for nbytes, phase in self.live.values():
                by_phase[phase] = by_phase.get(phase, 0) + nbytes
            self.phase_peaks[self.phase] = (self.current, by_phase)
            if self.current > self.peak:
                self.peak, self.peak_phase, self.at_peak = self.current, self.phase, by_phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def measured_step(preset: str, layout_kwargs: dict, model_flags: tuple[str, ...] = ()) -> dict:
    """On every rank: ``{"peak": bytes, "peak_phase": str, "at_peak": {phase: bytes},
    "phase_peaks": {phase: (bytes, {phase: bytes})}, "vocab": int, "tokens": int}`` of one training step of ``preset`` (``model_flags``: more
    ``mfsdp train`` flags, e.g. ``("--hidden-size", "256")``) under ``layout_kwargs``
    (:class:`~mfsdp.tools.plan.Layout`'s fields), with the trainer's loss
    (:func:`mfsdp.models.tensor_parallel.vocab_parallel_cross_entropy`). ``tokens``: this
    rank's fed tokens, ``s b``; ``vocab``: the output layer's columns on this rank."""
    import torch.distributed as dist

    from mfsdp.models.tensor_parallel import loss_parallel_context, vocab_parallel_cross_entropy
    from mfsdp.tools.dry_run import _validated_config, train_flags
    from mfsdp.tools.plan import Layout
    from mfsdp.trainer.parallel import build_sharded_model, micro_batch

    world = dist.get_world_size()
    layout = Layout(world_size=world, **layout_kwargs)
    flags = train_flags(preset, layout, meta_init=False) + list(model_flags)
    config, cfg = _validated_config(flags, world)
    torch.manual_seed(0)
    with LiveBytes() as live:
        model, _, opt, par = build_sharded_model(config, cfg, world, torch.device("cpu"),
                                                 log=lambda *a, **k: None)
        samples = [torch.randint(0, cfg.vocab_size, (layout.seq_length,))
                   for _ in range(layout.micro_batch)]
        batch = micro_batch(samples, par, torch.device("cpu"))
        live.phase = "forward"
        logits = model(batch.tokens, batch.cu_seqlens)
        live.phase = "loss"
        loss = vocab_parallel_cross_entropy(logits, batch.targets, batch.valid)

        def layers_start(grad):  # the logits' gradient: the loss's backward is done
            live.phase = "backward"
        logits.register_hook(layers_start)
        del logits  # the trainer's frame returns the loss alone
        live.phase = "loss backward"
        with loss_parallel_context(layout.tp):
            loss.backward()
        live.phase = "optimizer"
        opt.step()
    return {"peak": live.peak, "peak_phase": live.peak_phase, "at_peak": live.at_peak,
            "phase_peaks": live.phase_peaks,
            "vocab": cfg.vocab_size // layout.tp, "tokens": int(batch.tokens.numel())}
