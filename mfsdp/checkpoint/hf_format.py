"""Hugging Face model directories (``config.json`` and safetensors, sharded with an index for
large models) to and from ``fsdp_dtensor``, streaming: one tensor (and the few it is made of) in
memory at a time. The model families are those of :mod:`mfsdp.models.hf`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
import shutil
from pathlib import Path

import torch

from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE, DCPSource, Progress, tensor_nbytes, write_streaming
from mfsdp.checkpoint.full import check_format
from mfsdp.checkpoint.safetensors import SafetensorsReader, write_sharded
from mfsdp.models.gpt import GPT
from mfsdp.models.hf import (config_from_hf, config_to_hf, hf_state_dict, hf_to_ours, ours_to_hf,
                             read_hf_config, weight_rules)
from mfsdp.checkpoint.manifest import CheckpointError, read_manifest, resolve_checkpoint


__all__ = ['hf_to_fsdp', 'fsdp_to_hf', "load_hf", "save_hf"]


def hf_to_fsdp(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
    """A Hugging Face model directory -> ``fsdp_dtensor`` (fp32 main weights, no optimizer state).

    Streams: each mfsdp tensor is built from its Hugging Face tensors when the writer reaches it.
    The checkpoint also holds ``model_config.json`` (the model's
    :class:`~mfsdp.models.gpt.GPTConfig`).
    """
    from mfsdp.checkpoint.safetensors import SafetensorsReader
    from mfsdp.models.gpt import GPT
    from mfsdp.models.hf import config_from_hf, hf_to_ours, read_hf_config, weight_rules

    src = Path(src)
    hf = read_hf_config(src)
    cfg = config_from_hf(hf)
    reader = SafetensorsReader(src)
    with torch.device("meta"):
        ref = GPT(cfg).state_dict()
    rules = {f"model.{r.ours}": r for r in weight_rules(cfg, hf["model_type"])}
    used = set()
    for key, rule in rules.items():
        missing = [n for n in rule.hf if n not in reader]
        if missing:
            raise CheckpointError(f"{src} has no tensor {missing[0]!r} (needed for {rule.ours})")
        used.update(rule.hf)
    if cfg.share_embeddings_and_output_weights:
        used.add("lm_head.weight")
    extra = sorted(set(reader.keys()) - used)
    if extra:
        raise CheckpointError(f"{src} holds {len(extra)} tensors a {hf['model_type']} model of "
                              f"this config does not have, e.g. {extra[0]!r}")
    specs = {key: (tuple(ref[r.ours].shape), torch.float32) for key, r in rules.items()}
    bar = Progress(f"import {src.name}", sum(tensor_nbytes(*v) for v in specs.values()), progress)

    def produce(key: str) -> torch.Tensor:
        rule = rules[key]
        t = hf_to_ours(rule, [reader.get(n) for n in rule.hf], cfg).float()
        if tuple(t.shape) != specs[key][0]:
            raise CheckpointError(f"{rule.hf[0]} makes {rule.ours} of shape {tuple(t.shape)}; "
                                  f"config.json implies {specs[key][0]}")
        bar(t.numel() * 4)
        return t

    files = {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict(), indent=1),
             "hf_config.json": json.dumps(hf, indent=1)}
    return write_streaming(dst, specs, produce, {"extra": {"iteration": 0}}, "fsdp_dtensor",
                           {"source": "hf", "model_type": hf["model_type"]}, files)


def fsdp_to_hf(src: str | Path, dst: str | Path, dtype: torch.dtype | None = None,
               max_shard_bytes: int = 5 * 2**30, model_config: dict | None = None,
               progress: bool = True) -> Path:
    """``fsdp_dtensor`` -> a Hugging Face model directory (``config.json`` + safetensors).

    Streams: each Hugging Face tensor is cut from its mfsdp tensor as the writer reaches it, the
    last mfsdp tensor read is kept for its siblings (q/k/v, gate/up). ``model_config`` (a
    :class:`~mfsdp.models.gpt.GPTConfig` dict) is needed when the checkpoint has no
    ``model_config.json``.
    """
    from mfsdp.checkpoint.safetensors import write_sharded
    from mfsdp.models.gpt import GPTConfig
    from mfsdp.models.hf import config_to_hf, hf_model_type, ours_to_hf, weight_rules


    src, dst = resolve_checkpoint(src), Path(dst)
    manifest = read_manifest(src)
    check_format(manifest, "fsdp_dtensor", src)
    if model_config is None:
        f = src / MODEL_CONFIG_FILE
        if not f.exists():
            raise CheckpointError(f"{src} has no {MODEL_CONFIG_FILE} (checkpoints of mfsdp train "
                                  "and of --from hf have one); pass --model-preset NAME or "
                                  "--model-config FILE naming the model's configuration")
        model_config = json.loads(f.read_text())
    cfg = GPTConfig.from_dict(model_config)
    mt = hf_model_type(cfg)
    source = DCPSource(src)
    rules = weight_rules(cfg, mt)
    for r in rules:
        if f"model.{r.ours}" not in source.tensors:
            raise CheckpointError(f"{src} has no tensor 'model.{r.ours}' that a {mt} export needs "
                                  "(was it written for another model configuration?)")
    out_dtype = {}
    specs, origin = {}, {}
    for r in rules:
        shape, sdtype = source.tensors[f"model.{r.ours}"]
        parts = ours_to_hf(r, torch.empty(shape, device="meta"), cfg)
        for name, t in zip(r.hf, parts):
            out_dtype[name] = dtype or sdtype
            specs[name] = (tuple(t.shape), out_dtype[name])
            origin[name] = r
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; choose a new output directory")
    tmp = dst.parent / f".tmp-{dst.name}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    bar = Progress(f"export {dst.name}", sum(tensor_nbytes(*v) for v in specs.values()), progress)
    cache: dict[str, list[torch.Tensor]] = {}

    def stream():
        for name in specs:
            r = origin[name]
            if r.ours not in cache:
                cache.clear()  # one mfsdp tensor (and its pieces) at a time
                cache[r.ours] = ours_to_hf(r, source.get(f"model.{r.ours}"), cfg)
            t = cache[r.ours][r.hf.index(name)]
            yield name, t.to(out_dtype[name]).contiguous()

    try:
        write_sharded(stream(), specs, tmp, max_shard_bytes,
                      progress=lambda name, t: bar(t.numel() * t.element_size()))
        hf = config_to_hf(cfg, dtype or torch.float32)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"_from_model_config": True}))
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def load_hf(path, cfg_overrides: dict | None = None) -> GPT:
    """A :class:`~mfsdp.models.gpt.GPT` with the weights of a Hugging Face model directory.

    Every tensor of the directory must be used and every weight of the model found (an error
    names the first that is not). ``cfg_overrides`` changes options that do not alter the
    weights' meaning (dispatcher, fused experts...).
    """
    hf = read_hf_config(path)
    cfg = replace(config_from_hf(hf), **(cfg_overrides or {}))
    reader = SafetensorsReader(path)
    model = GPT(cfg)
    state = model.state_dict()
    used = set()
    for rule in weight_rules(cfg, hf["model_type"]):
        missing = [n for n in rule.hf if n not in reader]
        if missing:
            raise KeyError(f"{path} has no tensor {missing[0]!r} (needed for {rule.ours})")
        t = hf_to_ours(rule, [reader.get(n) for n in rule.hf], cfg)
        if tuple(t.shape) != tuple(state[rule.ours].shape):
            raise ValueError(f"{rule.hf[0]} gives {rule.ours} the shape {tuple(t.shape)}; the model "
                             f"from config.json has {tuple(state[rule.ours].shape)}")
        with torch.no_grad():
            state[rule.ours].copy_(t)
        used.update(rule.hf)
    extra = sorted(set(reader.keys()) - used - {"lm_head.weight"} if
                   cfg.share_embeddings_and_output_weights else set(reader.keys()) - used)
    if extra:
        raise KeyError(f"{path} holds {len(extra)} tensors the model does not use, e.g. "
                       f"{extra[0]!r} (a model_type mfsdp maps differently?)")
    return model


def save_hf(model: torch.nn.Module, path, dtype: torch.dtype | None = None,
            max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write an unsharded :class:`~mfsdp.models.gpt.GPT` as a Hugging Face directory (config.json
    and safetensors) that ``AutoModelForCausalLM.from_pretrained`` loads. Returns the index."""
    cfg = model.config
    state = model.state_dict()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype or next(iter(state.values())).dtype
    specs, rules = {}, weight_rules(cfg)
    for rule in rules:
        for name, t in zip(rule.hf, ours_to_hf(rule, state[rule.ours].to("meta"), cfg)):
            specs[name] = (tuple(t.shape), dtype)
    stream = ((n, t.detach().to("cpu", dtype).contiguous())
              for n, t in hf_state_dict(cfg, lambda k: state[k]))
    index = write_sharded(stream, specs, path, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype), indent=2))
    return index
