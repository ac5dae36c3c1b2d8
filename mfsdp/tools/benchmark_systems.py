"""The systems ``mfsdp bench`` compares (DDP, PyTorch FSDP2, each mfsdp strategy, upstream
Megatron-FSDP when installed, and the no-communication floor), built on the same model, data and
optimizer, and one training step of each; the measurements and the CLI are
:mod:`mfsdp.tools.benchmark`."""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from mfsdp.layout import rank_device

__all__ = ["SYSTEMS", "OPTIONAL_SYSTEMS", "FLOOR_SYSTEMS", "TP_SYSTEMS", "DEFAULTS", "LLAMA_1B", "LLAMA_3B", "MODEL_PRESETS",
           "build_system", "tp_mesh", "dp_rank_and_size",
           "batch", "train_step", "timed_step", "device_of", "loopback_bytes",
           "model_flops_per_token", "model_of", "loss_of", "loss_fn", "reference_parameters"]


SYSTEMS = ("ddp", "fsdp2", "fsdp2-no-reshard", "mfsdp-no_shard", "mfsdp-optim",
           "mfsdp-optim_grads", "mfsdp-optim_grads_params")


OPTIONAL_SYSTEMS = ("megatron_fsdp",)  # upstream Megatron-FSDP, ZeRO-3, when installed


# Not a system but a bound: each rank trains the whole model on its own batch, with no
# communication at all, and steps AdamW on 1/N of the parameters (the work ZeRO-3's optimizer
# does). No data-parallel system can take less time than this on the same machine.
FLOOR_SYSTEMS = ("no-comm",)


DEFAULTS = dict(dim=512, hidden=1408, blocks=6, local_batch=16, warmup=2, rounds=8, lr=1e-3,
                seed=0, model="toy", seq_length=64, vocab_size=2048, heads=None, kv_heads=None,
                device="cpu", bf16=False, peak_tflops=989.0, tp=1, recompute=False,
                compile=False, fused_adam=False)

# Systems that run with tensor parallelism (--tensor-model-parallel-size > 1): FSDP2 and mfsdp,
# each on the same (dp, tp) mesh and the same TP plan (mfsdp.models.tensor_parallel).
TP_SYSTEMS = ("fsdp2", "fsdp2-no-reshard", "mfsdp-no_shard", "mfsdp-optim", "mfsdp-optim_grads",
              "mfsdp-optim_grads_params")


