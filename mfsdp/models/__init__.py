"""Small models used by the recipes and the tests."""

from mfsdp.models.toy import Block, ToyModel

__all__ = ["Block", "ToyModel"]
