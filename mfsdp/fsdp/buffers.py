"""A read-only view of a sharded model's buffers in upstream Megatron-FSDP's shape.

Code written for upstream reads ``model.param_and_grad_buffer.parameter_groups[i]`` and its
``model_weight_buffer`` / ``main_weight_buffer`` / ``main_grad_buffer`` (each with ``.data``) to
check the dtypes a :class:`mfsdp.MixedPrecisionPolicy` produced. In mfsdp a parameter group is a
bucket (:class:`mfsdp.fsdp.bucket.Bucket`): one unit's parameters of one dtype, expert-ness and
``requires_grad``. The view owns nothing; ``.data`` is this rank's live shard.

>>> import torch
>>> BufferView(torch.zeros(3, dtype=torch.bfloat16)).dtype
torch.bfloat16
"""

from __future__ import annotations

import torch

__all__ = ["BufferView", "ParameterGroupView", "ParamAndGradBufferView"]


class BufferView:
    """One buffer of a parameter group: ``data`` is this rank's shard of it."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def __repr__(self) -> str:
        return f"BufferView({self.data.dtype}, {self.data.numel()} elements on this rank)"


class ParameterGroupView:
    """One bucket seen as upstream's parameter group."""

    def __init__(self, bucket):
        self._bucket = bucket
        self.params = [sp.sharded for sp in bucket.sparams]
        self.param_names = list(bucket.names)
        self.is_expert_param = bucket.is_expert
        self.requires_grad = bucket.requires_grad
        self.dtype = bucket.dtype
        self.model_weight_buffer = BufferView(bucket.model_sub_shard())
        # upstream has no separate main weights when they are the model weights themselves
        self.main_weight_buffer = (None if bucket.main_aliases_model()
                                   else BufferView(bucket.main_shard))
        self.main_grad_buffer = (BufferView(bucket.grad_shard) if bucket.grad_shard is not None
                                 else None)

    def __repr__(self) -> str:
        return (f"ParameterGroupView(unit={self._bucket.unit or '(root)'!r}, "
                f"{len(self.params)} params, {self.dtype})")


class ParamAndGradBufferView:
    """``model.param_and_grad_buffer``: every bucket as a parameter group, in model order."""

    def __init__(self, model):
        self.parameter_groups = [ParameterGroupView(b) for b in model.fsdp_state().buckets]

    def __repr__(self) -> str:
        return f"ParamAndGradBufferView({len(self.parameter_groups)} parameter groups)"