def tp_mesh(cfg: dict):
    """The ``(dp, tp)`` device mesh of a TP benchmark (made once per process), or ``None``."""
    tp = cfg.get("tp", 1)
    if tp == 1:
        return None
    global _MESH
    if _MESH is None:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world % tp:
            raise SystemExit(f"mfsdp bench: --tensor-model-parallel-size {tp} does not divide "
                             f"the {world} ranks")
        _MESH = init_device_mesh(device_of(cfg).type, (world // tp, tp),
                                 mesh_dim_names=("dp", "tp"))
    return _MESH


_MESH = None


def dp_rank_and_size(cfg: dict) -> tuple[int, int]:
    """This rank's index among the ranks that read different data, and their number."""
    mesh = tp_mesh(cfg)
    if mesh is None:
        return dist.get_rank(), dist.get_world_size()
    return mesh["dp"].get_local_rank(), mesh["dp"].size()


# TinyLlama-1.1B's shape: 22 layers, width 2048, 32 heads over 4 key/value groups, SwiGLU 5632.
LLAMA_1B = dict(model="llama", dim=2048, hidden=5632, blocks=22, heads=32, kv_heads=4,
                vocab_size=32000, seq_length=2048)

# Llama 3.2 3B's layer shape (28 layers, width 3072, 24 heads over 8 key/value groups, SwiGLU
# 8192) with a 32,000-token vocabulary: 3.0B parameters, untied.
LLAMA_3B = dict(model="llama", dim=3072, hidden=8192, blocks=28, heads=24, kv_heads=8,
                vocab_size=32000, seq_length=2048)

# The shapes ``--model`` names; flags given on the command line override their fields.
MODEL_PRESETS = {"llama-1b": LLAMA_1B, "llama-3b": LLAMA_3B}


def _gpt_config(cfg: dict):
    from mfsdp.models.gpt import GPTConfig

    if cfg["model"] == "llama":
        return GPTConfig(vocab_size=cfg["vocab_size"], num_layers=cfg["blocks"],
                         hidden_size=cfg["dim"], ffn_hidden_size=cfg["hidden"],
                         num_attention_heads=cfg["heads"], num_query_groups=cfg["kv_heads"],
                         max_position_embeddings=cfg["seq_length"], normalization="RMSNorm",
                         position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                         init_method_std=0.02, **_recompute(cfg))
    return GPTConfig(vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["seq_length"],
                     num_layers=cfg["blocks"], hidden_size=cfg["dim"],
                     ffn_hidden_size=cfg["hidden"], num_attention_heads=cfg["heads"],
                     **_recompute(cfg))


def _recompute(cfg: dict) -> dict:
    """Megatron-LM's full activation recompute of every layer (``--recompute``), or nothing."""
    if not cfg.get("recompute"):
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def model_flops_per_token(cfg: dict) -> float:
    """Training FLOPs per token of the configured model: ``6 N`` for the weights (forward and
    backward) plus causal attention's ``6 L s h`` (scores and weighted sum, half masked).

    >>> round(model_flops_per_token(dict(DEFAULTS, **LLAMA_1B)) / 1e9, 2)
    6.76
    """
    n = sum(p.numel() for p in reference_parameters(cfg))
    if cfg["model"] in ("gpt", "llama"):
        n -= cfg["vocab_size"] * cfg["dim"]  # the embedding lookup is not a matmul
        return 6 * n + 6 * cfg["blocks"] * cfg["seq_length"] * cfg["dim"]
    return 6 * n


def model_of(cfg: dict):
    """(model, its FSDP unit class) of the configured shape."""
    if cfg["model"] in ("gpt", "llama"):
        from mfsdp.models.gpt import GPT, TransformerLayer

        return GPT(_gpt_config(cfg)), TransformerLayer
    if cfg["model"] != "toy":
        raise ValueError(f"model={cfg['model']!r}: use 'toy', 'gpt' or 'llama'")
    from mfsdp.models import Block, ToyModel

    return ToyModel(cfg["dim"], cfg["hidden"], cfg["blocks"]), Block


def loopback_bytes() -> int:
    """Bytes sent on the loopback interface so far (0 where there is no /proc).

    Only the transmit counter: on loopback every byte sent is also received on the same
    interface, so adding both would count it twice.
    """
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    fields = rest.split()
                    return int(fields[8])
    except OSError:
        pass
    return 0


def device_of(cfg: dict) -> torch.device:
    """The device a benchmark runs on: the rank's GPU for ``--device cuda``, else the CPU."""
    return rank_device(cuda=cfg.get("device", "cpu") == "cuda")


class _FloorOptimizer(torch.optim.AdamW):
    """AdamW over a subset of ``model``'s parameters whose ``zero_grad`` clears them all (the
    ``no-comm`` bound: the others' gradients are computed and dropped, as a shard's would be)."""

    def __init__(self, model: torch.nn.Module, params, lr: float, **options):
        super().__init__(params, lr=lr, **options)
        self._model = model

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._model.zero_grad(set_to_none=set_to_none)


def _adamw_options(cfg: dict) -> dict:
    """AdamW's implementation: ``fused`` (one kernel for every parameter; CUDA and CPU) with
    ``--fused-adam``, else PyTorch's default (``foreach`` on CUDA)."""
    if not cfg.get("fused_adam"):
        return {}
    return dict(fused=True)


def _adamw(cfg: dict):
    """A factory of the benchmark's AdamW over some parameters (the same for every system)."""
    options = _adamw_options(cfg)
    return lambda params: torch.optim.AdamW(params, lr=cfg["lr"], **options)


def build_system(system: str, cfg: dict):
    """(model, optimizer) of one system, built from the same seed on the configured device.

    With ``bf16``: DDP and FSDP2 compute in bf16 with fp32 parameters (autocast-free: FSDP2's
    ``MixedPrecisionPolicy``; DDP keeps fp32 weights and runs under autocast), mfsdp keeps fp32
    main weights and bf16 compute weights, as Megatron-FSDP does.
    """
    torch.manual_seed(cfg["seed"])
    device = device_of(cfg)
    mesh = tp_mesh(cfg)
    if mesh is not None and system not in TP_SYSTEMS:
        raise SystemExit(f"mfsdp bench: {system} does not run with tensor parallelism; with "
                         f"--tensor-model-parallel-size use {', '.join(TP_SYSTEMS)}")
    if mesh is not None and cfg["model"] == "toy":
        raise SystemExit("mfsdp bench: --tensor-model-parallel-size needs a transformer "
                         "(--model gpt); the toy MLP has no TP plan")
    with device:
        model, unit = model_of(cfg)
    if cfg.get("compile"):
        if cfg["model"] not in ("gpt", "llama"):
            raise SystemExit("mfsdp bench --compile: needs a transformer (--model gpt or llama)")
        model.compile_layers()  # each layer's forward; every system's hooks stay outside
    if mesh is not None:
        from mfsdp.models.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    lr = cfg["lr"]
    adamw = _adamw(cfg)
    if system == "no-comm":
        params = list(model.parameters())
        return model, _FloorOptimizer(model, params[dist.get_rank()::dist.get_world_size()], lr=lr,
                                      **_adamw_options(cfg))
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model, adamw(model.parameters())
    if system.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
        from torch.distributed.fsdp import fully_shard as fsdp2_shard

        reshard = system == "fsdp2"
        mp = FSDP2Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if cfg.get("bf16") else FSDP2Policy()
        where = dict(mesh=mesh["dp"]) if mesh is not None else {}
        for block in [m for m in model.modules() if isinstance(m, unit)]:
            fsdp2_shard(block, reshard_after_forward=reshard, mp_policy=mp, **where)
        fsdp2_shard(model, reshard_after_forward=reshard, mp_policy=mp, **where)
        return model, adamw(model.parameters())
    if system == "megatron_fsdp":
        try:
            import megatron_fsdp
        except ImportError:
            raise SystemExit("mfsdp bench: the system megatron_fsdp needs upstream's package "
                             "(pip install megatron-fsdp)") from None
        extra = {}
        if cfg.get("bf16"):  # bf16 compute, fp32 main weights and gradients, as for mfsdp
            model = model.to(torch.bfloat16)
            extra["mixed_precision_policy"] = megatron_fsdp.MixedPrecisionPolicy(
                main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
        return megatron_fsdp.fully_shard(model, adamw(model.parameters()),
                                         fsdp_unit_modules=[unit], zero_dp_strategy=3,
                                         device=device, **extra)
    from mfsdp import MixedPrecisionPolicy, fully_shard

    strategy = system.removeprefix("mfsdp-")
    extra = dict(cfg.get("mfsdp_kwargs", {}))
    if extra.pop("all_gather_group", False):  # all-gathers on their own communicator
        extra["fsdp_group_ag"] = dist.new_group(list(range(dist.get_world_size())))
    if mesh is not None:
        extra.update(device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp")
    if cfg.get("bf16"):
        model = model.to(torch.bfloat16)
        extra.setdefault("mixed_precision_policy", MixedPrecisionPolicy(
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32))
    return fully_shard(model, adamw(model.parameters()),
                       fsdp_unit_modules=[unit], zero_dp_strategy=strategy, device=device, **extra)


def batch(cfg: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank and system), this rank's slice."""
    rank, world = dp_rank_and_size(cfg)  # TP ranks of a replica read the same batch
    g = torch.Generator().manual_seed(cfg["seed"] * 7919 + step)
    n = cfg["local_batch"]
    device = device_of(cfg)
    if cfg["model"] in ("gpt", "llama"):  # token sequences; the targets are the next tokens
        tokens = torch.randint(0, cfg["vocab_size"], (n * world, cfg["seq_length"]), generator=g)
        tokens = tokens[rank * n:(rank + 1) * n].to(device)
        return tokens, tokens.roll(-1, dims=1).reshape(-1)
    x = torch.randn(n * world, cfg["dim"], generator=g)[rank * n:(rank + 1) * n].to(device)
    if cfg.get("bf16"):
        x = x.to(torch.bfloat16)
    return x, torch.sin(x)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss of the benchmark model's output against its target."""
    if y.dtype == torch.long:
        return torch.nn.functional.cross_entropy(out.float(), y)
    return torch.nn.functional.mse_loss(out.float(), y.float())


def loss_fn(cfg: dict):
    """The loss of a run: :func:`loss_of`, compiled for ``--compile`` (every system alike), where
    the fp32 upcast of the logits is fused into the softmax's reads in forward and backward
    instead of materialising fp32 logits and their gradient (2 x 1 GiB at 8,192 tokens and
    32,000 words)."""
    return _compiled_loss() if cfg.get("compile") else loss_of


@functools.cache
def _compiled_loss():
    """:func:`loss_of` through :func:`torch.compile`, made once per process."""
    return torch.compile(loss_of, dynamic=False)


def train_step(model, opt, x, y, loss=loss_of) -> float:
    """One training step of a system (forward, backward, optimizer step) with the ``loss``
    function (see :func:`loss_fn`); returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss = loss(model(x), y)
    loss.backward()
    opt.step()
    if hasattr(model, "wait_param_sync"):  # mfsdp ZeRO-1/2: the step ends when weights are back
        model.wait_param_sync()
    return loss.item()


def timed_step(model, opt, x, y, loss=loss_of) -> tuple[float, float]:
    """(seconds, loss) of one step: CUDA events on a GPU (host timers would stop when the work
    is queued, not done), the host clock on CPU."""
    if x.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        loss = train_step(model, opt, x, y, loss)  # .item() synchronises the loss, not the step
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, loss
    t0 = time.perf_counter()
    loss = train_step(model, opt, x, y, loss)
    return time.perf_counter() - t0, loss


def reference_parameters(cfg: dict):
    """The parameters of the unsharded benchmark model (built on ``meta``): what every system trains."""
    with torch.device("meta"):
        return list(model_of(cfg)[0].parameters())
