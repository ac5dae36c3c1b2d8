"""A complete mfsdp training script: process group and device, layout, meta-device init,
``fully_shard`` with a mixed-precision policy, gradient accumulation, clipping, an LR
schedule, checkpoints and resume.

Run it as is, on CPUs (gloo) or one GPU per rank (NCCL, chosen from the machine)::

    torchrun --nproc-per-node 4 -m mfsdp.examples.train_script --steps 12 --save-at 6
    --save ckpt torchrun --nproc-per-node 4 -m mfsdp.examples.train_script --steps 12
    --load ckpt --dp-outer 2

The second command resumes the first's step-6 checkpoint on a different layout (HSDP:
two replicas of a 2-rank shard group) and finishes the run; its losses are the first
run's. ``--moe --ep 2`` trains a mixture-of-experts model with its experts split over
2 ranks.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist

from mfsdp.layout import rank_device

__all__ = ["setup", "build", "train", "main"]

DIM = 64  # the toy models' width


def setup() -> torch.device:
    """Start the process group (torchrun set its address) and pick this rank's device:
    its GPU under NCCL where there is one, the CPU under gloo otherwise."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(device: torch.device, dp_outer: int = 1, ep: int = 1, moe: bool = False,
          lr: float = 3e-3, warmup: int = 3, steps: int = 12, optimizer: str = "adamw",
          grad_comm_dtype: torch.dtype = torch.float32):
    """The sharded model, its optimizer and LR schedule on this rank's device
    (``grad_comm_dtype=torch.bfloat16``: gradients are reduced in bf16, half the
    bytes)."""
    from torch.optim.lr_scheduler import LambdaLR

    import mfsdp
    from mfsdp.models import Block, ToyModel
    from mfsdp.models.toy_moe import MoEBlock, ToyMoE, keep_local_experts

    # Which ranks shard together, which replicate (dp_outer) and which hold which
    # experts (ep).
    layout = mfsdp.ParallelLayout(world_size=dist.get_world_size(), dp_outer=dp_outer,
                                  ep=ep, num_experts=4 if moe else None)
    groups = layout.create_groups()

    # Build on the meta device: no memory until fully_shard materialises one unit at a
    # time and keeps this rank's rows. The same seed on every rank gives every rank the
    # same model.
    torch.manual_seed(0)
    with torch.device("meta"):
        model = (ToyMoE(DIM, 2 * DIM, num_blocks=4, num_experts=4) if moe
                 else ToyModel(DIM, 2 * DIM, num_blocks=4))
    model = model.to(torch.bfloat16)  # compute in bf16 ...
    global_names = keep_local_experts(model, groups["ep"]) if moe else {}

    model = mfsdp.fully_shard_model(
        model,
        process_groups=groups,
        device=device,
        # each block is gathered, used and released
        fsdp_unit_modules=[Block, MoEBlock],
        zero_dp_strategy="optim_grads_params",  # ZeRO-3 inside a replica
        outer_dp_sharding_strategy="no_shard",  # replicas (dp_outer) keep full copies
        init_model_with_meta_device=True,
        mixed_precision_policy=mfsdp.MixedPrecisionPolicy(
            main_params_dtype=torch.float32,  # ... step on fp32 main weights
            main_grads_dtype=torch.float32,  # accumulate gradients in fp32
            grad_comm_dtype=grad_comm_dtype),  # and reduce them in fp32 (or bf16)
    )
    # checkpoints name experts by their global index
    model.fsdp_state().set_global_names(global_names)
    opt_class = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    sharded_opt = mfsdp.fully_shard_optimizer(opt_class(model.parameters(), lr=lr))

    def schedule(step: int) -> float:  # linear warm-up, then cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return model, sharded_opt, LambdaLR(sharded_opt, schedule)


def batch(step: int, device: torch.device, global_batch: int = 64):
    """This rank's slice of step ``step``'s global batch (the same data whatever the layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, DIM, generator=g)
    y = torch.tanh(x.roll(1, dims=1))  # a target the model can learn
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = global_batch // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine].to(device, torch.bfloat16), y[mine].to(device)


def train(steps: int = 12, micro_batches: int = 2, clip: float = 1.0,
          save: str | None = None, save_at: int | None = None, load: str | None = None,
          **layout) -> list[dict]:
    """Train (resuming from ``load`` if given) up to ``steps``; save at step
    ``save_at``. Returns one record per step run: loss (mean over ranks), gradient
    norm before clipping, LR."""
    from mfsdp.checkpoint import load_checkpoint, save_checkpoint

    device = rank_device()
    model, optimizer, scheduler = build(device, steps=steps, **layout)
    start = 0
    if load:
        # any layout's checkpoint reshards
        extra = load_checkpoint(load, model, optimizer)
        start = extra["iteration"]
        scheduler.load_state_dict(extra["scheduler"])
    records = []
    for step in range(start, steps):
        x, y = batch(step, device)
        optimizer.zero_grad()
        loss_sum = torch.zeros((), device=device)
        pieces = zip(x.chunk(micro_batches), y.chunk(micro_batches))
        for i, (xm, ym) in enumerate(pieces):
            # Gradients of all but the last micro-batch stay local (ZeRO-3 still
            # reduce-scatters each one into its shard; the replicas' all-reduce waits
            # for the last).
            last = i == micro_batches - 1
            with model.no_sync() if not last else model.sync():
                loss = torch.nn.functional.mse_loss(model(xm).float(), ym)
                (loss / micro_batches).backward()
            loss_sum += loss.detach() / micro_batches
        norm = optimizer.clip_grad_norm_(clip)  # the global norm, over every shard
        optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        dist.all_reduce(loss_sum)
        loss = loss_sum.item() / dist.get_world_size()
        records.append({"step": step + 1, "loss": loss, "grad_norm": norm, "lr": lr})
        if save and save_at == step + 1:
            save_checkpoint(save, model, optimizer, iteration=step + 1,
                            extra={"scheduler": scheduler.state_dict()})
    return records


def main(argv: list[str] | None = None) -> None:
    """``torchrun ... -m mfsdp.examples.train_script [options]``."""
    from mfsdp.runtime import shutdown

    p = argparse.ArgumentParser(prog="python -m mfsdp.examples.train_script",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--save", help="checkpoint directory to write")
    p.add_argument("--save-at", type=int, help="the step after which to save")
    p.add_argument("--load", help="checkpoint (directory) to resume from")
    p.add_argument("--dp-outer", type=int, default=1, help="replicas (HSDP); 1: plain FSDP")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --moe)")
    p.add_argument("--moe", action="store_true", help="a mixture-of-experts model")
    p.add_argument("--grad-comm-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the dtype gradients are reduced in")
    args = p.parse_args(argv)
    device = setup()
    comm = torch.bfloat16 if args.grad_comm_dtype == "bf16" else torch.float32
    records = train(args.steps, args.micro_batches, args.clip, args.save, args.save_at,
                    args.load, dp_outer=args.dp_outer, ep=args.ep, moe=args.moe,
                    grad_comm_dtype=comm)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks on {device.type}")
        for r in records:
            print(f"step {r['step']:3d}  loss {r['loss']:.6f}  grad norm {r['grad_norm']:.4f}  "
                  f"lr {r['lr']:.2e}")
    shutdown()


if __name__ == "__main__":
    main()
