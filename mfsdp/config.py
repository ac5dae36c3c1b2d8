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
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ShardingStrategy", "MixedPrecisionPolicy", "EngineOptions", "ShardingConfig",
           "CONFIG_ARGUMENTS",
           "resolve_unit_classes", "check_dtype", "DTYPES", "dtype_named"]


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

# The short dtype names of flags and configs (Megatron-LM's --bf16 / --fp16 spellings).
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}


def dtype_named(name: str | None) -> torch.dtype | None:
    """The dtype of a short name in :data:`DTYPES` (``None`` stays ``None``).

    >>> dtype_named("bf16"), dtype_named(None)
    (torch.bfloat16, None)
    """
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_dtype(name: str, value: Any, allow_none: bool = True) -> torch.dtype | None:
    """Return ``value`` if it is a floating-point ``torch.dtype`` (or ``None`` when allowed)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, torch.dtype) or value not in _FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise ValueError(f"{name}={value!r} must be a floating-point torch.dtype ({allowed})")
    return value


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes hold the main weights, accumulate gradients and carry them over the wire.

    Compute happens in the model's own dtype (build the model in ``torch.bfloat16`` for bf16
    compute). Upstream Megatron-FSDP uses the same three fields.

    >>> MixedPrecisionPolicy(main_grads_dtype=torch.float32,
    ...                      grad_comm_dtype=torch.bfloat16)  # doctest: +NORMALIZE_WHITESPACE
    MixedPrecisionPolicy(main_params_dtype=torch.float32,
                         main_grads_dtype=torch.float32,
                         grad_comm_dtype=torch.bfloat16)
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
    disable_bucketing: bool = False  # every parameter in the root unit (no per-module units)
    max_inflight_reduce: int = 2  # reductions in flight before backward waits for the oldest
    # gathered weights (ZeRO-3) and full gradients (ZeRO-2/3) in fixed two-slot pools
    fsdp_double_buffer: bool = False
    # a gradient that finds its double-buffer slot held gets its own storage instead of an error
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    prefetch_depth: int = 1  # units ahead whose all-gather is launched
    preproc_state_dict_for_dcp_ckpt: bool = True  # state_dict() hands out DTensors for DCP
    report_nan_in_param_grad: bool = False  # check reduced gradients for NaN and name them
    use_decoupled_grad: bool = False  # gradients in .decoupled_grad, as upstream's option

    def __post_init__(self) -> None:
        for name, low in (("prefetch_depth", 0), ("max_inflight_reduce", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if self.average_in_collective and self.calculate_per_token_loss:
            raise ValueError("average_in_collective=True divides by the data-parallel size, but "
                             "calculate_per_token_loss=True needs summed gradients (the loss is "
                             "divided by the global token count); pass one or the other")
        if self.fsdp_db_use_persist_buf_on_alloc_fail and not self.fsdp_double_buffer:
            raise ValueError("fsdp_db_use_persist_buf_on_alloc_fail=True is the double buffer's "
                             "fallback; pass fsdp_double_buffer=True (or maxpool_double_buffer="
                             "True) with it, or leave it False")
        if self.param_init_fn is not None and not self.init_model_with_meta_device:
            raise ValueError("param_init_fn is used by meta-device initialisation; pass "
                             "init_model_with_meta_device=True (or initialise the model yourself)")


# Upstream arguments for CUDA-only features: accepted at their default, refused otherwise.
_CUDA_ONLY = {
    "nccl_ub": (False, "NCCL user-buffer registration"),
    "disable_symmetric_registration": (False, "NCCL symmetric (window) registration"),
    "keep_fp8_transpose_cache": (False, "the FP8 transpose cache of TransformerEngine"),
    "enable_fine_grained_param_gather": (False, "per-module all-gathers of MXFP8 parameters"),
    "cuda_graph_mode": (None, "CUDA graph capture of the FSDP hooks"),
}


# Every name ShardingConfig.from_arguments reads: the strategies, the mixed-precision policy and
# its older spellings, the double-buffer layout switches, the CUDA-only switches and the engine
# options. fully_shard_model's other arguments (meshes, groups, device, unit classes) are resolved
# in mfsdp/fsdp/api.py; tests/test_engine_arguments.py checks that the two sets cover its signature.
CONFIG_ARGUMENTS = frozenset({
    "zero_dp_strategy", "outer_dp_sharding_strategy", "mixed_precision_policy",
    "grad_reduce_in_fp32", "preserve_fp32_weights", "maxpool_double_buffer", *_CUDA_ONLY,
    *(f.name for f in dataclasses.fields(EngineOptions)),
})


def not_implemented_reason(name: str) -> str:
    """Why the CUDA-only upstream option ``name`` is refused (the API and ``mfsdp train`` say it
    alike): ``"NCCL user-buffer registration is not implemented by mfsdp (...)"``."""
    return (f"{_CUDA_ONLY[name][1]} is not implemented by mfsdp (it needs CUDA features that "
            "mfsdp does not use)")


@dataclass(frozen=True)
class ShardingConfig:
    """The sharding choices of :func:`mfsdp.fully_shard_model`, parsed and checked together:
    the strategies, the mixed-precision policy and the engine options.

    ``from_arguments`` takes ``fully_shard_model``'s keyword arguments (upstream's names,
    including the older spellings ``grad_reduce_in_fp32`` / ``preserve_fp32_weights``) and
    raises one error naming the argument and the fix::

        >>> ShardingConfig.from_arguments(  # doctest: +NORMALIZE_WHITESPACE
        ...     zero_dp_strategy="no_shard", init_model_with_meta_device=True)
        Traceback (most recent call last):
          ...
        ValueError: init_model_with_meta_device=True needs a sharded strategy, got
        zero_dp_strategy='no_shard': every rank would hold the full model anyway; build
        the model on the device instead
    """

    strategy: ShardingStrategy
    outer_strategy: ShardingStrategy
    mixed_precision_policy: MixedPrecisionPolicy
    options: EngineOptions

    def __post_init__(self) -> None:
        strategy, outer, opts = self.strategy, self.outer_strategy, self.options
        if opts.init_model_with_meta_device and strategy is ShardingStrategy.NO_SHARD:
            raise ValueError("init_model_with_meta_device=True needs a sharded strategy, got "
                             "zero_dp_strategy='no_shard': every rank would hold the full model "
                             "anyway; build the model on the device instead")
        if outer not in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM):
            raise ValueError(f"outer_dp_sharding_strategy={outer.value!r} is not supported "
                             "across the outer dimension; use 'no_shard' (HSDP) or 'optim'")
        if outer is ShardingStrategy.OPTIM and strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
            raise ValueError(f"outer_dp_sharding_strategy='optim' needs "
                             f"zero_dp_strategy='optim_grads_params', got {strategy.value!r}")

    @classmethod
    def from_arguments(cls, **given: Any) -> "ShardingConfig":
        """Parse and check ``fully_shard_model``'s sharding arguments (the names in
        ``CONFIG_ARGUMENTS``); any other name is a ``TypeError``, as Python raises for an
        unknown keyword, so an argument can never be dropped on the way to the engine."""
        unknown = sorted(set(given) - CONFIG_ARGUMENTS)
        if unknown:
            raise TypeError(f"fully_shard_model() got an unexpected keyword argument {unknown[0]!r}")
        for name, (default, _) in _CUDA_ONLY.items():
            value = given.get(name, default)
            if value != default and not (default is None and value in (False, "none")):
                raise ValueError(
                    f"{name}={value!r}: {not_implemented_reason(name)}; leave {name} at "
                    f"{default!r}, or use upstream megatron_fsdp on GPUs for it")
        mixed_precision_policy = given.get("mixed_precision_policy")
        grad_reduce_in_fp32 = given.get("grad_reduce_in_fp32")
        preserve_fp32_weights = given.get("preserve_fp32_weights")
        if grad_reduce_in_fp32 is not None or preserve_fp32_weights is not None:
            if mixed_precision_policy is not None:
                raise ValueError("grad_reduce_in_fp32 / preserve_fp32_weights are the older "
                                 "spelling of mixed_precision_policy; pass one or the other")
            fp32 = torch.float32 if grad_reduce_in_fp32 else None
            mixed_precision_policy = MixedPrecisionPolicy(
                main_params_dtype=torch.float32 if preserve_fp32_weights in (None, True) else None,
                main_grads_dtype=fp32, grad_comm_dtype=fp32)
        if mixed_precision_policy is None:
            mixed_precision_policy = MixedPrecisionPolicy()
        elif not isinstance(mixed_precision_policy, MixedPrecisionPolicy):
            raise TypeError(f"mixed_precision_policy={mixed_precision_policy!r} must be a "
                            "mfsdp.MixedPrecisionPolicy")
        strategy = ShardingStrategy.parse(given.get("zero_dp_strategy", 3))
        outer = ShardingStrategy.parse(given.get("outer_dp_sharding_strategy", 0),
                                       "outer_dp_sharding_strategy")
        options = {f.name: given[f.name] for f in dataclasses.fields(EngineOptions)
                   if f.name in given}
        if given.get("maxpool_double_buffer", False):
            # upstream's max-pooled double buffer: two slots, each sized to the largest unit,
            # which is how mfsdp's double buffers are laid out (mfsdp/fsdp/bucket.py)
            options["fsdp_double_buffer"] = True
        return cls(strategy, outer, mixed_precision_policy, EngineOptions(**options))

    def for_outer_size(self, outer_size: int) -> "ShardingConfig":
        """The same choices once the outer dimension's size is known: sharding over an outer
        dimension of one rank shards nothing, so ``optim`` there is plain FSDP (as upstream)."""
        if self.outer_strategy is ShardingStrategy.OPTIM and outer_size == 1:
            return dataclasses.replace(self, outer_strategy=ShardingStrategy.NO_SHARD)
        return self
