"""Megatron-LM's ``torch_dist`` checkpoints (megatron-core ``dist_checkpointing``), read.

What Megatron-LM's ``save_checkpoint`` writes with ``--ckpt-format torch_dist``::

    CKPT/latest_checkpointed_iteration.txt      the latest iteration ("7")
    CKPT/iter_0000007/.metadata                 a torch.distributed.checkpoint
    CKPT/iter_0000007/__0_0.distcp ...
    CKPT/iter_0000007/metadata.json             {"sharded_backend": "torch_dist", ...}

Model keys have no ``model.`` prefix. The transformer layers are stacked: one tensor
``decoder.layers.<name>`` of shape ``[num_layers, ...]`` per parameter name, and the norms carry
Transformer Engine's fused names whether or not Transformer Engine was used:
``decoder.layers.self_attention.linear_qkv.layer_norm_weight`` is layer ``i``'s
``input_layernorm.weight`` and ``decoder.layers.mlp.linear_fc1.layer_norm_weight`` its
``pre_mlp_layernorm.weight``. Everything else maps one to one onto mfsdp's GPT
(``embedding.word_embeddings.weight`` -> ``embedding.weight``, ``decoder.final_layernorm`` ->
``final_layernorm``, the per-group ``linear_qkv`` and ``[gate; up]`` ``linear_fc1`` layouts are
the same). ``*._extra_state`` (Transformer Engine's FP8 metadata) is dropped.

Checked against a checkpoint megatron-core 0.19.2 wrote (``tests/fixtures/megatron_lm``): every
weight equal, and the imported model gives megatron-core's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mfsdp.checkpoint.io import CheckpointError

__all__ = ["FORMAT", "is_megatron_lm", "megatron_lm_to_fsdp", "resolve_megatron_lm"]

FORMAT = "megatron_lm_torch_dist"
TRACKER = "latest_checkpointed_iteration.txt"
_FUSED_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm",
                "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm"}


def resolve_megatron_lm(path: str | Path) -> tuple[Path, int | None] | None:
    """``(iteration directory, iteration)`` of a Megatron-LM checkpoint (root with the tracker, or
    one ``iter_XXXXXXX``), or None when ``path`` is not one."""
    path = Path(path)
    if (path / TRACKER).is_file():
        text = (path / TRACKER).read_text().strip()
        if text == "release":
            return path / "release", None
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointError(f"{path / TRACKER} holds {text!r}, not an iteration") from None
        return path / f"iter_{iteration:07d}", iteration
    if (path / "metadata.json").is_file() and (path / ".metadata").is_file():
        name = path.name
        iteration = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
        return path, iteration
    return None


def is_megatron_lm(path: str | Path) -> bool:
    """Whether ``path`` is a Megatron-LM checkpoint root or iteration directory."""
    return resolve_megatron_lm(path) is not None


def _backend(directory: Path) -> str:
    try:
        return json.loads((directory / "metadata.json").read_text()).get("sharded_backend", "?")
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no metadata.json: not a Megatron-LM distributed "
                              "checkpoint iteration") from None


def _source_key(name: str, keys) -> tuple[str, int | None]:
    """The Megatron-LM key holding mfsdp parameter ``name`` and the layer index into it."""
    if name == "embedding.weight":
        return "embedding.word_embeddings.weight", None
    if name == "position_embedding.weight":
        return "embedding.position_embeddings.weight", None
    if name.startswith("final_layernorm."):
        return "decoder." + name, None
    if name == "output_layer.weight":
        return name, None
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        module, _, field = rest.rpartition(".")
        candidates = [f"decoder.layers.{rest}"]
        if module in _FUSED_NORMS:
            fused = _FUSED_NORMS[module] + "_" + field  # layer_norm_weight / layer_norm_bias
            candidates.insert(0, f"decoder.layers.{fused}")
        for key in candidates:
            if key in keys:
                return key, int(i)
        return candidates[-1], int(i)
    return name, None


def megatron_lm_to_fsdp(src: str | Path, dst: str | Path, model_config: dict) -> Path:
    """A Megatron-LM ``torch_dist`` checkpoint -> mfsdp ``fsdp_dtensor`` (weights; streamed).

    ``model_config`` is the :class:`~mfsdp.models.gpt.GPTConfig` the checkpoint was trained with
    (Megatron-LM keeps its arguments in a pickled ``argparse.Namespace``; name the model with
    ``--model-preset`` or ``--model-config`` instead). Every weight of that model must be in the
    checkpoint with its shape, and every model tensor of the checkpoint must be used.
    """
    from mfsdp.checkpoint.convert import MODEL_CONFIG_FILE, DCPSource, write_streaming
    from mfsdp.models.gpt import GPT, GPTConfig

    found = resolve_megatron_lm(src)
    if found is None:
        raise CheckpointError(f"{src} is not a Megatron-LM checkpoint (no {TRACKER}, no "
                              "metadata.json beside a .metadata)")
    directory, iteration = found
    backend = _backend(directory)
    if backend != "torch_dist":
        raise CheckpointError(f"{directory} is a Megatron-LM {backend!r} checkpoint; mfsdp reads "
                              "Megatron-LM's torch_dist")
    cfg = GPTConfig.from_dict(model_config)
    with torch.device("meta"):
        ref = GPT(cfg).state_dict()
    source = DCPSource(directory)
    keys = set(source.tensors)
    plan: dict[str, tuple[str, int | None]] = {}
    for name, t in ref.items():
        key, layer = _source_key(name, keys)
        if key not in keys:
            raise CheckpointError(f"{directory} has no tensor {key!r} (for {name}); is "
                                  "the model config the one it was trained with?")
        shape = source.tensors[key][0]
        got = tuple(shape[1:]) if layer is not None else tuple(shape)
        if layer is not None and layer >= shape[0]:
            raise CheckpointError(f"{key} stacks {shape[0]} layers; the model config has "
                                  f"{cfg.num_layers}")
        if got != tuple(t.shape):
            raise CheckpointError(f"{key} gives {name} the shape {got}; the model config implies "
                                  f"{tuple(t.shape)}")
        plan[name] = (key, layer)
    used = {k for k, _ in plan.values()}
    unused = sorted(k for k in keys - used if not k.endswith("_extra_state")
                    and not k.startswith(("optimizer.", "rng_state", "common_state")))
    if unused:
        raise CheckpointError(f"{directory} holds {len(unused)} model tensors this config does not "
                              f"have, e.g. {unused[0]!r}")
    stacked: dict[str, torch.Tensor] = {}

    def produce(key: str) -> torch.Tensor:
        source_key, layer = plan[key[len("model."):]]
        if layer is None:
            return source.get(source_key).float()
        if source_key not in stacked:  # one stacked tensor held at a time
            stacked.clear()
            stacked[source_key] = source.get(source_key)
        return stacked[source_key][layer].float().clone()

    specs = {f"model.{n}": (tuple(t.shape), torch.float32) for n, t in ref.items()}
    # keep each stacked tensor's layers together, so it is read once
    order = sorted(specs, key=lambda k: (plan[k[6:]][0], plan[k[6:]][1] or 0))
    specs = {k: specs[k] for k in order}
    return write_streaming(dst, specs, produce, {"extra": {"iteration": iteration or 0}},
                           "fsdp_dtensor", {"source": FORMAT, "backend": backend},
                           {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict(), indent=1)})
