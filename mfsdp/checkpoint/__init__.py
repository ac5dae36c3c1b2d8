"""Checkpoints: ``fsdp_dtensor`` save/resume/reshard, and conversion to other formats.

See ``docs/checkpointing.md``. Public entry points: :func:`save_checkpoint`,
:func:`load_checkpoint`; conversion in :mod:`mfsdp.checkpoint.convert`.
"""

from mfsdp.checkpoint.io import (
    FORMAT_VERSION,
    CheckpointError,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)

__all__ = ["FORMAT_VERSION", "CheckpointError", "save_checkpoint", "load_checkpoint",
           "read_manifest"]
