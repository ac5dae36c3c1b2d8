"""mfsdp: Megatron-FSDP-style sharded data parallelism on ``torch.distributed``.

The public surface is listed in ``__all__``; everything else is importable but not advertised.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
