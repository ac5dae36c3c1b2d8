"""Moved to :mod:`mfsdp.tools.sbatch`; this path works for one release."""

from mfsdp._moved import alias

alias(__name__, ("arguments", "checks", "errors", "presets"))
