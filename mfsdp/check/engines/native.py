"""``--engine mfsdp``: the sharded side run by this package's ``mfsdp.fully_shard`` (every
layout of :data:`~mfsdp.check.layouts.LAYOUTS`, TP, CP and EP included)."""

from __future__ import annotations

import torch

from mfsdp.check.engines import Engine, Sharded, strip_name

__all__ = ["MfsdpEngine"]


class MfsdpEngine(Engine):
    """mfsdp's own ``fully_shard`` (the default engine)."""

    name = "mfsdp"
    title = "mfsdp"

    def version(self) -> str:
        """``mfsdp.__version__``."""
        import mfsdp

        return f"mfsdp {mfsdp.__version__}"

    def refuses(self, layout) -> str | None:
        """``None``: every layout is mfsdp's (the model's own limits are checked elsewhere)."""
        return None

    def shard(self, s: dict, layout, strategy: str) -> Sharded:
        """``mfsdp.fully_shard(model, optimizer, ...)`` with the layout's arguments."""
        from mfsdp.check.run import _sharded

        return Sharded(*_sharded(s, layout, strategy))

    def grad_norm(self, sh: Sharded, full: dict[str, torch.Tensor] | None = None) -> float:
        """The sharded optimizer's own ``grad_norm()`` (``full`` is not needed)."""
        return sh.optimizer.grad_norm()

    def full_gradients(self, sh: Sharded) -> dict[str, torch.Tensor]:
        """Each parameter's reduced gradient (a DTensor over the shard group) gathered; empty
        under TP, CP or EP (their gradients are split by the model too)."""
        if sh.par is not None:
            return {}
        sh.model.finish_grad_sync()
        return {strip_name(n): p.grad.full_tensor() for n, p in sh.model.named_parameters()
                if p.grad is not None}

    def full_parameters(self, sh: Sharded) -> dict[str, torch.Tensor]:
        """``full_parameters()``: the fp32 main weights gathered."""
        if sh.par is not None:
            return sh.par.full_parameters(sh.model)
        return {strip_name(n): p for n, p in sh.model.full_parameters().items()}

    def state_bytes(self, sh: Sharded) -> int:
        """The model's sharded buffers plus the optimizer's local state."""
        return (sum(sh.model.fsdp_state().memory_by_kind().values())
                + sh.optimizer.local_state_bytes())
