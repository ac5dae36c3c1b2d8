"""Logging sinks of the trainer: TensorBoard event files."""

from __future__ import annotations


def tensorboard_writer(directory: str | None):
    """A TensorBoard ``SummaryWriter`` for ``--tensorboard-dir`` (None without it)."""
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SystemExit("--tensorboard-dir needs the tensorboard package "
                         "(pip install tensorboard)") from None
    return SummaryWriter(log_dir=directory)
