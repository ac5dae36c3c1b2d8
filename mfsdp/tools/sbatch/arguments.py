"""The command lines the scripts run: the trainer's flags (``mfsdp train``'s or Megatron-LM's
``pretrain_gpt.py``'s, with the model preset written out as Megatron-LM's architecture flags)
and the converter's."""

from __future__ import annotations

import re
import shlex

from mfsdp.tools.sbatch.checks import _model_preset, recompute_layout


class Var(str):
    """A shell variable in an argument list: written ``"$NAME"`` (expanded, one word)."""


def _quote(token: str) -> str:
    return f'"${token}"' if isinstance(token, Var) else shlex.quote(str(token))


def _group(tokens: list[str]) -> list[list[str]]:
    """``--flag value ...`` groups: one flag (with its values) per line."""
    lines: list[list[str]] = []
    for token in tokens:
        if (isinstance(token, str) and token.startswith("--")) or not lines:
            lines.append([token])
        else:
            lines[-1].append(token)
    return lines


def _override(flags: list[str], more: list[str]) -> list[str]:
    """``flags`` with each ``--flag value`` group of ``more`` in place of the group of the same
    flag (appended where ``flags`` has none), so that every flag is passed once.

    >>> _override(["--num-layers", "32", "--swiglu"], ["--num-layers", "4", "--bf16"])
    ['--num-layers', '4', '--swiglu', '--bf16']
    """
    groups = _group(flags)
    where = {g[0]: i for i, g in enumerate(groups)}
    for group in _group(more):
        if group[0] in where:
            groups[where[group[0]]] = group
        else:
            groups.append(group)
    return [t for g in groups for t in g]


def recompute_flags(value: str) -> list[str]:
    """The trainer's recomputation flags of a ``recompute`` value (the same for mfsdp train
    and Megatron-LM).

    >>> " ".join(recompute_flags("block:26"))
    '--recompute-granularity full --recompute-method block --recompute-num-layers 26'
    >>> recompute_flags("selective"), recompute_flags("none")
    (['--recompute-granularity', 'selective'], [])
    """
    granularity, method, n = recompute_layout(value)
    if granularity is None:
        return []
    if granularity == "selective":
        return ["--recompute-granularity", "selective"]
    return ["--recompute-granularity", "full", "--recompute-method", method,
            "--recompute-num-layers", str(n)]


def megatron_lm_model_flags(name: str, seq_length: int) -> list[str]:
    """Megatron-LM's architecture flags for ``mfsdp``'s model preset ``name`` (the same model:
    layers, sizes, attention, normalisation, rotary embeddings, MoE routing).

    >>> " ".join(megatron_lm_model_flags("llama3-8b", 8192)[:8])
    '--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32'
    """
    from mfsdp.models.gpt import GPT_PRESETS

    c = GPT_PRESETS[name]
    f = ["--num-layers", str(c.num_layers), "--hidden-size", str(c.hidden_size),
         "--ffn-hidden-size", str(c.ffn_hidden_size), "--num-attention-heads",
         str(c.num_attention_heads)]
    if c.num_query_groups and c.num_query_groups != c.num_attention_heads:
        f += ["--group-query-attention", "--num-query-groups", str(c.num_query_groups)]
    if c.kv_channels:
        f += ["--kv-channels", str(c.kv_channels)]
    f += ["--max-position-embeddings", str(max(c.max_position_embeddings, seq_length)),
          "--normalization", c.normalization, "--norm-epsilon", repr(c.norm_epsilon)]
    f += ["--position-embedding-type", c.position_embedding_type]
    if c.position_embedding_type == "rope":
        f += ["--rotary-base", str(int(c.rotary_base))]
        if c.rotary_interleaved:
            f += ["--rotary-interleaved"]
        if c.rope_scaling_factor:
            f += ["--use-rope-scaling", "--rope-scaling-factor", repr(float(c.rope_scaling_factor))]
    if c.swiglu:
        f += ["--swiglu"]
    if not c.add_bias_linear:
        f += ["--disable-bias-linear"]
    if c.add_qkv_bias:
        f += ["--add-qkv-bias"]
    if c.qk_layernorm:
        f += ["--qk-layernorm"]
    if not c.share_embeddings_and_output_weights:
        f += ["--untie-embeddings-and-output-weights"]
    if c.init_method_std:
        f += ["--init-method-std", repr(c.init_method_std)]
    if c.multi_latent_attention:
        f += ["--multi-latent-attention", "--kv-lora-rank", str(c.kv_lora_rank),
              "--qk-head-dim", str(c.qk_head_dim), "--qk-pos-emb-head-dim",
              str(c.qk_pos_emb_head_dim), "--v-head-dim", str(c.v_head_dim)]
        if c.q_lora_rank:
            f += ["--q-lora-rank", str(c.q_lora_rank)]
    if c.num_experts:
        dense = c.moe_first_dense_layers
        f += ["--num-experts", str(c.num_experts),
              "--moe-layer-freq", f"[0]*{dense}+[1]*{c.num_layers - dense}" if dense else "1",
              "--moe-router-topk", str(c.moe_router_topk),
              "--moe-router-score-function", c.moe_router_score_function]
        if c.moe_ffn_hidden_size:
            f += ["--moe-ffn-hidden-size", str(c.moe_ffn_hidden_size)]
        if c.moe_router_pre_softmax:
            f += ["--moe-router-pre-softmax"]
        if c.moe_router_num_groups:
            f += ["--moe-router-num-groups", str(c.moe_router_num_groups),
                  "--moe-router-group-topk", str(c.moe_router_group_topk)]
        if c.moe_router_topk_scaling_factor:
            f += ["--moe-router-topk-scaling-factor", repr(c.moe_router_topk_scaling_factor)]
        if c.moe_router_enable_expert_bias:
            f += ["--moe-router-enable-expert-bias"]
        if c.moe_shared_expert_intermediate_size:
            f += ["--moe-shared-expert-intermediate-size",
                  str(c.moe_shared_expert_intermediate_size)]
    return f


