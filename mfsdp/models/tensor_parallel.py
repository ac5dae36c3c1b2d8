"""Megatron-LM's tensor and sequence parallelism for :class:`mfsdp.models.gpt.GPT`, expressed as
PyTorch ``parallelize_module`` plans.

The split is Megatron-LM's:

* attention: ``linear_qkv`` column-parallel (its rows are stacked per query group, so each rank
  gets whole groups: their query heads, key and value), ``linear_proj`` row-parallel; under
  multi-head latent attention, the up-projections (``linear_q_proj`` / ``linear_q_up_proj``,
  ``linear_kv_up_proj``) column-parallel by head, the down-projections whole;
* MLP: ``linear_fc1`` column-parallel, ``linear_fc2`` row-parallel; with SwiGLU each rank gets its
  slice of the gate *and* of the up projection (``[gate_r; up_r]``, a ``_StridedShard(0,
  split_factor=2)`` DTensor, so that checkpoints still hold the global ``[gate; up]``);
* the embedding vocabulary-parallel (each rank looks up its rows of the vocabulary, the partial
  results are summed), the output layer column-parallel over the vocabulary: its logits are
  gathered, or with ``vocab_parallel_loss=True`` stay split over the vocabulary (a DTensor) for a
  vocabulary-parallel cross-entropy (:func:`vocab_parallel_cross_entropy`, PyTorch's
  ``loss_parallel``), so no rank ever holds a token's logits over the whole vocabulary; tied
  embeddings (``share_embeddings_and_output_weights``) project with the embedding's own
  vocabulary rows, as Megatron-LM ties them;
* MLA's rotary key, computed whole and used by every head, gets its gradient summed over TP;
* MoE layers: the experts over EP as without TP (expert TP size 1, each TP rank runs the layer on
  the same tokens), the router whole;
* **sequence parallelism** (``sequence_parallel=True``): norms run on sequence shards (the
  token dimension split ``tp`` ways), the column-parallel inputs are all-gathered and the
  row-parallel outputs reduce-scattered instead of all-reduced; norm gradients, which each rank
  computes from its shard, are all-reduced over TP.

Parameters become DTensors over the TP mesh; :func:`mfsdp.fully_shard` then shards them over the
data-parallel dimension (``tp_dim=``)::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = apply_tensor_parallel(GPT(cfg), mesh["tp"], sequence_parallel=True)
    model, optimizer = fully_shard(model, optimizer, device_mesh=mesh, dp_shard_dim="dp",
                                   tp_dim="tp", fsdp_unit_modules=[TransformerLayer])

>>> sorted(tp_plan(_tiny(), sequence_parallel=False))[:3]
['embedding', 'layers.0.mlp.linear_fc1', 'layers.0.mlp.linear_fc2']
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "tp_plan", "tp_splits",
           "StridedColwiseParallel",
           "vocab_parallel_cross_entropy", "loss_parallel_context"]


class StridedColwiseParallel(ColwiseParallel):
    """A ``ColwiseParallel`` whose stacked ``[gate; up]`` weight is split per rank as
    ``[gate_r; up_r]`` (``_StridedShard(0, split_factor=2)``), as Megatron-LM splits SwiGLU's
    ``linear_fc1``."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters()):
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=2)]),
                requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # The output's columns are [gate_r | up_r] (_StridedShard(-1, 2)): keep them as they
        # are; ColwiseParallel would redistribute them to Shard(-1), mixing gate and up.
        return outputs.to_local() if use_local_output else outputs


def check_tensor_parallel(cfg, tp: int, sequence_parallel: bool = False) -> None:
    """Raise ``ValueError`` naming every setting of ``cfg`` that cannot be split ``tp`` ways,
    with Megatron-LM's rules."""
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallelism needs a tensor-parallel size > 1 (Megatron-LM: "
                         "--sequence-parallel with --tensor-model-parallel-size 1 does nothing)")
    if tp == 1:
        return
    problems = []
    heads = cfg.num_attention_heads
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by the tensor-parallel "
                        f"size {tp}")
    if not cfg.multi_latent_attention:
        groups = cfg.num_query_groups or heads
        if groups % tp:
            problems.append(f"num_query_groups={groups} is not divisible by the tensor-parallel "
                            f"size {tp} (each rank holds whole query groups)")
    if cfg.ffn_hidden_size % tp:
        problems.append(f"ffn_hidden_size={cfg.ffn_hidden_size} is not divisible by {tp}")
    if cfg.vocab_size % tp:
        problems.append(f"vocab_size={cfg.vocab_size} is not divisible by {tp} (the embedding "
                        "and output layer are split by vocabulary; pad it with dummy tokens: "
                        "mfsdp.trainer.build.padded_vocab_size, as the trainer does)")
    if problems:
        raise ValueError("tensor parallelism: " + "; ".join(problems))


