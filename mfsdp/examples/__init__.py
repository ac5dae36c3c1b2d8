"""Runnable examples: ``torchrun --nproc-per-node 2 -m mfsdp.examples`` runs the quickstart
(:mod:`mfsdp.examples.quickstart`)."""

from mfsdp.examples.quickstart import quickstart_train

__all__ = ["quickstart_train"]
