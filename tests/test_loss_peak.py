"""The planner's ``logits`` term against the loss's bytes at a real step's peak.

One training step (forward, the trainer's loss, backward, optimizer step) of the trainer's own
model runs under a live-storage tracker (:class:`mfsdp.testing.loss_peak.LiveBytes`, the bytes
of every storage an operator creates until it is freed, as PyTorch's ``MemTracker`` counts them).
At these shapes the loss dominates the transients, so the step's peak falls in the loss; the
bytes the loss allocated and still holds there must be the planner's term, at two vocabulary
sizes and sequence lengths (the term scales with ``s b v``) and under TP. The planner's former
term, the kept log-probabilities alone (``4 s b v / t``), is a third of the measured bytes at TP 1
and fails.
"""

from __future__ import annotations

import dataclasses

import pytest

from mfsdp.launch import launch
from mfsdp.testing.loss_peak import measured_step
from mfsdp.tools.plan import PRESETS, Layout
from mfsdp.tools.plan_terms import logits

TOLERANCE = 0.01  # the loss skips each sequence's last token: (s - 1) / s of the logits at TP 1
HIDDEN = 128

CASES = [  # (vocabulary, sequence length, TP)
    pytest.param(32000, 512, 1, id="v32k-s512"),
    pytest.param(16000, 1024, 1, id="v16k-s1024"),
    pytest.param(32000, 512, 2, id="v32k-s512-tp2", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("vocab, seq, tp", CASES)
def test_loss_bytes_at_the_peak_match_the_planner(vocab, seq, tp):
    flags = ("--hidden-size", str(HIDDEN), "--ffn-hidden-size", str(HIDDEN * 11 // 4),
             "--num-attention-heads", "4", "--vocab-size", str(vocab))
    kw = dict(seq_length=seq, tp=tp, strategy="optim_grads_params")
    model = dataclasses.replace(PRESETS["llama-tiny"], hidden=HIDDEN, vocab=vocab)
    planned = logits(model, Layout(world_size=tp, **kw))
    for rank, r in enumerate(launch(measured_step, tp, args=("llama-tiny", kw, flags),
                                    timeout=300)):
        assert r["peak_phase"] in ("loss", "loss backward"), (rank, r["peak_phase"])
        held = r["at_peak"].get("loss", 0) + r["at_peak"].get("loss backward", 0)
        assert held == pytest.approx(planned, rel=TOLERANCE), (rank, held / planned)
        assert r["tokens"] * r["vocab"] == seq * vocab // tp  # the term's s b v / t
