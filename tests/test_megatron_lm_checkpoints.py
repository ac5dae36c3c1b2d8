"""Megatron-LM ``torch_dist`` checkpoints, written by megatron-core 0.19.2, read by mfsdp.

``tests/fixtures/megatron_lm/make_fixture.py`` built megatron-core's own ``GPTModel`` (RMSNorm,
SwiGLU, grouped-query attention, RoPE, no biases) and saved it with ``dist_checkpointing`` as
Megatron-LM does; it recorded the model's ``state_dict()`` and its logits on fixed tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mfsdp.checkpoint.io import CheckpointError

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_lm"
EXPECTED = torch.load(FIXTURE / "expected.pt")


def _config():
    from mfsdp.models.gpt import GPT_PRESETS, with_overrides

    c = EXPECTED["config"]
    return with_overrides(GPT_PRESETS["llama-tiny"], num_layers=c["num_layers"],
                          hidden_size=c["hidden_size"], ffn_hidden_size=c["ffn_hidden_size"],
                          num_attention_heads=c["num_attention_heads"],
                          num_query_groups=c["num_query_groups"], vocab_size=c["vocab_size"],
                          rotary_base=float(c["rotary_base"]), rope_scaling_factor=None,
                          norm_epsilon=1e-5)


def _imported(tmp_path):
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import GPT

    out = megatron_lm_to_fsdp(FIXTURE / "ckpt", tmp_path / "imported", _config().to_dict())
    model = GPT(_config())
    from mfsdp.checkpoint.convert import read_full

    tensors, blobs, manifest = read_full(out)
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items()})
    return model, blobs, manifest


def test_every_weight_equals_what_megatron_core_saved(tmp_path):
    model, blobs, manifest = _imported(tmp_path)
    ours = model.state_dict()
    for key, want in EXPECTED["state_dict"].items():
        name = (key.replace("embedding.word_embeddings.", "embedding.")
                .replace("decoder.layers.", "layers.").replace("decoder.final", "final"))
        assert torch.equal(ours[name], want), key
    assert len(ours) == len(EXPECTED["state_dict"])
    assert blobs["extra"]["iteration"] == EXPECTED["iteration"]
    assert manifest["layout"]["source"] == "megatron_lm_torch_dist"


def test_the_imported_model_gives_megatron_cores_logits(tmp_path):
    model, _, _ = _imported(tmp_path)
    tokens = EXPECTED["tokens"]
    B, S = tokens.shape
    with torch.no_grad():  # the two sequences packed, each causal on its own
        logits = model(tokens.reshape(-1), torch.arange(0, B * S + 1, S)).view(B, S, -1)
    want = EXPECTED["logits"]
    rel = ((logits - want).norm() / want.norm()).item()
    assert rel < 1e-5, rel


def test_convert_command_reads_it_by_what_is_on_disk(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps(_config().to_dict()))
    out = subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from", "torch_dist",
                          "--to", "fsdp_dtensor", str(FIXTURE / "ckpt"), str(tmp_path / "out"),
                          "--model-config", str(tmp_path / "cfg.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Megatron-LM" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from",
                              "torch_dist", "--to", "fsdp_dtensor", str(FIXTURE / "ckpt"),
                              str(tmp_path / "out2")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "--model-preset or --model-config" in missing.stderr


def test_a_wrong_config_is_refused_with_the_tensor_named(tmp_path):
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import with_overrides

    wrong = with_overrides(_config(), ffn_hidden_size=128).to_dict()
    with pytest.raises(CheckpointError, match="linear_fc1.weight gives"):
        megatron_lm_to_fsdp(FIXTURE / "ckpt", tmp_path / "x", wrong)
    assert not (tmp_path / "x").exists()