def tp_plan(model, sequence_parallel: bool = False, vocab_parallel_loss: bool = False) -> dict:
    """The ``parallelize_module`` plan of ``model`` (a :class:`~mfsdp.models.gpt.GPT`): module
    name -> parallel style (see the module notes)."""
    from mfsdp.moe.layer import MoELayer

    cfg = model.config
    sp = sequence_parallel
    seq = dict(output_layouts=Shard(0)) if sp else {}  # row-parallel outputs: shards or whole
    plan: dict = {
        # whole embeddings (position embeddings are added to them) ...
        "embedding": RowwiseParallel(input_layouts=Replicate()),
    }
    logits = Shard(-1) if vocab_parallel_loss else Replicate()
    if cfg.share_embeddings_and_output_weights:
        # the output layer is the embedding, its weight already split by vocabulary rows: the
        # same column-parallel projection (as Megatron-LM ties them), the input whole on every
        # rank (its gradient summed over TP), the logits split by vocabulary
        plan["tied_output"] = PrepareModuleInputOutput(
            input_layouts=(Shard(0) if sp else Replicate(), None),
            desired_input_layouts=(Replicate(), None), use_local_input=False,
            output_layouts=(Shard(-1),), desired_output_layouts=(logits,),
            use_local_output=not vocab_parallel_loss)
    else:
        plan["output_layer"] = ColwiseParallel(
            input_layouts=Shard(0) if sp else Replicate(),
            # vocabulary-parallel loss: logits stay a DTensor split over the vocabulary
            output_layouts=logits, use_local_output=not vocab_parallel_loss)
    if sp:
        plan["final_layernorm"] = SequenceParallel(sequence_dim=0)
        # ... cut into sequence shards where the first layer takes them (a local slice)
        plan["layers.0"] = PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                              desired_input_layouts=(Shard(0), None, None),
                                              use_local_output=True)
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        attn = layer.self_attention
        if cfg.multi_latent_attention:
            up = "linear_q_proj" if hasattr(attn, "linear_q_proj") else "linear_q_up_proj"
            plan[f"{p}.self_attention.{up}"] = ColwiseParallel()
            plan[f"{p}.self_attention.linear_kv_up_proj"] = ColwiseParallel()
        else:
            plan[f"{p}.self_attention.linear_qkv"] = ColwiseParallel()
        plan[f"{p}.self_attention.linear_proj"] = RowwiseParallel(**seq)
        if isinstance(layer.mlp, MoELayer):
            if sp:  # the layer sees every token of the sequence; the residual keeps shards
                plan[f"{p}.mlp"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),),
                    use_local_input=True, output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(0),), use_local_output=True)
        else:
            fc1 = StridedColwiseParallel() if cfg.swiglu else ColwiseParallel()
            plan[f"{p}.mlp.linear_fc1"] = fc1
            plan[f"{p}.mlp.linear_fc2"] = RowwiseParallel(**seq)
            if sp:
                plan[f"{p}.mlp"] = PrepareModuleInput(input_layouts=(Shard(0),),
                                                      desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
        if sp:
            plan[f"{p}.input_layernorm"] = SequenceParallel(sequence_dim=0)
            plan[f"{p}.pre_mlp_layernorm"] = SequenceParallel(sequence_dim=0)
            # (local tensors inside: the projections TP leaves whole take them too)
            plan[f"{p}.self_attention"] = PrepareModuleInput(
                input_layouts=(Shard(0), None, None), desired_input_layouts=(Replicate(), None, None),
                use_local_output=True)
    return plan


def tp_splits(model) -> dict[str, tuple[int, int] | None]:
    """How ``tp_plan`` splits each parameter of ``model`` over the TP ranks, by name:
    ``(dim, split_factor)`` (rank ``r`` of ``n`` holds the ``r``-th of ``n`` pieces of each of
    the ``split_factor`` equal blocks along ``dim``: 2 for SwiGLU's ``[gate; up]``) or ``None``
    where every rank holds it whole.

    >>> splits = tp_splits(_tiny())
    >>> splits["layers.0.mlp.linear_fc2.weight"], splits["embedding.weight"]
    ((1, 1), (0, 1))
    """
    plan = tp_plan(model)
    out: dict[str, tuple[int, int] | None] = {}
    for name, _ in model.named_parameters():
        module, _, pname = name.rpartition(".")
        style = plan.get(module)
        if isinstance(style, StridedColwiseParallel):
            out[name] = (0, 2)
        elif isinstance(style, ColwiseParallel):
            out[name] = (0, 1)
        elif isinstance(style, RowwiseParallel):  # an embedding by rows, a linear by columns
            linear = isinstance(model.get_submodule(module), nn.Linear)
            out[name] = None if linear and pname == "bias" else (1 if linear else 0, 1)
        else:
            out[name] = None
    return out


def _sum_grad_over_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` forward; the backward sums its gradient over the TP group (Megatron-LM's "copy to
    the tensor-parallel region"): for a whole tensor every TP rank uses with only its own heads,
    whose gradient each rank therefore holds a part of."""
    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    y = x.view_as(x)
    if y.requires_grad:
        y.register_hook(summed)
    return y


def _shared_rope_key_hook(kv_lora_rank: int, group):
    """MLA's rotary key (the last channels of ``linear_kv_down_proj``) is shared by all heads,
    and each TP rank uses it with its own heads only: sum its gradient over TP."""

    def hook(module, args, out):
        latent, k_rot = out.split([kv_lora_rank, out.shape[-1] - kv_lora_rank], dim=-1)
        return torch.cat([latent, _sum_grad_over_tp(k_rot, group)], dim=-1)

    return hook


def apply_tensor_parallel(model, tp_mesh, sequence_parallel: bool = False,
                          vocab_parallel_loss: bool = False):
    """Split ``model`` (a :class:`~mfsdp.models.gpt.GPT`) over ``tp_mesh`` in place; return it.

    With ``sequence_parallel`` the tokens of a micro-batch (``micro_batch x seq_length``) must
    divide by the TP size. With ``vocab_parallel_loss`` the model returns its logits as a DTensor
    split over the vocabulary; compute the loss with :func:`vocab_parallel_cross_entropy`.
    """
    check_tensor_parallel(model.config, tp_mesh.size(), sequence_parallel)
    parallelize_module(model, tp_mesh, tp_plan(model, sequence_parallel, vocab_parallel_loss))
    if model.config.multi_latent_attention and tp_mesh.size() > 1:
        for layer in model.layers:
            layer.self_attention.linear_kv_down_proj.register_forward_hook(
                _shared_rope_key_hook(model.config.kv_lora_rank, tp_mesh.get_group()))
    return model


def vocab_parallel_cross_entropy(logits, targets: torch.Tensor,
                                 valid: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` (``[tokens, vocab]``: a tensor, or a DTensor split over
    the vocabulary by ``apply_tensor_parallel(..., vocab_parallel_loss=True)``) against
    ``targets`` where ``valid``. On a DTensor each rank computes the log-softmax from its slice of
    the vocabulary with two small all-reduces per token (the maximum and the sum of
    exponentials), as Megatron-LM's vocabulary-parallel cross-entropy does, instead of gathering
    the ``[tokens, vocab]`` logits. Its backward must run inside :func:`loss_parallel_context`."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits[valid].float(), targets[valid], reduction="sum")
    masked = targets.masked_fill(~valid, -100)  # a DTensor cannot be indexed by a mask
    with loss_parallel():
        loss = F.cross_entropy(logits.float(), masked, reduction="sum", ignore_index=-100)
    return loss.to_local()  # replicated: every TP rank holds the same sum


def loss_parallel_context(tp: int):
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``tp > 1`` (the backward of a
    vocabulary-parallel loss runs in it), else a context that does nothing."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def _tiny():
    from mfsdp.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=16, num_layers=1, hidden_size=8, ffn_hidden_size=8,
                         num_attention_heads=2))
