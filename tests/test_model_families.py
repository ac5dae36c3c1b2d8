"""The model families against ``transformers`` itself: tiny random configurations built by
``transformers``, saved with ``save_pretrained`` (nothing downloaded).

For Llama (also with Llama-3 RoPE scaling and tied embeddings), Qwen2, Qwen3, Mixtral,
Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (with and without a query LoRA):

* import: :func:`mfsdp.checkpoint.hf_format.load_hf` gives logits equal to the ``transformers`` model
  (fp32, 1e-5 relative), on a ``[B, S]`` batch and on packed THD sequences;
* conversion: ``--from hf`` then ``--to hf`` (sharded files) gives back every tensor bit for bit
  and ``from_pretrained`` reports no missing or unexpected keys;
* training (2 gloo ranks, SGD): the imported checkpoint trained sharded (ZeRO-3, and EP 2 for
  the MoE families) equals the same model trained in one process; the saved checkpoint exported
  with ``--to hf`` loads in ``transformers`` and gives the logits of the trained model.

Norm weights, biases and DeepSeek's score-correction bias are perturbed away from their
initial values so that a swapped or dropped tensor cannot go unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mfsdp.launch import launch

transformers = pytest.importorskip("transformers")

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=48, max_position_embeddings=64)


def hf_config(family: str):
    """A tiny ``transformers`` configuration of ``family``."""
    T = transformers
    if family == "llama":
        return T.LlamaConfig(num_key_value_heads=2, **COMMON)
    if family == "llama3-tied":
        return T.LlamaConfig(num_key_value_heads=1, tie_word_embeddings=True,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 16},
                             rope_theta=500000.0, **COMMON)
    if family == "qwen2":
        return T.Qwen2Config(num_key_value_heads=2, **COMMON)
    if family == "qwen3":
        return T.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON)
    if family == "mixtral":
        return T.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               **COMMON)
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                norm_topk_prob=False, **COMMON)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, norm_topk_prob=True, **COMMON)
    if family in ("deepseek_v3", "deepseek_v3-noqlora"):
        return T.DeepseekV3Config(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=16, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=4, topk_group=2,
                                  q_lora_rank=None if family.endswith("noqlora") else 16,
                                  kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                  v_head_dim=8, **COMMON)
    raise ValueError(family)


FAMILIES = ["llama", "llama3-tied", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
            "deepseek_v3", "deepseek_v3-noqlora"]


def make_hf(family: str, path: Path):
    """Build, perturb and ``save_pretrained`` a tiny model; return it (eval mode)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family),
                                                          attn_implementation="eager")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)
    return model.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_import_gives_transformers_logits(family, tmp_path):
    from mfsdp.models.gpt import pack_sequences
    from mfsdp.checkpoint.hf_format import load_hf

    ref = make_hf(family, tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(input_ids=ids).logits.reshape(-1, VOCAB)
        assert _rel(ours(ids), want) < 1e-5
        # packed THD: two sequences of different lengths in one row, no attention across them
        a, b = ids[0, :11], ids[1, :5]
        tokens, cu = pack_sequences([a, b])
        packed = ours(tokens, cu)
        alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in (a, b)])
        assert _rel(packed, alone) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_round_trip_is_exact(family, tmp_path):
    from mfsdp.checkpoint.hf_format import fsdp_to_hf, hf_to_fsdp
    from mfsdp.checkpoint.safetensors import SafetensorsReader

    ref = make_hf(family, tmp_path / "hf")
    hf_to_fsdp(tmp_path / "hf", tmp_path / "dcp", progress=False)
    fsdp_to_hf(tmp_path / "dcp", tmp_path / "back", max_shard_bytes=20_000, progress=False)
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()  # several shards
    src, back = SafetensorsReader(tmp_path / "hf"), SafetensorsReader(tmp_path / "back")
    assert sorted(src.keys()) == sorted(back.keys())
    for k in src.keys():
        assert torch.equal(src.get(k), back.get(k)), k
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert _rel(model.eval()(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-6


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_fused_experts_import_and_export(family, tmp_path):
    """With fused experts (one ``[experts, rows, cols]`` weight per projection) the import gives
    the same logits and the export gives back the per-expert tensors bit for bit."""
    from mfsdp.checkpoint.safetensors import SafetensorsReader
    from mfsdp.checkpoint.hf_format import load_hf, save_hf

    ref = make_hf(family, tmp_path / "hf")
    fused = load_hf(tmp_path / "hf", {"moe_grouped_gemm": True}).eval()
    assert any(".experts.linear_fc1" in n for n, _ in fused.named_parameters())
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert _rel(fused(ids), ref(input_ids=ids).logits.reshape(-1, VOCAB)) < 1e-5
    save_hf(fused, tmp_path / "back")
    src, back = SafetensorsReader(tmp_path / "hf"), SafetensorsReader(tmp_path / "back")
    assert sorted(src.keys()) == sorted(back.keys())
    for k in src.keys():
        assert torch.equal(src.get(k), back.get(k)), k


def test_unsupported_configs_name_the_field():
    from mfsdp.models.gpt import GPT_PRESETS
    from mfsdp.models.hf import UnsupportedModel, config_from_hf, hf_model_type

    with pytest.raises(UnsupportedModel, match="rope_type='yarn'"):
        config_from_hf(dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                            num_hidden_layers=1, num_attention_heads=2,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedModel, match="model_type='gpt_neox'"):
        config_from_hf({"model_type": "gpt_neox"})
    with pytest.raises(UnsupportedModel, match="learned position embeddings"):
        hf_model_type(GPT_PRESETS["gpt-tiny"])
    assert hf_model_type(GPT_PRESETS["llama3-8b"]) == "llama"
    assert hf_model_type(GPT_PRESETS["deepseek-v3"]) == "deepseek_v3"


def test_presets_are_the_published_sizes():
    """The presets build the real architectures: parameter counts of the published models.

    Counted by the planner, which ``tests/test_plan.py`` checks equal to the built model's count,
    parameter for parameter (building DeepSeek-V3's 15,616 experts once is enough)."""
    from mfsdp.tools.plan import PRESETS

    published = {"llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "llama3.1-405b": 405.85e9,
                 "deepseek-v3": 671.0e9}
    for name, count in published.items():
        n = sum(PRESETS[name].param_counts())
        assert abs(n - count) / count < 0.005, (name, n)


def test_config_json_of_the_export_builds_the_same_architecture():
    """``config_to_hf`` then ``config_from_hf`` is the identity on every exportable preset."""
    from dataclasses import replace

    from mfsdp.models.gpt import GPT_PRESETS
    from mfsdp.models.hf import config_from_hf, config_to_hf

    for name in ("llama-tiny", "llama3-8b", "deepseek-proxy", "deepseek-v3"):
        cfg = GPT_PRESETS[name]
        back = config_from_hf(config_to_hf(cfg))
        # options that do not change the weights are not part of a Hugging Face config
        same = replace(back, moe_aux_loss_coeff=cfg.moe_aux_loss_coeff)
        assert same == cfg, name


# ---------------------------------------------------------------------------------------------
# sharded training of imported checkpoints
# ---------------------------------------------------------------------------------------------
def _batches(steps: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (4, 12), generator=g) for _ in range(steps)]


def _reference(hf_dir: str, steps: int, lr: float) -> dict[str, torch.Tensor]:
    """One process, whole batch: the mfsdp model from ``hf_dir`` after ``steps`` SGD steps."""
    from mfsdp.models.gpt import gpt_loss
    from mfsdp.checkpoint.hf_format import load_hf

    model = load_hf(hf_dir)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for ids in _batches(steps):
        cu = torch.arange(0, ids.numel() + 1, ids.shape[1])
        loss, n = gpt_loss(model(ids), ids, cu)
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded(hf_dir: str, ckpt: str, out: str, ep: int, strategy: str, steps: int,
             lr: float) -> None:
    """Every rank: build the model, load the imported checkpoint, train, save."""
    from mfsdp import ParallelLayout, fully_shard
    from mfsdp.checkpoint import load_checkpoint, save_checkpoint
    from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE
    from mfsdp.models.gpt import GPT, GPTConfig, TransformerLayer, gpt_loss
    from mfsdp.moe import shard_experts

    cfg = GPTConfig.from_dict(json.loads((Path(ckpt) / MODEL_CONFIG_FILE).read_text()))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(123)  # weights come from the checkpoint, not from this seed
    model = GPT(cfg)
    groups = None
    if ep > 1:
        groups = ParallelLayout(world, 1, ep, cfg.num_experts).create_groups()
    shard_experts(model, groups["ep"] if groups else None)
    model, opt = fully_shard(model, torch.optim.SGD(model.parameters(), lr=lr),
                             fsdp_unit_modules=[TransformerLayer], zero_dp_strategy=strategy,
                             process_groups=groups)
    load_checkpoint(ckpt, model, opt)
    for ids in _batches(steps):
        mine = ids[rank * 4 // world:(rank + 1) * 4 // world]
        cu = torch.arange(0, mine.numel() + 1, mine.shape[1])
        loss, n = gpt_loss(model(mine), mine, cu)
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(out, model, opt, iteration=steps,
                    files={MODEL_CONFIG_FILE: json.dumps(cfg.to_dict())})


@pytest.mark.slow
@pytest.mark.parametrize("family, ep, strategy", [
    ("llama", 1, "optim_grads_params"),
    ("llama3-tied", 1, "optim_grads"),
    ("qwen2", 1, "optim_grads_params"),
    ("mixtral", 2, "optim_grads_params"),
    ("qwen2_moe", 2, "optim_grads_params"),
    ("deepseek_v3", 2, "optim_grads_params"),
    ("deepseek_v3", 1, "optim"),
])
def test_imported_model_trains_sharded_and_exports(family, ep, strategy, tmp_path):
    from mfsdp.checkpoint.hf_format import fsdp_to_hf, hf_to_fsdp
    from mfsdp.checkpoint.hf_format import load_hf

    make_hf(family, tmp_path / "hf")
    hf_to_fsdp(tmp_path / "hf", tmp_path / "imported", progress=False)
    steps, lr = 3, 0.5
    launch(_sharded, 2, args=(str(tmp_path / "hf"), str(tmp_path / "imported"),
                              str(tmp_path / "run"), ep, strategy, steps, lr))
    want = _reference(str(tmp_path / "hf"), steps, lr)
    fsdp_to_hf(tmp_path / "run", tmp_path / "export", progress=False)
    trained = load_hf(tmp_path / "export")
    got = trained.state_dict()
    moved = 0
    start = load_hf(tmp_path / "hf").state_dict()
    for k, v in want.items():
        assert _rel(got[k], v) < 1e-5, k
        moved += not torch.equal(start[k], v)
    assert moved > len(want) // 2  # training changed most tensors
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                                 attn_implementation="eager")
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert _rel(hf_model.eval()(input_ids=ids).logits.reshape(-1, VOCAB),
                    trained.eval()(ids)) < 1e-5


@pytest.mark.extended  # (36 s: make test's budget; the API round trips above cover the formats)
def test_cli_import_train_export(tmp_path):
    """The user's path: ``mfsdp convert --from hf``, ``mfsdp train --load`` on 2 ranks with EP 2,
    ``mfsdp convert --to hf``, then ``transformers`` runs the result."""
    make_hf("deepseek_v3", tmp_path / "hf")
    env_py = [sys.executable, "-m"]
    subprocess.run(env_py + ["mfsdp.cli", "convert", "--from", "hf", "--to", "fsdp_dtensor",
                             str(tmp_path / "hf"), str(tmp_path / "imported"), "--no-progress"],
                   check=True)
    out = subprocess.run(
        env_py + ["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                  "mfsdp.train", "--use-megatron-fsdp", "--load", str(tmp_path / "imported"),
                  "--save", str(tmp_path / "run"), "--expert-model-parallel-size", "2",
                  "--train-iters", "3", "--mock-data", "--seq-length", "16",
                  "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3"],
        check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1",
                                                          **__import__("os").environ})
    assert "loaded the weights of" in out.stdout and "model deepseek_v3" in out.stdout
    subprocess.run(env_py + ["mfsdp.cli", "convert", "--from", "fsdp_dtensor", "--to", "hf",
                             str(tmp_path / "run"), str(tmp_path / "export"), "--dtype", "bf16"],
                   check=True, capture_output=True)
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["dtype"] == "bfloat16"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, VOCAB, (1, 8))).logits
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# meta-device initialisation of models we did not write
# ---------------------------------------------------------------------------------------------
def _llama3_config():
    return hf_config("llama3-tied").__class__(**{**hf_config("llama3-tied").to_dict(),
                                                 "tie_word_embeddings": False})


