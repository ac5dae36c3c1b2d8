"""Shared helpers of the multi-rank tests: cached launches and the reference comparison.

Tolerances, and why:

* fp32 + SGD: losses and parameters to rtol 1e-5 (only the summation order of the gradient
  reduction differs; measured differences are ~1e-7 relative).
* fp32 + AdamW: the *update* (final minus initial parameters) of every parameter to 1e-3 relative
  L2 error, and every element to 5e-4 absolute (10% of one Adam step: with lr 5e-3 each step moves
  an element by about lr whatever its gradient's size). Adam divides by sqrt(v), so
  reduction-order noise in near-zero gradients is amplified: measured 3e-6 relative (2e-7
  absolute) for the dense models and 2.2e-4 relative (1.3e-4 absolute, one element of 2048) for an
  MoE expert that few tokens reach, where SGD on the same run agrees to 1.5e-8.
* bf16 compute with fp32 main weights: bf16 keeps 8 significant bits, so each rank's gradient
  differs from the whole-batch gradient by up to 2**-8 relative before reduction. We compare the
  *update* (final minus initial parameters): its relative L2 error must stay below 5% for SGD
  (measured ~1%) and 25% for AdamW, whose per-element step ``lr * m / sqrt(v)`` has magnitude ~lr
  whatever the gradient's size, so rounding flips of tiny gradients move whole steps. Losses agree
  to 2e-3 relative (measured ~6e-4).
"""

from __future__ import annotations

import functools

import torch

from mfsdp.launch import launch
from mfsdp.testing import initial_parameters, train_reference, train_sharded_many


@functools.lru_cache(maxsize=None)
def _sharded(world_size: int, cfgs: tuple) -> list[dict]:
    return launch(train_sharded_many, world_size, args=([_thaw(c) for c in cfgs],), timeout=600)[0]


def _freeze(cfg: dict) -> tuple:
    return tuple(sorted((k, v if not isinstance(v, dict) else tuple(sorted(v.items())))
                        for k, v in cfg.items()))


def _thaw(cfg: tuple) -> dict:
    return {k: dict(v) if k in ("model_kwargs", "fsdp_kwargs") else v for k, v in cfg}


def run_sharded(world_size: int, cfg: dict, batch: list[dict]) -> dict:
    """Run ``cfg`` on ``world_size`` ranks, launching every config of ``batch`` at once (cached)."""
    key = tuple(_freeze(c) for c in batch)
    results = _sharded(world_size, tuple(tuple(c) for c in key))
    return results[key.index(_freeze(cfg))]


def _update_error(p: torch.Tensor, p_ref: torch.Tensor, init: torch.Tensor) -> float:
    """Relative L2 error of an update (final minus initial parameters) against the reference's;
    a parameter the reference never moved (frozen) must not move either."""
    d_ref, d = p_ref - init, p - init
    return ((d - d_ref).norm() / d_ref.norm().clamp_min(1e-30)).item()


def assert_matches_reference(cfg: dict, world_size: int, shard: dict) -> None:
    ref = train_reference(cfg, world_size)
    losses_ref, losses = torch.tensor(ref["losses"]), torch.tensor(shard["losses"])
    if cfg.get("dtype") == "bf16":
        torch.testing.assert_close(losses, losses_ref, rtol=2e-3, atol=0)
        init = initial_parameters(cfg)
        tol = 0.25 if cfg.get("optimizer") == "adamw" else 0.05
        for name, p_ref in ref["params"].items():
            err = _update_error(shard["params"][name], p_ref, init[name])
            assert err < tol, f"{name}: update differs by {err:.3f} (relative L2) > {tol}"
        return
    torch.testing.assert_close(losses, losses_ref, rtol=1e-5, atol=0)
    adam = cfg.get("optimizer") == "adamw"
    init = initial_parameters(cfg) if adam else None
    for name, p_ref in ref["params"].items():
        if adam:
            err = _update_error(shard["params"][name], p_ref, init[name])
            assert err < 1e-3, f"{name}: update differs by {err:.2e} (relative L2) > 1e-3"
        torch.testing.assert_close(shard["params"][name], p_ref, rtol=0 if adam else 1e-5,
                                   atol=5e-4 if adam else 1e-6, msg=lambda m: f"{name}: {m}")
