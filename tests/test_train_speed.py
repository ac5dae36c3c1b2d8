"""``mfsdp train --fused-adam`` and ``--compile``: the two switches of the GPU tuning page.

What these tests prove: ``--fused-adam`` builds the trainer's AdamW with ``fused=True`` (on the
CPU too: PyTorch's fused AdamW has a CPU kernel) under both engines, and a 2-rank run's losses
equal the unfused run's to 1e-6 relative (measured: 3e-8; the fused kernel orders the update's
arithmetic differently, nothing else changes); with ``--optimizer sgd`` it is refused in one
line. ``--compile`` wraps every layer's forward in ``torch.compile``, dynamo then captures the
layers' graphs, and a 2-rank run's losses equal the eager run's to 1e-5 relative (measured: 4e-8;
inductor fuses the layer's elementwise kernels, which rounds in another order).

What they do not prove: that either is faster. That is a GPU measurement (docs/gpu-tuning.md).
"""

from __future__ import annotations

import pytest

from mfsdp.launch import launch
from mfsdp.trainer.config import TrainConfig

pytestmark = pytest.mark.slow
SHORT = dict(train_iters=4, global_batch_size=8, micro_batch_size=1, num_layers=2)


def _run(values: dict) -> tuple[list[float], dict]:
    """One rank of a short run of the trainer built from ``values`` (config fields): its losses,
    and what its optimizer and layers are."""
    import torch

    from mfsdp.trainer.trainer import Trainer

    torch._dynamo.utils.counters.clear()
    trainer = Trainer.from_config(TrainConfig.from_fields(**values), log=lambda *a, **k: None)
    losses = [r["loss"] for r in trainer.run()]
    inner = getattr(trainer.opt, "optimizer", trainer.opt)  # (mfsdp's wraps a torch.optim one)
    return losses, {
        "optimizer": type(inner).__name__,
        "fused": [g.get("fused") for g in trainer.opt.param_groups],
        "compiled": [hasattr(layer.forward, "_torchdynamo_orig_callable")
                     for layer in trainer.inner.layers],
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


@pytest.mark.parametrize("engine", [{"use_megatron_fsdp": True}, {}], ids=["mfsdp", "ddp"])
def test_fused_adam_builds_a_fused_adamw_that_trains_as_the_unfused_one(engine):
    values = {**SHORT, **engine}
    plain = launch(_run, 2, args=(values,), timeout=300)
    fused = launch(_run, 2, args=({**values, "fused_adam": True},), timeout=300)
    for (p_loss, p), (f_loss, f) in zip(plain, fused):  # each rank
        assert p["optimizer"] == f["optimizer"] == "AdamW"
        assert f["fused"] == [True, True] and p["fused"] == [None, None]
        assert f_loss == pytest.approx(p_loss, rel=1e-6)
        assert p_loss[-1] != p_loss[0]  # the steps changed the weights


def test_fused_adam_needs_adam():
    with pytest.raises(ValueError, match=r"^--fused-adam needs --optimizer adam \(it is "):
        TrainConfig.from_fields(optimizer="sgd", fused_adam=True)


@pytest.mark.extended  # `make test-extended` (and CI) run it: 20-40 s of inductor compiling
@pytest.mark.timeout(1200)  # inductor compiles the layer for each rank on the CPU (40 s here)
def test_compile_compiles_the_layers_and_trains_as_eager():
    values = {**SHORT, "use_megatron_fsdp": True, "train_iters": 3}
    eager = launch(_run, 2, args=(values,), timeout=300)
    compiled = launch(_run, 2, args=({**values, "compile": True},), timeout=1100)
    for (e_loss, e), (c_loss, c) in zip(eager, compiled):  # each rank
        assert c["compiled"] == [True, True] and e["compiled"] == [False, False]
        assert c["graphs"] >= 1 and e["graphs"] == 0  # dynamo captured the layers' forward
        assert c_loss == pytest.approx(e_loss, rel=1e-5)