def _meta_llama(use_init_fn: bool):
    """Every rank: a Hugging Face Llama built on meta, materialised shard by shard."""
    from mfsdp import fully_shard

    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama3_config())
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    sharded, _ = fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             fsdp_unit_modules=[layer], zero_dp_strategy="optim_grads_params",
                             init_model_with_meta_device=True,
                             param_init_fn=model._init_weights if use_init_fn else None)
    ids = torch.arange(12).view(1, 12) % VOCAB
    with torch.no_grad():
        logits = sharded(input_ids=ids).logits
    return (sharded.full_parameters(), {n: b.clone() for n, b in model.named_buffers()}, logits)


@pytest.mark.slow
def test_meta_init_of_a_transformers_llama():
    """``param_init_fn=model._init_weights``: the model's own initialiser, rotary ``inv_freq``
    (Llama-3 scaled) recomputed, the same values on 1 and 2 ranks, the eager distribution."""
    one = launch(_meta_llama, 1, args=(True,))[0]
    two = launch(_meta_llama, 2, args=(True,))
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(_llama3_config())
    std = eager.config.initializer_range
    for name, p in eager.named_parameters():
        assert torch.equal(one[0][name], two[0][0][name]), name   # identical across world sizes
        assert torch.equal(two[0][0][name], two[1][0][name]), name
        if p.dim() == 2:  # N(0, 0.02) as eager: std within 15% over >= 1,000 draws
            assert abs(one[0][name].std().item() - std) < 0.15 * std, name
            assert abs(one[0][name].mean().item()) < 4 * std / p.numel() ** 0.5, name
        else:
            assert torch.equal(one[0][name], p.detach()), name  # norms: ones
    for name, b in eager.named_buffers():
        assert torch.equal(one[1][name], b), name  # inv_freq recomputed, not left on meta
    with torch.no_grad():
        eager.load_state_dict(one[0])
        want = eager(input_ids=torch.arange(12).view(1, 12) % VOCAB).logits
    assert _rel(one[2], want) < 1e-5  # the materialised model computes what its weights say


