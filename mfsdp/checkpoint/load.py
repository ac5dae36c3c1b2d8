"""Loading any checkpoint format mfsdp reads into a sharded model: the format is recognised by
what is on disk (:mod:`mfsdp.checkpoint.detect`), then the format's own module reads it."""

from __future__ import annotations

import os

from mfsdp.checkpoint.detect import describe_unreadable, is_megatron_fsdp, is_megatron_lm
from mfsdp.checkpoint.io import load_fsdp_dtensor
from mfsdp.checkpoint.manifest import CheckpointError
from mfsdp.checkpoint.megatron_lm import load_megatron_lm
from mfsdp.checkpoint.upstream import load_megatron_fsdp

__all__ = ["load_checkpoint"]


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, verify: bool = True) -> dict:
    """Load a checkpoint into ``model`` (and ``optimizer``), whatever layout wrote it.

    ``path`` is an mfsdp checkpoint (or its root), a checkpoint written by upstream
    Megatron-FSDP (``dcp.save`` of its model and optimizer state dicts; see
    ``mfsdp.checkpoint.upstream``) or a Megatron-LM ``torch_dist`` or ``fsdp_dtensor``
    checkpoint (root with ``latest_checkpointed_iteration.txt`` or one ``iter_XXXXXXX``; see
    ``mfsdp.checkpoint.megatron_lm``), recognised by what is on disk.

    ``verify`` (mfsdp's checkpoints): check every file against the SHA-256 sum its manifest
    records before anything is loaded (the ranks share the reading); a damaged file is named.

    Restores the RNG state that was saved and returns the ``extra`` dict (with ``iteration``
    and ``rng_state``). A collective call.
    """
    if is_megatron_fsdp(path):  # upstream Megatron-FSDP's README checkpoint
        return load_megatron_fsdp(path, model, optimizer)
    if is_megatron_lm(path):  # Megatron-LM's own (tracker, iter_XXXXXXX, metadata.json)
        return load_megatron_lm(path, model, optimizer)
    unreadable = describe_unreadable(path)
    if unreadable:
        raise CheckpointError(unreadable)
    return load_fsdp_dtensor(path, model, optimizer, verify=verify)
