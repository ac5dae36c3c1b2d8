"""Loading any checkpoint format mfsdp reads into a sharded model: the format is recognised by
what is on disk and read by the loader it declares (``mfsdp.checkpoint.formats``)."""

from __future__ import annotations

import os

from mfsdp.checkpoint import formats

__all__ = ["load_checkpoint"]


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, verify: bool = True) -> dict:
    """Load a checkpoint into ``model`` (and ``optimizer``), whatever layout wrote it.

    ``path`` is an mfsdp checkpoint (or its root), a checkpoint written by upstream
    Megatron-FSDP (``dcp.save`` of its model and optimizer state dicts; see
    ``mfsdp.checkpoint.upstream``) or a Megatron-LM ``torch_dist`` or ``fsdp_dtensor``
    checkpoint (root with ``latest_checkpointed_iteration.txt`` or one ``iter_XXXXXXX``; see
    ``mfsdp.checkpoint.megatron_lm``), recognised by what is on disk: the loader is the one the
    format declares in the registry (``mfsdp.checkpoint.formats``).

    ``verify`` (mfsdp's checkpoints): check every file against the SHA-256 sum its manifest
    records before anything is loaded (the ranks share the reading); a damaged file is named.

    Restores the RNG state that was saved and returns the ``extra`` dict (with ``iteration``
    and ``rng_state``). A collective call.
    """
    return formats.load(path, model, optimizer, verify=verify)