@pytest.mark.slow
def test_meta_init_without_an_initialiser_names_the_module_and_the_fix():
    with pytest.raises(Exception, match=r"model.layers.0.input_layernorm' \(LlamaRMSNorm\).*"
                                        r"param_init_fn"):
        launch(_meta_llama, 1, args=(False,))


def _meta_gpt(preset: str, fused: bool):
    from dataclasses import replace

    from mfsdp import fully_shard
    from mfsdp.models.gpt import GPT, GPT_PRESETS, TransformerLayer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(replace(GPT_PRESETS[preset], moe_grouped_gemm=fused))
    sharded, _ = fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             fsdp_unit_modules=[TransformerLayer],
                             zero_dp_strategy="optim_grads_params",
                             init_model_with_meta_device=True, param_init_fn=model.init_weights)
    return sharded.full_parameters()


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True])
def test_meta_init_of_our_families_equals_eager(fused):
    """With ``param_init_fn=model.init_weights`` the materialised model is the eager one, bit for
    bit (module-by-module draws in construction order), one-module-per-expert; fused experts
    draw per fused weight and keep the distribution."""
    from dataclasses import replace

    from mfsdp.models.gpt import GPT, GPT_PRESETS

    got = launch(_meta_gpt, 2, args=("deepseek-proxy", fused))[0]
    torch.manual_seed(0)
    eager = GPT(replace(GPT_PRESETS["deepseek-proxy"], moe_grouped_gemm=fused))
    for name, p in eager.named_parameters():
        if fused and ".experts." in name:
            assert abs(got[name].std().item() - 0.02) < 0.003, name
        else:
            assert torch.equal(got[name], p.detach()), name


