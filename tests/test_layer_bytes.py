"""The planner's per-layer activation term against what the trainer's Llama layer saves."""

import pytest

from mfsdp.testing.layer_bytes import saved_bytes
from mfsdp.tools.plan import Layout, ModelConfig
from mfsdp.tools.plan_terms import layer_activations


def test_the_planners_layer_term_is_what_the_trainers_llama_layer_saves_for_backward():
    """One bf16 layer at a shape none of the formula's coefficients came from (head width 48,
    not hidden / heads; 3 query heads per key head; 640 tokens): the distinct storages it saves
    for backward (``saved_tensors_hooks``) equal ``layer_activations`` within 0.5%."""
    hidden, ffn, heads, kv_heads, head_dim, seq = 384, 1000, 6, 2, 48, 640
    measured = saved_bytes(hidden, ffn, heads, kv_heads, seq, head_dim=head_dim)
    model = ModelConfig(num_layers=1, hidden=hidden, ffn_hidden=ffn, num_heads=heads, vocab=64,
                        num_kv_heads=kv_heads, head_dim=head_dim)
    planned = layer_activations(model, Layout(world_size=1, seq_length=seq))
    assert planned == pytest.approx(measured, rel=0.005), (planned, measured)
    korthikanti = 34 * seq * hidden  # the GPT estimate the planner used before: far off here
    assert abs(korthikanti - measured) > 0.1 * measured
