"""Checkpoints: ``fsdp_dtensor`` save/resume/reshard, and conversion to other formats.

See ``docs/checkpointing.md``. Public entry points: :func:`save_checkpoint`,
:func:`load_checkpoint`; conversion in :mod:`mfsdp.checkpoint.convert`.

The package, bottom to top (a module imports only those above it in this list):
``manifest`` (the error type, ``manifest.json``), ``dcp`` (streaming DCP I/O), ``detect``
(recognising a format by what is on disk), ``state`` (a model's state dicts), ``io`` (mfsdp's
``fsdp_dtensor``), one module per other format (``full``, ``hf_format``,
``safetensors_format``, ``megatron_common`` with ``megatron_lm`` and ``megatron_lm_dtensor``,
``upstream``), ``formats`` (the registry of formats: recognisers, loaders, converters to and
from ``fsdp_dtensor``), ``load`` (any format into a model), ``convert`` (the CLI).
"""

from mfsdp.checkpoint.io import save_checkpoint
from mfsdp.checkpoint.load import load_checkpoint
from mfsdp.checkpoint.manifest import FORMAT_VERSION, CheckpointError, read_manifest

__all__ = ["FORMAT_VERSION", "CheckpointError", "save_checkpoint", "load_checkpoint",
           "read_manifest"]
