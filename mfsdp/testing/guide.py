"""What the guide's pages run: small demonstrations that doctests call (the mistake of stepping
after ``no_sync``, ordinary PyTorch idioms around a sharded model, meta-device initialisation of a
Hugging Face model, who owns what in a sharded model). Not public API."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ['step_after_no_sync', 'pytorch_idioms', 'meta_init_transformers_llama', 'describe_units']


def step_after_no_sync() -> None:
    """The mistake the guide shows: stepping after a backward whose gradients were not reduced."""
    import mfsdp
    from mfsdp.models import Block, ToyModel

    model = ToyModel(dim=8, hidden=16, num_blocks=2)
    model, optimizer = mfsdp.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         fsdp_unit_modules=[Block], zero_dp_strategy="optim")
    with model.no_sync():
        model(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # raises: the gradients were never reduced


def pytorch_idioms(strategy: str = "optim_grads_params") -> dict:
    """Ordinary PyTorch code around a sharded model: what the guide's "PyTorch idioms" page runs.

    Reads a parameter outside forward, clips gradients with ``torch.nn.utils.clip_grad_norm_``,
    steps an LR scheduler, saves and loads model and optimizer with ``torch.distributed.checkpoint``
    and gathers full weights with ``unsharded()``. Returns what each idiom saw. ``strategy`` is
    one of the sharded ones (under ``no_shard`` parameters are plain tensors).
    """
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    import mfsdp
    from mfsdp.models import Block, ToyModel

    torch.manual_seed(0)
    model = mfsdp.fully_shard_model(ToyModel(dim=16, hidden=32, num_blocks=2),
                                    fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    optimizer = mfsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    weight = model.module.blocks[0].fc1.weight  # outside forward: this rank's rows, as a DTensor
    report = {"type": type(weight).__mro__[1].__name__ if isinstance(weight, DTensor)
              else type(weight).__name__,
              "global_shape": tuple(weight.shape),
              "local_rows": weight.to_local().shape[0] if isinstance(weight, DTensor) else None,
              "full_equals_gathered": None}
    x = torch.randn(4, 16)
    model(x).pow(2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    report["grad_norm_is_global"] = isinstance(norm, DTensor) or dist.get_world_size() == 1
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    report["lr"] = optimizer.param_groups[0]["lr"]
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)  # every rank writes into rank 0's directory
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                 checkpoint_id=path[0])
        saved = weight.full_tensor().clone()
        model(x).pow(2).mean().backward()
        optimizer.step()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path[0])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        report["restored"] = torch.equal(model.module.blocks[0].fc1.weight.full_tensor(), saved)
        dist.barrier()
    with model.unsharded():
        full = model.module.blocks[0].fc1.weight  # the gathered weight, a plain tensor
        report["full_equals_gathered"] = torch.equal(full, saved)
    return report


def meta_init_transformers_llama() -> dict:
    """Build a tiny Hugging Face Llama on ``meta`` and materialise it shard by shard with the
    model's own initialiser (needs ``transformers``); return per-tensor statistics and the
    rotary ``inv_freq`` next to an eagerly built copy's."""
    import transformers

    import mfsdp

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    sharded, _ = mfsdp.fully_shard(model, torch.optim.AdamW(model.parameters()),
                                   fsdp_unit_modules=[layer], zero_dp_strategy="optim_grads_params",
                                   init_model_with_meta_device=True,
                                   param_init_fn=model._init_weights)
    full = sharded.full_parameters()
    eager = transformers.LlamaForCausalLM(config)
    return {"std": {n: round(full[n].std().item(), 3) for n in ("model.layers.0.mlp.up_proj.weight",
                                                               "lm_head.weight")},
            "eager_std": {n: round(p.std().item(), 3) for n, p in eager.named_parameters()
                          if n in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight")},
            "norm_is_ones": bool((full["model.norm.weight"] == 1).all()),
            "inv_freq_equal": torch.equal(dict(model.named_buffers())["model.rotary_emb.inv_freq"],
                                          dict(eager.named_buffers())["model.rotary_emb.inv_freq"])}


def describe_units() -> dict:
    """Who owns what in a sharded model (the guide's architecture notes): the units, the
    parameters and buckets one unit owns, the order in which the reducer launches the gradient
    buckets (the reverse of construction order, on every rank), and which unit the root prefetches
    in forward and in backward once a step has recorded the forward order."""
    import mfsdp
    from mfsdp.models import Block, ToyModel

    torch.manual_seed(0)
    model = mfsdp.fully_shard_model(ToyModel(dim=8, hidden=16, num_blocks=2),
                                    fsdp_unit_modules=[Block])
    block = model.fsdp_state().unit_by_name["blocks.0"]
    model(torch.randn(4, 8)).sum().backward()  # records the forward order
    root = model.fsdp_state().units[0]
    return {"units": [repr(u) for u in model.fsdp_state().units],
            "root prefetches": {"forward": model.fsdp_state().order.next(root, +1).name,
                                "backward": model.fsdp_state().order.next(root, -1).name},
            "blocks.0 parameters": [sp.name for sp in block.params],
            "reduction order": [b.unit or "(root)" for b in model.fsdp_state().reducer.order]}
