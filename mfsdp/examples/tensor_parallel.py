"""FSDP over tensor parallelism: a Hugging Face Llama made tensor-parallel with
PyTorch's ``parallelize_module`` and its own published TP plan, then sharded by
``fully_shard`` over the data-parallel dimension of a ``(dp, tp)`` mesh.

Run it on four CPU ranks (two data-parallel replicas of a two-way tensor-parallel
model)::

    torchrun --nproc-per-node 4 -m mfsdp.examples.tensor_parallel

or from Python with :func:`mfsdp.launch.launch` (what the guide's recipe does)::

    launch("mfsdp.examples.tensor_parallel:train", 4, kwargs=dict(dp=2, tp=2))
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

__all__ = ["build_model", "apply_tp_plan", "train", "main"]


def build_model(seed: int = 0):
    """A tiny random Llama (grouped-query attention, SwiGLU); nothing is downloaded."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def apply_tp_plan(model, tp_mesh):
    """Make ``model`` tensor-parallel over ``tp_mesh`` with its ``base_model_tp_plan``
    (``"colwise"`` / ``"rowwise"`` per projection) and PyTorch's
    ``parallelize_module``."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]()
            for name, kind in model.config.base_model_tp_plan.items()}
    # the plan's names are the base model's
    parallelize_module(model.model, tp_mesh, plan)
    return model


def train(dp: int = 2, tp: int = 2, steps: int = 8,
          strategy: str = "optim_grads_params", tp_plan: bool = True) -> dict:
    """Train on ``dp x tp`` ranks (a collective call); return the losses and what each
    rank holds.

    With ``tp_plan=False`` the model stays whole on every TP rank (replicated over
    TP), which is what the plan saves.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from mfsdp import fully_shard

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model()
    if tp_plan:
        model = apply_tp_plan(model, mesh["tp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fully_shard(
        model, optimizer, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
        fsdp_unit_modules=[LlamaDecoderLayer], zero_dp_strategy=strategy)

    # Every TP rank of a replica reads the same batch; replicas read different ones.
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (4 * dp, 32), generator=g)
        mine = tokens.chunk(dp)[mesh["dp"].get_local_rank()]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over(loss.detach(), mesh["dp"].get_group()))
    q = model.module.model.layers[0].self_attn.q_proj.weight
    return {
        "losses": losses,
        "q_proj": (f"{tuple(q.shape)} {tuple(q.placements)} "
                   f"on mesh {q.device_mesh.mesh_dim_names}"),
        "bytes": sum(b.main_shard.numel() * b.main_shard.element_size()
                     for b in model.fsdp_state().buckets),
    }


def _mean_over(value: torch.Tensor, group) -> float:
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m mfsdp.examples.tensor_parallel [--tp 2]``."""
    from mfsdp.runtime import shutdown

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
    out = train(dp=world // args.tp, tp=args.tp, steps=args.steps)
    if dist.get_rank() == 0:
        print("q_proj:", out["q_proj"])
        print("losses:", " ".join(f"{x:.3f}" for x in out["losses"]))
    shutdown(exit_code=0)


if __name__ == "__main__":
    main()
