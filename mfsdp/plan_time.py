"""Moved to :mod:`mfsdp.tools.plan_time`; this path works for one release."""

from mfsdp._moved import alias

alias(__name__)
