"""Tensor parallelism for :class:`mfsdp.models.gpt.GPT` with PyTorch's ``parallelize_module``.

Megatron-LM's split of a transformer layer: ``linear_qkv`` column-parallel (its rows are stacked
per query group, so each rank gets whole groups: their query heads, key and value), ``linear_proj``
row-parallel; ``linear_fc1`` column-parallel and ``linear_fc2`` row-parallel. Embeddings, norms and
the output layer stay whole on every TP rank. The parameters become DTensors over the TP mesh,
which :func:`mfsdp.fully_shard` then shards over the data-parallel dimension (``tp_dim=``)::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = apply_tensor_parallel(GPT(cfg), mesh["tp"])
    model, optimizer = fully_shard(model, optimizer, device_mesh=mesh, dp_shard_dim="dp",
                                   tp_dim="tp", fsdp_unit_modules=[TransformerLayer])

>>> sorted(tp_plan_names())
['layers.*.mlp.linear_fc1', 'layers.*.mlp.linear_fc2', 'layers.*.self_attention.linear_proj', 'layers.*.self_attention.linear_qkv']
"""

from __future__ import annotations

__all__ = ["apply_tensor_parallel", "tp_plan_names", "check_tensor_parallel"]

_PLAN = {
    "layers.*.self_attention.linear_qkv": "colwise",
    "layers.*.self_attention.linear_proj": "rowwise",
    "layers.*.mlp.linear_fc1": "colwise",
    "layers.*.mlp.linear_fc2": "rowwise",
}


def tp_plan_names() -> dict[str, str]:
    """The plan: module name pattern -> ``"colwise"`` / ``"rowwise"``."""
    return dict(_PLAN)


def check_tensor_parallel(cfg, tp: int) -> None:
    """Raise ``ValueError`` naming the setting when ``cfg`` cannot be split ``tp`` ways."""
    if tp == 1:
        return
    groups = cfg.num_query_groups or cfg.num_attention_heads
    problems = []
    if cfg.num_attention_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_attention_heads} is not divisible by "
                        f"the tensor-parallel size {tp}")
    if groups % tp:
        problems.append(f"num_query_groups={groups} is not divisible by the tensor-parallel "
                        f"size {tp} (each rank holds whole query groups)")
    if cfg.ffn_hidden_size % tp:
        problems.append(f"ffn_hidden_size={cfg.ffn_hidden_size} is not divisible by {tp}")
    if cfg.swiglu:
        problems.append("swiglu=True: linear_fc1 stacks gate and up, which a column split "
                        "would give to different ranks; use a GELU MLP with this plan")
    if cfg.num_experts:
        problems.append("num_experts: MoE layers are not split by this plan")
    if cfg.multi_latent_attention:
        problems.append("multi_latent_attention: MLA's projections are not split by this plan")
    if problems:
        raise ValueError("tensor parallelism: " + "; ".join(problems))


def apply_tensor_parallel(model, tp_mesh):
    """Split ``model`` (a :class:`~mfsdp.models.gpt.GPT`) over ``tp_mesh`` in place; return it."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    check_tensor_parallel(model.config, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in _PLAN.items()})
    return model