# ---------------------------------------------------------------------------------------------
# regressions of the old export (mfsdp names, --swiglu looked for fc1 only, no expert bias)
# ---------------------------------------------------------------------------------------------
@pytest.mark.extended  # (29 s: make test's budget)
def test_trainer_checkpoint_exports_swiglu_split_and_expert_bias(tmp_path):
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.hf_format import fsdp_to_hf
    from mfsdp.checkpoint.safetensors_format import fsdp_to_safetensors
    from mfsdp.checkpoint.manifest import CheckpointError, resolve_checkpoint
    from mfsdp.checkpoint.safetensors import SafetensorsReader, load_file

    argv = ["--use-megatron-fsdp", "--model-preset", "deepseek-proxy", "--train-iters", "3",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--save", str(tmp_path / "run"),
            "--moe-router-bias-update-rate", "0.01"]
    launch("mfsdp.train:run_in_rank", 1, args=(argv,))
    ckpt = resolve_checkpoint(tmp_path / "run")
    src = DCPSource(ckpt)
    bias = src.get("model.layers.1.mlp.router.expert_bias")
    assert bias.abs().sum() > 0  # the balancing updates moved it

    fsdp_to_safetensors(ckpt, tmp_path / "st", swiglu=True)
    weights, _ = load_file(tmp_path / "st" / "model.safetensors")
    assert not [n for n in weights if "linear_fc1" in n]  # every fused weight was split
    fc1 = src.get("model.layers.0.mlp.linear_fc1.weight")
    assert torch.equal(torch.cat([weights["layers.0.mlp.gate_proj.weight"],
                                  weights["layers.0.mlp.up_proj.weight"]]), fc1)
    cfg = json.loads((tmp_path / "st" / "config.json").read_text())
    assert cfg["mfsdp"]["swiglu"] and cfg["mfsdp"]["swiglu_module"] == "linear_fc1"

    fsdp_to_hf(ckpt, tmp_path / "hf", progress=False)
    hf = SafetensorsReader(tmp_path / "hf")
    assert torch.equal(hf.get("model.layers.1.mlp.gate.e_score_correction_bias"), bias)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias)

    # --swiglu on a checkpoint without fused weights is an error, not a silent no-op
    launch("mfsdp.train:run_in_rank", 1, args=(["--use-megatron-fsdp", "--train-iters", "1",
                                                 "--global-batch-size", "2", "--micro-batch-size",
                                                 "2", "--save", str(tmp_path / "gelu")],))
    with pytest.raises(CheckpointError, match="no fused gate/up weight"):
        fsdp_to_safetensors(resolve_checkpoint(tmp_path / "gelu"), tmp_path / "st2", swiglu=True)


