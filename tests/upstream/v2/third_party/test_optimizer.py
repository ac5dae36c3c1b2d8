# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Unit tests for Megatron-FSDP optimizer behavior."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from transformer_engine.pytorch.optimizers import FusedAdam

from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import (
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
)
from megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision import MixedPrecisionPolicy


class TinyModel(nn.Module):
    """Small model with two separately shardable units."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the tiny model."""
        return self.fc2(self.relu(self.fc1(x)))


def _flat_placements() -> Placements:
    return Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])


def test_adam_without_adapter_raises_precision_error(distributed_setup):
    """Raw Adam should fail on mixed-precision FSDP parameters without the adapter."""
    world_size = distributed_setup.world_size
    device = distributed_setup.device
    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(2026)
    model = TinyModel().to(device=device, dtype=torch.bfloat16)
    with fully_shard_context(device=device):
        fully_shard(model.fc1, mesh=mesh, placements=_flat_placements())
        fully_shard(model.fc2, mesh=mesh, placements=_flat_placements())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    x = torch.randn(6, 8, device=device, dtype=torch.bfloat16)
    optimizer.zero_grad(set_to_none=True)
    loss = model(x).sum()
    loss.backward()

    with pytest.raises(RuntimeError, match="dtype"):
        optimizer.step()


def test_fused_adam_adapter_accepts_mismatched_grads(distributed_setup):
    """TE FusedAdam should handle mixed-precision FSDP grads through the adapter."""
    world_size = distributed_setup.world_size
    device = distributed_setup.device

    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(2026)
    model = TinyModel().to(device=device, dtype=torch.bfloat16)
    # These are the defaults, but spell them out so the test clearly exercises
    # mismatched parameter and gradient precision.
    mixed_precision_policy = MixedPrecisionPolicy(
        main_params_dtype=torch.float32, main_grads_dtype=torch.bfloat16
    )
    with fully_shard_context(device=device):
        fully_shard(
            model.fc1,
            mesh=mesh,
            placements=_flat_placements(),
            mixed_precision_policy=mixed_precision_policy,
        )
        fully_shard(
            model.fc2,
            mesh=mesh,
            placements=_flat_placements(),
            mixed_precision_policy=mixed_precision_policy,
        )
    optimizer = FusedAdam(model.parameters(), lr=0.01)
    fully_shard_optimizer(optimizer, precision_aware=True)

    x = torch.randn(6, 8, device=device, dtype=torch.bfloat16)
    optimizer.zero_grad(set_to_none=True)
    loss = model(x).sum()
    loss.backward()

    for parameter in model.parameters():
        assert parameter.grad is not None
        assert parameter.dtype != parameter.grad.dtype

    params_before_step = [parameter.detach().clone() for parameter in model.parameters()]
    optimizer.step()

    assert any(
        not torch.equal(parameter_before, parameter.detach())
        for parameter_before, parameter in zip(params_before_step, model.parameters())
    )
