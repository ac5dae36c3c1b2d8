"""The ``safetensors`` format: ``model.safetensors`` (weights by mfsdp name, no optimizer) and
``config.json``, to and from ``fsdp_dtensor``; SwiGLU's fused gate/up projections split or joined.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE, read_full, write_full
from mfsdp.checkpoint.full import check_format
from mfsdp.checkpoint.manifest import CheckpointError
from mfsdp.checkpoint.safetensors import load_file, save_file


__all__ = ['split_swiglu', 'join_swiglu', 'fsdp_to_safetensors', 'safetensors_to_fsdp']


def split_swiglu(weights: dict[str, torch.Tensor],
                 pattern: str | tuple[str, ...] = ("fc1", "linear_fc1")) -> dict[str, torch.Tensor]:
    """Split fused gate/up weights ``<p>.<pattern>.<w>`` into ``<p>.gate_proj.<w>``, ``<p>.up_proj.<w>``.

    ``pattern``: the fused module's name or names (the toy models' ``fc1``, the trainer's and
    Megatron-LM's ``linear_fc1``).

    >>> halves = split_swiglu({"mlp.fc1.weight": torch.arange(4.0).view(4, 1)})
    >>> halves["mlp.up_proj.weight"].ravel()
    tensor([2., 3.])
    """
    out = {}
    for name, t in weights.items():
        prefix, _, leaf = name.rpartition(".")
        head, _, module = prefix.rpartition(".")
        if module in ((pattern,) if isinstance(pattern, str) else pattern):
            if t.shape[0] % 2:
                raise ValueError(f"{name} has {t.shape[0]} rows; a fused gate/up weight has an "
                                 "even number (gate rows, then up rows)")
            gate, up = t.chunk(2, dim=0)
            base = f"{head}." if head else ""
            out[f"{base}gate_proj.{leaf}"], out[f"{base}up_proj.{leaf}"] = gate.clone(), up.clone()
        else:
            out[name] = t
    return out


def join_swiglu(weights: dict[str, torch.Tensor], pattern: str = "fc1") -> dict[str, torch.Tensor]:
    """The inverse of :func:`mfsdp.checkpoint.safetensors_format.split_swiglu`."""
    out = {}
    for name, t in weights.items():
        prefix, _, leaf = name.rpartition(".")
        head, _, module = prefix.rpartition(".")
        base = f"{head}." if head else ""
        if module == "gate_proj":
            up = weights.get(f"{base}up_proj.{leaf}")
            if up is None:
                raise ValueError(f"{name} has no matching {base}up_proj.{leaf}")
            out[f"{base}{pattern}.{leaf}"] = torch.cat([t, up], dim=0)
        elif module != "up_proj":
            out[name] = t
    return out


def fsdp_to_safetensors(src: str | Path, dst: str | Path, swiglu: bool = False,
                        dtype: torch.dtype | None = None, config: dict | None = None) -> Path:
    """``fsdp_dtensor`` -> a Hugging Face style folder (``model.safetensors``, ``config.json``)."""
    src, dst = Path(src), Path(dst)
    tensors, _, manifest = read_full(src)
    check_format(manifest, "fsdp_dtensor", src)
    weights = {k[len("model."):]: (v.to(dtype) if dtype else v) for k, v in tensors.items()
               if k.startswith("model.")}
    fused_name = None
    saved = src / MODEL_CONFIG_FILE
    if swiglu and saved.exists() and not json.loads(saved.read_text()).get("swiglu"):
        raise CheckpointError(f"--swiglu: the model of {src} has no fused gate/up weight (its "
                              f"{MODEL_CONFIG_FILE} says swiglu is false: GELU MLPs); leave "
                              "--swiglu out")
    if swiglu:
        fused = {n.rpartition(".")[0].rpartition(".")[2] for n in weights} & {"fc1", "linear_fc1"}
        if not fused:
            raise CheckpointError(f"--swiglu: {src} has no fused gate/up weight (a module named "
                                  "fc1 or linear_fc1); leave --swiglu out, or use --to hf for "
                                  "the trainer's models")
        if len(fused) > 1:
            raise CheckpointError(f"--swiglu: {src} has fused weights named both fc1 and "
                                  "linear_fc1; cannot tell which to split")
        fused_name = fused.pop()
        weights = split_swiglu(weights, fused_name)
    dst.mkdir(parents=True, exist_ok=False)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = dict(config or {})
    cfg["mfsdp"] = {"source": str(src.name), "swiglu": bool(fused_name),
                    "swiglu_module": fused_name, "layout": manifest.get("layout")}
    (dst / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    return dst


def safetensors_to_fsdp(src: str | Path, dst: str | Path, swiglu: bool | None = None) -> Path:
    """A safetensors folder -> ``fsdp_dtensor`` (weights only; optimizer state starts fresh)."""
    src = Path(src)
    weights, _ = load_file(src / "model.safetensors")
    cfg_path = src / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if swiglu is None:
        swiglu = bool(cfg.get("mfsdp", {}).get("swiglu", False))
    if swiglu:
        weights = join_swiglu(weights, cfg.get("mfsdp", {}).get("swiglu_module") or "fc1")
    tensors = {f"model.{k}": v.float() if v.is_floating_point() else v for k, v in weights.items()}
    return write_full(dst, tensors, {"extra": {"iteration": 0}}, "fsdp_dtensor",
                      (cfg.get("mfsdp") or {}).get("layout"))