def train_args(v: dict) -> list[str]:
    """The trainer's command line of a resolved train preset (``Var`` tokens are the script's
    variables: CHECKPOINT_DIR, TENSORBOARD_DIR, ...); DATA_PATH and the tokenizer are added by
    the script when it starts, from the environment."""
    megatron = v["trainer"] == "megatron-lm"
    model = shlex.split(v["model_args"])
    if megatron:  # --model-preset NAME -> Megatron-LM's own architecture flags
        name = _model_preset(v["model_args"])
        i = model.index("--model-preset") if "--model-preset" in model else None
        rest = (model[:i] + model[i + 2:]) if i is not None else [
            t for t in model if not t.startswith("--model-preset=")]
        model = _override(megatron_lm_model_flags(name, v["seq_length"]), rest)
    a: list[str] = ["--use-megatron-fsdp",
                    "--data-parallel-sharding-strategy", v["strategy"],
                    "--num-distributed-optimizer-instances", str(v["outer"])]
    if megatron:
        # what upstream's guide scripts (examples/megatron_fsdp/) pass with Megatron-FSDP: the
        # distributed optimizer, no fused weight-gradient accumulation, and the overlap of the
        # gradient reduction and the parameter gather with compute (both off by default in
        # Megatron-LM; mfsdp train overlaps by default)
        a += ["--use-distributed-optimizer", "--no-gradient-accumulation-fusion",
              "--overlap-grad-reduce", "--overlap-param-gather"]
    if v["outer"] > 1:
        a += ["--outer-dp-sharding-strategy", v["outer_strategy"]]
    if v["ep"] > 1:
        a += ["--expert-model-parallel-size", str(v["ep"])]
    if v["tp"] > 1:
        a += ["--tensor-model-parallel-size", str(v["tp"])]
        if v["sequence_parallel"]:
            a += ["--sequence-parallel"]
    if v["cp"] > 1:
        a += ["--context-parallel-size", str(v["cp"])]
    if v["num_experts"] > 0:
        a += ["--moe-token-dispatcher-type", v["dispatcher"]]
        if v["dispatcher"] == "flex":
            a += ["--moe-flex-dispatcher-backend", v["flex_backend"]]
    a += model + recompute_flags(v["recompute"])
    a += ["--micro-batch-size", str(v["micro_batch_size"]),
          "--global-batch-size", str(v["global_batch_size"]),
          "--seq-length", str(v["seq_length"]), "--train-iters", str(v["train_iters"]),
          "--lr", repr(float(v["lr"]))]
    a += ["--min-lr", repr(float(v["min_lr"])), "--lr-decay-style", v["lr_decay_style"]]
    if v["lr_warmup_iters"]:
        a += ["--lr-warmup-iters", str(v["lr_warmup_iters"])]
    if v["lr_decay_iters"]:
        a += ["--lr-decay-iters", str(v["lr_decay_iters"])]
    if v["per_token_loss"]:
        a.append("--calculate-per-token-loss")
    for key, flag in (("bf16", "--bf16"), ("meta_init", "--init-model-with-meta-device"),
                      ("all_gather_group", "--create-all-gather-group"),
                      ("grad_reduce_in_bf16", "--grad-reduce-in-bf16"),
                      ("double_buffer", "--fsdp-double-buffer"), ("nccl_ub", "--use-nccl-ub")):
        if v[key]:
            a.append(flag)
    if not megatron:  # (mfsdp train's; refused with trainer=megatron-lm)
        a += ["--compile"] * v["compile"] + ["--fused-adam"] * v["fused_adam"]
    if megatron and v["nccl_ub"]:  # registers the user buffers once, as upstream's scripts do
        a.append("--fsdp-manual-registration")
    if v["save"]:
        a += ["--save", Var("CHECKPOINT_DIR"), "--save-interval", str(v["save_interval"])]
        if v["signal_seconds"] > 0:
            a += ["--exit-signal-handler"]
        a += ["--ckpt-format", v["ckpt_format"]]
    if v["load"] and v["save"]:  # the script picks: LOAD, or CHECKPOINT_DIR once it holds one
        a += ["--load", Var("LOAD_FROM")]
    elif v["load"]:
        a += ["--load", v["load"]]
    elif v["save"]:
        a += ["--load", Var("CHECKPOINT_DIR")]
    a += ["--distributed-timeout-minutes", _minutes(v["distributed_timeout_minutes"]),
          "--log-interval", str(v["log_interval"]), "--tensorboard-dir", Var("TENSORBOARD_DIR")]
    if megatron:
        a += ["--log-throughput", "--data-cache-path", Var("DATA_CACHE_DIR")]
    elif v["log_jsonl"]:  # (the script puts a relative path in the job's log directory)
        a += ["--log-jsonl", Var("METRICS_JSONL")]
    return a + shlex.split(v["extra_args"])


