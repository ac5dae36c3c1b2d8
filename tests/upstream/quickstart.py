# Upstream Megatron-FSDP's README "Quick Start", verbatim except for two mechanical changes:
#   - the import names mfsdp instead of megatron_fsdp;
#   - CPU instead of CUDA: the torch.cuda.set_device line is dropped and .to("cuda") reads .to("cpu").
# After the verbatim part, checks that the checkpoint really round-trips (run by
# tests/test_upstream_quickstart.py under torchrun with 2 gloo ranks).
import torch
from mfsdp import (
    fully_shard_model,
    fully_shard_optimizer,
)

# Initialize Torch Distributed.
torch.distributed.init_process_group()

# Fully-shard the model.
model = torch.nn.Transformer()
fsdp_model = fully_shard_model(
    module=model,
    fsdp_unit_modules=[
        torch.nn.TransformerEncoder,
        torch.nn.TransformerDecoder
    ]
)

# Fully-shard the optimizer.
toy_adam = torch.optim.AdamW(params=fsdp_model.parameters(), lr=0.01)
optimizer = fully_shard_optimizer(optimizer=toy_adam)

# Forward pass.
inp = torch.randn(1, 512, 512).to("cpu")
tgt = torch.randn(1, 512, 512).to("cpu")
output = fsdp_model(inp, inp)

# Backward pass.
torch.nn.functional.mse_loss(output, tgt).backward()

# Optimizer step.
optimizer.step()
optimizer.zero_grad()

# Checkpoint the model and optimizer.
torch.distributed.checkpoint.save({
    "model": fsdp_model.state_dict(),
    "optimizer": optimizer.state_dict(),
}, checkpoint_id="ckpt/")

# Load the saved checkpoint.
ckpt = {
    "model": fsdp_model.state_dict(),
    "optimizer": optimizer.state_dict(),
}
torch.distributed.checkpoint.load(state_dict=ckpt, checkpoint_id="ckpt/")
fsdp_model.load_state_dict(ckpt["model"], strict=False)
optimizer.load_state_dict(ckpt["optimizer"])

# ---- end of the README's code; the checks follow --------------------------------------------
from torch.distributed.tensor import DTensor  # noqa: E402


def snapshot():
    model_sd = {k: v.full_tensor().clone() for k, v in fsdp_model.state_dict().items()}
    opt_sd = {(i, k): v.full_tensor().clone() for i, st in optimizer.state_dict()["state"].items()
              for k, v in st.items() if isinstance(v, DTensor)}
    return model_sd, opt_sd


saved = snapshot()
assert saved[1], "the optimizer state dict holds no sharded state"
# Train on: weights and Adam moments move away from the checkpoint ...
fsdp_model.train()
torch.nn.functional.mse_loss(fsdp_model(inp, inp), tgt).backward()
optimizer.step()
optimizer.zero_grad()
moved = snapshot()
assert any(not torch.equal(moved[0][k], v) for k, v in saved[0].items())
# ... and loading the checkpoint with the README's lines brings back exactly what was saved.
ckpt = {"model": fsdp_model.state_dict(), "optimizer": optimizer.state_dict()}
torch.distributed.checkpoint.load(state_dict=ckpt, checkpoint_id="ckpt/")
fsdp_model.load_state_dict(ckpt["model"], strict=False)
optimizer.load_state_dict(ckpt["optimizer"])
loaded = snapshot()
for part in (0, 1):
    assert loaded[part].keys() == saved[part].keys()
    for k, v in saved[part].items():
        assert torch.equal(loaded[part][k], v), k
if torch.distributed.get_rank() == 0:
    print(f"QUICKSTART OK: {len(saved[0])} model tensors, {len(saved[1])} optimizer tensors")
torch.distributed.destroy_process_group()
