"""``save_checkpoint`` / ``load_checkpoint`` for the per-module API: placeholder, see below."""

from __future__ import annotations

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(model, optimizer, checkpoint_dir) -> None:
    """Not built yet."""
    raise NotImplementedError("mfsdp.experimental.save_checkpoint is not built yet")


def load_checkpoint(model, optimizer, checkpoint_dir, *, sync_model_weights: bool = True) -> None:
    """Not built yet."""
    raise NotImplementedError("mfsdp.experimental.load_checkpoint is not built yet")