def _minutes(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def convert_args(v: dict) -> list[str]:
    """The conversion command's arguments (``mfsdp convert`` or Megatron-LM's
    ``checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor``)."""
    if v["trainer"] == "megatron-lm":
        a = ["convert-torch-dist-to-fsdp-dtensor", v["src"], v["dst"]]
        if v["swiglu"]:
            a.append("--swiglu")
        if v["param_map"]:
            a += ["--param-to-param-group-map-json", v["param_map"]]
        return a
    a = ["--from", v["from_format"], "--to", v["to_format"], v["src"], v["dst"]]
    if v["param_map"]:
        a += ["--param-to-param-group-map", v["param_map"]]
    if v["model_preset"]:
        a += ["--model-preset", v["model_preset"]]
    if v["swiglu"]:
        a.append("--swiglu")
    return a


def bandwidth_args(v: dict) -> list[str]:
    """``mfsdp bandwidth``'s arguments: NCCL on a GPU job, gloo on a CPU one, and the JSON
    file beside the job's log (the script's BANDWIDTH_JSON)."""
    return ["--device", "cuda" if v["gpus_per_node"] else "cpu", "--gpu", v["gpu"],
            "--size-mib", *v["size_mib"].split(), "--json", Var("BANDWIDTH_JSON")]


def _beside_log(output: str) -> str:
    """The path of a file beside the log of Slurm's ``output`` pattern, as the script writes
    it: ``.json`` in place of ``.log`` (or added), %x and %j the job's name and id, a relative
    path under "$PWD" (the job's working directory, where Slurm puts a relative log).

    >>> _beside_log("logs/%x-%j.log")
    '"$PWD"/logs/"$SLURM_JOB_NAME"-"$SLURM_JOB_ID".json'
    """
    path = (output[:-len(".log")] if output.endswith(".log") else output) + ".json"
    names = {"%x": '"$SLURM_JOB_NAME"', "%j": '"$SLURM_JOB_ID"'}
    text = "".join(names.get(part) or (shlex.quote(part) if part else "")
                   for part in re.split(r"(%[xj])", path))
    return text if path.startswith("/") else f'"$PWD"/{text}'


def _in_job_dir(path: str) -> str:
    """A path as the script writes it: absolute ones quoted, relative ones under "$JOB_DIR" (the
    job's log directory, which holds the per-rank logs)."""
    return shlex.quote(path) if path.startswith("/") else f'"$JOB_DIR"/{shlex.quote(path)}'


def _abs(path: str) -> str:
    """A path as the script writes it: absolute ones quoted, relative ones under "$PWD"."""
    return shlex.quote(path) if path.startswith("/") else f'"$PWD"/{shlex.quote(path)}'
