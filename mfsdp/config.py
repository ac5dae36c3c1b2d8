"""Configuration dataclasses and enums. Every check of user input lives here.

Errors name the argument, the value that was given, and what to do instead, e.g.::

    >>> ShardingStrategy.parse("zero4")
    Traceback (most recent call last):
      ...
    ValueError: zero_dp_strategy='zero4' is not a sharding strategy; use one of 0, 1, 2, 3 or 'no_shard', 'optim', 'optim_grads', 'optim_grads_params'
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ShardingStrategy", "MixedPrecisionPolicy", "EngineOptions", "resolve_unit_classes",
           "check_dtype"]


class ShardingStrategy(str, enum.Enum):
    """What is sharded over the data-parallel shard group (ZeRO stage in parentheses).

    ======================  ==============  ==========================  ===========================
    strategy                model weights   main weights + optim state  gradients
    ======================  ==============  ==========================  ===========================
    ``no_shard`` (0)        replicated      replicated                  replicated (all-reduce)
    ``optim`` (1)           replicated      sharded                     replicated, reduce-scattered
    ``optim_grads`` (2)     replicated      sharded                     sharded
    ``optim_grads_params``  sharded         sharded                     sharded
    (3)
    ======================  ==============  ==========================  ===========================
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage number (0-3) of this strategy."""
        return list(ShardingStrategy).index(self)

    @property
    def shards_grads(self) -> bool:
        """Whether the full gradient buffer is released after its reduce-scatter."""
        return self in (ShardingStrategy.OPTIM_GRADS, ShardingStrategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self) -> bool:
        """Whether model weights are sharded and gathered per unit (ZeRO-3)."""
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS

    @classmethod
    def parse(cls, value: Any, name: str = "zero_dp_strategy") -> "ShardingStrategy":
        """Accept a :class:`ShardingStrategy`, its name, or the ZeRO stage 0-3."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
            return list(cls)[value]
        if isinstance(value, str):
            for member in cls:
                if value == member.value:
                    return member
        raise ValueError(
            f"{name}={value!r} is not a sharding strategy; use one of 0, 1, 2, 3 or "
            + ", ".join(repr(m.value) for m in cls)
        )


_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_dtype(name: str, value: Any, allow_none: bool = True) -> torch.dtype | None:
    """Return ``value`` if it is a floating-point ``torch.dtype`` (or ``None`` when allowed)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, torch.dtype) or value not in _FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise ValueError(f"{name}={value!r} must be a floating-point torch.dtype ({allowed})")
    return value


@dataclass
class MixedPrecisionPolicy:
    """Which dtypes hold the main weights, accumulate gradients and carry them over the wire.

    Compute happens in the model's own dtype (build the model in ``torch.bfloat16`` for bf16
    compute). Upstream Megatron-FSDP uses the same three fields.

    >>> MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=torch.bfloat16)
    MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32, grad_comm_dtype=torch.bfloat16)
    """

    main_params_dtype: torch.dtype | None = torch.float32
    """dtype of the main weights the optimizer steps on; ``None`` keeps the model's dtype."""
    main_grads_dtype: torch.dtype | None = None
    """dtype gradients accumulate in (over micro-batches); ``None`` means the model's dtype."""
    grad_comm_dtype: torch.dtype | None = None
    """dtype of the gradient reduce-scatter / all-reduce; ``None`` means ``main_grads_dtype``."""

    def __post_init__(self) -> None:
        check_dtype("main_params_dtype", self.main_params_dtype)
        check_dtype("main_grads_dtype", self.main_grads_dtype)
        check_dtype("grad_comm_dtype", self.grad_comm_dtype)

    def resolve(self, param_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """Return (main weights, main grads, grad communication) dtypes for a parameter dtype."""
        main = self.main_params_dtype or param_dtype
        grads = self.main_grads_dtype or param_dtype
        return main, grads, self.grad_comm_dtype or grads


def resolve_unit_classes(units: Any, model: torch.nn.Module | None = None) -> tuple[type, ...]:
    """Turn ``fsdp_unit_modules`` (classes or dotted import strings) into a tuple of classes.

    A string may also name a class by its bare name when ``model`` contains a module of that class.
    """
    if units is None:
        return ()
    if isinstance(units, (type, str)):
        units = [units]
    out = []
    for i, unit in enumerate(units):
        if isinstance(unit, type) and issubclass(unit, torch.nn.Module):
            out.append(unit)
            continue
        if not isinstance(unit, str):
            raise TypeError(f"fsdp_unit_modules[{i}]={unit!r} must be an nn.Module subclass or "
                            "a dotted import string such as 'my_pkg.model.TransformerBlock'")
        cls = None
        if "." in unit:
            module_name, _, attr = unit.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"fsdp_unit_modules[{i}]={unit!r} cannot be imported: {exc}") from exc
        elif model is not None:
            matches = {type(m) for m in model.modules() if type(m).__name__ == unit}
            cls = matches.pop() if len(matches) == 1 else None
        if cls is None:
            raise ValueError(f"fsdp_unit_modules[{i}]={unit!r} names no class; give the class "
                             "itself or its full dotted path")
        out.append(cls)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How a sharded model runs: the engine-side options of :func:`mfsdp.fully_shard_model`,
    gathered once and handed to :class:`mfsdp.FullyShardedModule` (upstream's names)."""

    init_model_with_meta_device: bool = False  # parameters on meta, materialised unit by unit
    param_init_fn: Any = None  # called on each module to initialise meta parameters
    overlap_grad_reduce: bool = True  # reduce-scatter per bucket during backward
    overlap_param_gather: bool = True  # prefetch the next unit's all-gather (ZeRO-3)
    sync_model_each_microbatch: bool = True  # reduce every backward (no_sync() defers)
    average_in_collective: bool = False  # average inside the collective, not by a pre-scale
    calculate_per_token_loss: bool = False  # gradients summed, the loss divides by tokens
    disable_bucketing: bool = False  # one bucket per parameter
    max_inflight_reduce: int = 2  # reductions in flight before backward waits for the oldest
    fsdp_double_buffer: bool = False  # gathered weights in a fixed two-slot pool (ZeRO-3)
    prefetch_depth: int = 1  # units ahead whose all-gather is launched
    preproc_state_dict_for_dcp_ckpt: bool = True  # state_dict() hands out DTensors for DCP
    report_nan_in_param_grad: bool = False  # check reduced gradients for NaN and name them
    use_decoupled_grad: bool = False  # gradients in .decoupled_grad, as upstream's option
