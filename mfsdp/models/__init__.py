"""Models: the transformer families of :mod:`mfsdp.models.gpt` (GPT-2-like, Llama / Qwen dense,
Mixtral / Qwen-MoE, DeepSeek-V3), their Hugging Face mapping (:mod:`mfsdp.models.hf`), and the
small residual MLPs the recipes and tests use."""

from mfsdp.models.toy import Block, ToyModel

__all__ = ["Block", "ToyModel"]
