"""The error of ``mfsdp sbatch``: a bad preset, key or value, said in one line."""

from __future__ import annotations


class RenderError(ValueError):
    """Bad render input: the message names the preset or key and what to do."""
