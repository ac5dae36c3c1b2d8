"""Hugging Face ``transformers`` configurations and weights, to and from :class:`~mfsdp.models.gpt.GPT`.

Supported ``model_type`` values and what they become:

=============  ============================================================================
llama          RMSNorm, RoPE (Llama-3 scaling), grouped-query attention, SwiGLU, no biases
mistral        as llama (without a sliding window)
qwen2          as llama, with query/key/value biases
qwen3          as llama, with per-head QK-norm
mixtral        MoE: softmax top-k, renormalised; no shared expert
qwen2_moe      MoE: softmax top-k (renormalised or not), a shared expert with a sigmoid gate
qwen3_moe      MoE: as qwen2_moe without the shared expert, with QK-norm
deepseek_v3    multi-head latent attention, sigmoid group-limited top-k with the score-correction
               bias, routed scaling factor, first-k dense layers, shared experts
=============  ============================================================================

The weights map one to one (names and layouts) except three reshapes: the fused ``linear_qkv``
(per query group: its query heads, key head and value head) from ``q_proj``/``k_proj``/``v_proj``;
the fused SwiGLU ``linear_fc1`` (gate rows, then up rows) from ``gate_proj``/``up_proj``; and
fused experts (one ``[experts, rows, cols]`` weight) from one tensor per expert. Each output
tensor needs at most a handful of input tensors, so conversions stream (see
:func:`~mfsdp.models.hf.weight_rules`).

>>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
...                       "intermediate_size": 48, "num_hidden_layers": 2,
...                       "num_attention_heads": 4, "num_key_value_heads": 2})
>>> cfg.normalization, cfg.position_embedding_type, cfg.num_query_groups, cfg.swiglu
('RMSNorm', 'rope', 2, True)
>>> config_to_hf(cfg)["architectures"]
['LlamaForCausalLM']
>>> [(r.ours, r.hf) for r in weight_rules(cfg) if ".0.self_attention" in r.ours]
[('layers.0.self_attention.linear_qkv.weight', ('model.layers.0.self_attn.q_proj.weight', 'model.layers.0.self_attn.k_proj.weight', 'model.layers.0.self_attn.v_proj.weight')), ('layers.0.self_attention.linear_proj.weight', ('model.layers.0.self_attn.o_proj.weight',))]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from mfsdp.models.gpt import GPTConfig

__all__ = ["HF_MODEL_TYPES", "Rule", "UnsupportedModel", "config_from_hf", "config_to_hf",
           "hf_model_type", "hf_state_dict", "hf_to_ours", "ours_to_hf",
           "read_hf_config", "weight_rules"]

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                  "deepseek_v3")
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


class UnsupportedModel(ValueError):
    """A configuration mfsdp cannot represent exactly (the message names the field and the fix)."""


def _need(hf: dict, key: str, default=None):
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is not None:
        return default
    raise UnsupportedModel(f"config.json has no {key!r}, which a {hf.get('model_type')} model needs")


def _refuse(hf: dict, key: str, ok, why: str) -> None:
    value = hf.get(key)
    if not (value in ok if isinstance(ok, tuple) else value == ok):
        raise UnsupportedModel(f"config.json sets {key}={value!r}: {why}")


def _rope(hf: dict) -> dict:
    """RoPE base and scaling from either the transformers 5 ``rope_parameters`` or 4.x keys."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    out = {"rotary_base": float(base)}
    source = params if params.get("rope_type") == kind else scaling
    if kind == "llama3":
        out.update(rope_scaling_factor=float(source["factor"]),
                   rope_low_freq_factor=float(source.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(source.get("high_freq_factor", 4.0)),
                   rope_original_max_position_embeddings=int(
                       source.get("original_max_position_embeddings", 8192)))
    elif kind != "default":
        raise UnsupportedModel(f"config.json uses rope_type={kind!r}; mfsdp implements the default "
                               "RoPE and Llama-3 scaling (YaRN and others are not implemented)")
    return out


def config_from_hf(hf: dict) -> GPTConfig:
    """The :class:`~mfsdp.models.gpt.GPTConfig` of a Hugging Face ``config.json`` (as a dict)."""
    mt = hf.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise UnsupportedModel(f"model_type={mt!r} is not supported; supported: "
                               f"{', '.join(HF_MODEL_TYPES)}")
    _refuse(hf, "hidden_act", ("silu", None), "mfsdp's gated MLPs use SiLU (SwiGLU)")
    heads = _need(hf, "num_attention_heads")
    hidden = _need(hf, "hidden_size")
    c = dict(vocab_size=_need(hf, "vocab_size"), hidden_size=hidden,
             num_layers=_need(hf, "num_hidden_layers"), num_attention_heads=heads,
             ffn_hidden_size=_need(hf, "intermediate_size"),
             max_position_embeddings=int(hf.get("max_position_embeddings") or 4096),
             normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
             position_embedding_type="rope", swiglu=True, add_bias_linear=False,
             init_method_std=float(hf.get("initializer_range", 0.02)),
             share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
             **_rope(hf))
    if mt != "deepseek_v3":
        groups = hf.get("num_key_value_heads") or heads
        c["num_query_groups"] = groups if groups != heads else None
        head_dim = hf.get("head_dim")
        if head_dim and head_dim != hidden // heads:
            c["kv_channels"] = int(head_dim)
        elif hidden % heads:
            raise UnsupportedModel(f"hidden_size={hidden} is not divisible by "
                                   f"num_attention_heads={heads} and config.json has no head_dim")
    if mt in ("llama", "mistral"):
        _refuse(hf, "attention_bias", (False, None), "biases on q/k/v/o are not implemented; "
                "mfsdp's Llama has none (Qwen2's q/k/v-only biases are: model_type qwen2)")
        _refuse(hf, "mlp_bias", (False, None), "MLP biases are not implemented for Llama models")
    if mt in ("mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if hf.get("use_sliding_window") or (mt in ("mistral", "mixtral")
                                            and hf.get("sliding_window")):
            raise UnsupportedModel("config.json enables a sliding attention window, which mfsdp "
                                   "does not implement; set sliding_window to null to train "
                                   "with full attention")
    if mt in ("qwen2", "qwen2_moe"):
        c["add_qkv_bias"] = bool(hf.get("qkv_bias", True))
    if mt in ("qwen3", "qwen3_moe"):
        c["qk_layernorm"] = True
        _refuse(hf, "attention_bias", (False, None), "attention biases are not implemented for "
                "Qwen3 models")
    if mt in ("mixtral", "qwen2_moe", "qwen3_moe"):
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        c.update(num_experts=int(experts), moe_router_topk=int(_need(hf, "num_experts_per_tok")))
        _refuse(hf, "router_jitter_noise", (0, 0.0, None), "router jitter is not implemented")
        if mt == "mixtral":
            c["moe_ffn_hidden_size"] = c["ffn_hidden_size"]
        else:
            c["moe_ffn_hidden_size"] = int(_need(hf, "moe_intermediate_size"))
            c["moe_router_pre_softmax"] = not hf.get("norm_topk_prob", False)
            _refuse(hf, "decoder_sparse_step", (1, None), "every layer must be an MoE layer")
            if hf.get("mlp_only_layers"):
                raise UnsupportedModel(f"config.json sets mlp_only_layers="
                                       f"{hf['mlp_only_layers']}: dense layers in between MoE "
                                       "layers are not implemented")
        if mt == "qwen2_moe":
            c.update(moe_shared_expert_intermediate_size=int(
                _need(hf, "shared_expert_intermediate_size")), moe_shared_expert_gate=True)
    if mt == "deepseek_v3":
        c.update(multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
                 kv_lora_rank=int(_need(hf, "kv_lora_rank")),
                 qk_head_dim=int(_need(hf, "qk_nope_head_dim")),
                 qk_pos_emb_head_dim=int(_need(hf, "qk_rope_head_dim")),
                 v_head_dim=int(_need(hf, "v_head_dim")),
                 rotary_interleaved=bool(hf.get("rope_interleave", True)),
                 num_experts=int(_need(hf, "n_routed_experts")),
                 moe_router_topk=int(_need(hf, "num_experts_per_tok")),
                 moe_ffn_hidden_size=int(_need(hf, "moe_intermediate_size")),
                 moe_first_dense_layers=int(hf.get("first_k_dense_replace", 0)),
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                 moe_shared_expert_intermediate_size=int(hf.get("n_shared_experts") or 0)
                 * int(hf["moe_intermediate_size"]))
        groups, group_topk = hf.get("n_group"), hf.get("topk_group")
        if groups and groups > 1:
            c.update(moe_router_num_groups=int(groups), moe_router_group_topk=int(group_topk))
        _refuse(hf, "norm_topk_prob", (True, None), "sigmoid routing renormalises the chosen "
                "experts' weights in mfsdp (and in DeepSeek-V3)")
        _refuse(hf, "attention_bias", (False, None), "MLA biases are not implemented")
        _refuse(hf, "moe_layer_freq", (1, None), "every layer after first_k_dense_replace must "
                "be an MoE layer")
    return GPTConfig(**c)


def hf_model_type(cfg: GPTConfig) -> str:
    """The Hugging Face ``model_type`` that represents ``cfg`` exactly (or a clear error)."""
    problems = []
    if cfg.normalization != "RMSNorm":
        problems.append("normalization=LayerNorm")
    if cfg.position_embedding_type != "rope":
        problems.append("learned position embeddings")
    if not cfg.swiglu:
        problems.append("a GELU MLP")
    if cfg.add_bias_linear:
        problems.append("linear biases (add_bias_linear)")
    if problems:
        raise UnsupportedModel("this model has " + ", ".join(problems) + ", which no Hugging Face "
                               "family mfsdp exports has; train a Llama-family preset "
                               "(llama-tiny, llama3-8b, deepseek-proxy, ...) to export it")
    if cfg.multi_latent_attention:
        if cfg.moe_router_score_function != "sigmoid" or cfg.num_experts == 0:
            raise UnsupportedModel("multi-latent attention exports as deepseek_v3, which needs "
                                   "sigmoid-routed MoE layers")
        if cfg.moe_shared_expert_intermediate_size % (cfg.moe_ffn_hidden_size or
                                                      cfg.ffn_hidden_size):
            raise UnsupportedModel("deepseek_v3 sizes shared experts as n_shared_experts x "
                                   "moe_intermediate_size; moe_shared_expert_intermediate_size "
                                   "is not a multiple of moe_ffn_hidden_size")
        return "deepseek_v3"
    if cfg.num_experts:
        if cfg.moe_router_score_function != "softmax":
            raise UnsupportedModel("sigmoid routing exports only with multi-latent attention "
                                   "(deepseek_v3)")
        if cfg.moe_first_dense_layers:
            raise UnsupportedModel("dense first layers export only as deepseek_v3")
        if cfg.moe_shared_expert_intermediate_size:
            if not cfg.moe_shared_expert_gate or cfg.qk_layernorm:
                raise UnsupportedModel("a shared expert exports as qwen2_moe, which gates it "
                                       "(moe_shared_expert_gate) and has no QK-norm")
            return "qwen2_moe"
        if cfg.qk_layernorm:
            return "qwen3_moe"
        if cfg.moe_router_pre_softmax or cfg.add_qkv_bias:
            raise UnsupportedModel("Mixtral renormalises top-k weights and has no q/k/v biases")
        return "mixtral"
    if cfg.qk_layernorm:
        if cfg.add_qkv_bias:
            raise UnsupportedModel("QK-norm with q/k/v biases has no Hugging Face family here")
        return "qwen3"
    return "qwen2" if cfg.add_qkv_bias else "llama"


def config_to_hf(cfg: GPTConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A ``config.json`` dict that ``transformers`` builds the same model from."""
    mt = hf_model_type(cfg)
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rotary_base,
                "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position_embeddings}
    hf = {"architectures": [_ARCH[mt]], "model_type": mt, "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
          "num_key_value_heads": cfg.num_query_groups or cfg.num_attention_heads,
          "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
          "rms_norm_eps": cfg.norm_epsilon, "tie_word_embeddings":
          cfg.share_embeddings_and_output_weights, "initializer_range": cfg.init_method_std or 0.02,
          "rope_theta": cfg.rotary_base, "rope_parameters": rope,
          "rope_scaling": None if rope["rope_type"] == "default" else dict(rope),
          "attention_dropout": 0.0, "use_cache": True,
          "torch_dtype": str(dtype).removeprefix("torch."),
          "dtype": str(dtype).removeprefix("torch.")}
    if mt != "deepseek_v3":
        hf["head_dim"] = cfg.head_dim
    if mt in ("llama", "mistral"):
        hf.update(attention_bias=False, mlp_bias=False)
    if mt in ("qwen2", "qwen2_moe"):
        hf["qkv_bias"] = cfg.add_qkv_bias
        hf["use_sliding_window"] = False
    if mt in ("qwen3", "qwen3_moe"):
        hf.update(attention_bias=False, use_sliding_window=False)
    if mt in ("mixtral", "qwen2_moe", "qwen3_moe"):
        hf.update(num_experts_per_tok=cfg.moe_router_topk, router_jitter_noise=0.0,
                  output_router_logits=False, router_aux_loss_coef=cfg.moe_aux_loss_coeff)
        if mt == "mixtral":
            hf["num_local_experts"] = cfg.num_experts
            if (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) != cfg.ffn_hidden_size:
                raise UnsupportedModel("Mixtral's experts are intermediate_size wide; set "
                                       "moe_ffn_hidden_size equal to ffn_hidden_size")
        else:
            hf.update(num_experts=cfg.num_experts, num_local_experts=cfg.num_experts,
                      moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                      norm_topk_prob=not cfg.moe_router_pre_softmax, decoder_sparse_step=1,
                      mlp_only_layers=[])
        if mt == "qwen2_moe":
            hf["shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
    if mt == "deepseek_v3":
        moe_ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        hf.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                  qk_nope_head_dim=cfg.qk_head_dim, qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
                  qk_head_dim=cfg.qk_head_dim + cfg.qk_pos_emb_head_dim,
                  head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
                  rope_interleave=cfg.rotary_interleaved, n_routed_experts=cfg.num_experts,
                  num_experts_per_tok=cfg.moe_router_topk, moe_intermediate_size=moe_ffn,
                  first_k_dense_replace=cfg.moe_first_dense_layers,
                  n_shared_experts=cfg.moe_shared_expert_intermediate_size // moe_ffn,
                  n_group=cfg.moe_router_num_groups or 1,
                  topk_group=cfg.moe_router_group_topk or 1, norm_topk_prob=True,
                  routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0,
                  attention_bias=False, num_nextn_predict_layers=0)
    return hf


@dataclass(frozen=True)
class Rule:
    """One mfsdp tensor and the Hugging Face tensors it is made of.

    ``kind``: ``copy`` (one tensor, same layout), ``qkv`` (q/k/v interleaved per query group),
    ``cat`` (concatenated along rows: gate then up), ``stack`` (fused experts: ``hf`` lists each
    expert's tensors, ``parts`` per expert, concatenated along rows within an expert).
    """

    ours: str
    hf: tuple[str, ...]
    kind: str = "copy"
    parts: int = 1


def weight_rules(cfg: GPTConfig, model_type: str | None = None) -> list[Rule]:
    """Every mfsdp weight of ``cfg`` (global expert names) and the HF tensors that make it."""
    mt = model_type or hf_model_type(cfg)
    rules = [Rule("embedding.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        rules += [Rule(o + "input_layernorm.weight", (h + "input_layernorm.weight",)),
                  Rule(o + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",))]
        a, ha = o + "self_attention.", h + "self_attn."
        if cfg.multi_latent_attention:
            pairs = [("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
                     ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")]
            pairs = ([("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
                      ("linear_q_up_proj", "q_b_proj")] if cfg.q_lora_rank
                     else [("linear_q_proj", "q_proj")]) + pairs
            rules += [Rule(f"{a}{x}.weight", (f"{ha}{y}.weight",)) for x, y in pairs]
        else:
            rules.append(Rule(a + "linear_qkv.weight", tuple(f"{ha}{p}_proj.weight" for p in "qkv"),
                              "qkv"))
            if cfg.add_qkv_bias:
                rules.append(Rule(a + "linear_qkv.bias", tuple(f"{ha}{p}_proj.bias" for p in "qkv"),
                                  "qkv"))
            if cfg.qk_layernorm:
                rules += [Rule(a + "q_layernorm.weight", (ha + "q_norm.weight",)),
                          Rule(a + "k_layernorm.weight", (ha + "k_norm.weight",))]
            rules.append(Rule(a + "linear_proj.weight", (ha + "o_proj.weight",)))
        moe = cfg.num_experts > 0 and i >= cfg.moe_first_dense_layers
        m = o + "mlp."
        if not moe:
            rules += [Rule(m + "linear_fc1.weight", (h + "mlp.gate_proj.weight",
                                                     h + "mlp.up_proj.weight"), "cat"),
                      Rule(m + "linear_fc2.weight", (h + "mlp.down_proj.weight",))]
            continue
        hm = h + ("block_sparse_moe." if mt == "mixtral" else "mlp.")
        rules.append(Rule(m + "router.weight", (hm + "gate.weight",)))
        if cfg.moe_router_enable_expert_bias:
            rules.append(Rule(m + "router.expert_bias", (hm + "gate.e_score_correction_bias",)))
        gate, up, down = ("w1", "w3", "w2") if mt == "mixtral" else ("gate_proj", "up_proj",
                                                                      "down_proj")
        e = hm + "experts."
        if cfg.moe_grouped_gemm:
            n = cfg.num_experts
            rules += [Rule(m + "experts.linear_fc1.weight",
                           tuple(f"{e}{j}.{w}.weight" for j in range(n) for w in (gate, up)),
                           "stack", 2),
                      Rule(m + "experts.linear_fc2.weight",
                           tuple(f"{e}{j}.{down}.weight" for j in range(n)), "stack", 1)]
        else:
            for j in range(cfg.num_experts):
                x = f"{m}experts.local_experts.{j}."
                rules += [Rule(x + "linear_fc1.weight", (f"{e}{j}.{gate}.weight",
                                                         f"{e}{j}.{up}.weight"), "cat"),
                          Rule(x + "linear_fc2.weight", (f"{e}{j}.{down}.weight",))]
        if cfg.moe_shared_expert_intermediate_size:
            s = hm + ("shared_experts." if mt == "deepseek_v3" else "shared_expert.")
            rules += [Rule(m + "shared_expert.linear_fc1.weight",
                           (s + "gate_proj.weight", s + "up_proj.weight"), "cat"),
                      Rule(m + "shared_expert.linear_fc2.weight", (s + "down_proj.weight",))]
            if cfg.moe_shared_expert_gate:
                rules.append(Rule(m + "shared_expert_gate.weight",
                                  (hm + "shared_expert_gate.weight",)))
    rules.append(Rule("final_layernorm.weight", ("model.norm.weight",)))
    if not cfg.share_embeddings_and_output_weights:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return rules


def _qkv_split(t: torch.Tensor, cfg: GPTConfig) -> list[torch.Tensor]:
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.head_dim
    per = heads // groups
    g = t.reshape(groups, per + 2, d, *t.shape[1:])
    return [g[:, :per].reshape(heads * d, *t.shape[1:]), g[:, per].reshape(groups * d, *t.shape[1:]),
            g[:, per + 1].reshape(groups * d, *t.shape[1:])]


def _qkv_join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    groups, d = cfg.num_query_groups or cfg.num_attention_heads, cfg.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(groups, -1, d, *rest), k.reshape(groups, 1, d, *rest),
             v.reshape(groups, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def hf_to_ours(rule: Rule, tensors: list[torch.Tensor], cfg: GPTConfig) -> torch.Tensor:
    """Build the mfsdp tensor of ``rule`` from its Hugging Face tensors (in ``rule.hf`` order)."""
    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "qkv":
        return _qkv_join(*tensors, cfg)
    if rule.kind == "cat":
        return torch.cat(tensors, dim=0)
    per = rule.parts
    return torch.stack([torch.cat(tensors[j:j + per], dim=0) for j in range(0, len(tensors), per)])


def ours_to_hf(rule: Rule, tensor: torch.Tensor, cfg: GPTConfig) -> list[torch.Tensor]:
    """Split the mfsdp tensor of ``rule`` into its Hugging Face tensors (in ``rule.hf`` order)."""
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "qkv":
        return _qkv_split(tensor, cfg)
    if rule.kind == "cat":
        return list(tensor.chunk(2, dim=0))
    return [p for expert in tensor for p in expert.chunk(rule.parts, dim=0)]


def hf_state_dict(cfg: GPTConfig, get: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)`` pairs from a getter of mfsdp tensors by name."""
    for rule in weight_rules(cfg):
        yield from zip(rule.hf, ours_to_hf(rule, get(rule.ours), cfg))


def read_hf_config(path) -> dict:
    """``config.json`` of a Hugging Face model directory as a dict (a clear error when absent)."""
    import json
    from pathlib import Path

    f = Path(path) / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{path} has no config.json (not a Hugging Face model directory)")
    return json.loads(f.read_text())