@pytest.mark.slow
@pytest.mark.extended
def test_conversion_streams_a_1gib_checkpoint(tmp_path):
    """``--from hf`` and ``--to hf`` on a 1.16 GiB Llama checkpoint, each in a fresh process:
    peak memory above an idle process's stays under two of its largest tensor (measured about
    1.1x for the import and 1.0x for the export, where a whole-model conversion needs 4.7x)."""
    from mfsdp.testing.experiments import conversion_memory

    r = conversion_memory(tmp_path)
    assert r["checkpoint_bytes"] >= 2**30
    assert r["largest_tensor_bytes"] * 4 < r["checkpoint_bytes"]  # so 2 tensors << the model
    for key in ("import_peak_bytes", "export_peak_bytes"):
        assert r[key] < 2 * r["largest_tensor_bytes"], (key, r)


@pytest.mark.extended  # `make test`'s budget (22 s a family); CI runs it
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_imported_transformers_model_trains_under_tensor_parallelism(family, tmp_path):
    """#29: a ``transformers`` model imported with ``mfsdp convert --from hf`` trains under TP 2
    (with sequence parallelism, 4 ranks: TP 2 x DP 2) with the loss curve it has on 4
    data-parallel ranks without TP (1e-5), from the weights transformers saved."""
    from mfsdp.launch import launch

    make_hf(family, tmp_path / "hf")
    subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from", "hf", "--to",
                    "fsdp_dtensor", str(tmp_path / "hf"), str(tmp_path / "imported"),
                    "--no-progress"], check=True, capture_output=True)
    common = ["--use-megatron-fsdp", "--load", str(tmp_path / "imported"), "--train-iters", "4",
              "--mock-data", "--seq-length", "16", "--micro-batch-size", "1",
              "--global-batch-size", "4", "--lr", "1e-3"]
    tp = launch("mfsdp.train:run_in_rank", 4, args=(common + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel"],), timeout=300)[0]
    dp = launch("mfsdp.train:run_in_rank", 4, args=(common,), timeout=300)[0]
    assert [r["loss"] for r in tp] == pytest.approx([r["loss"] for r in dp], rel=1e-5)
    assert len(tp) == 4
