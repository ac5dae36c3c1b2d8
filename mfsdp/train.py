"""Train Llama, Qwen, Mixtral, DeepSeek-V3 or GPT models with Megatron-LM's flags: ``mfsdp train`` /
``python -m mfsdp.train``.

Launch it with ``torchrun`` (one process per GPU, or as many CPU processes as you like)::

    torchrun --nproc-per-node 2 -m mfsdp.train --use-megatron-fsdp \\
        --data-parallel-sharding-strategy optim_grads_params --train-iters 20

The backend is chosen for you: NCCL when CUDA is available, gloo otherwise. Rank 0 prints one line
per ``--log-interval`` iterations and, with ``--log-jsonl PATH``, writes one JSON object per
iteration (``iteration``, ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``elapsed_s``, ...).

The data of iteration ``i`` depends only on ``--seed`` and ``--global-batch-size``: every layout
(world size, strategy, outer size, EP size, dispatcher) trains on the same global batch, split
over the data-parallel ranks, and the loss is normalised by the global number of predicted tokens.
The same command under another layout therefore gives the same loss curve, up to floating-point
summation order.

The trainer lives in :mod:`mfsdp.trainer` (``arguments``, ``build``, ``loop``, ``trainer``,
``config``, ``checkpointing``, ``metrics``, ``signals``) and its data path in :mod:`mfsdp.data.batches`; this module is the
entry point and keeps the names users import.
"""

from __future__ import annotations

import sys

from mfsdp.data.batches import MegatronData, global_batch
from mfsdp.trainer.arguments import build_parser, check_args
from mfsdp.trainer.build import learning_rate, model_config
from mfsdp.trainer.checkpointing import restore_scheduler, scheduler_state
from mfsdp.trainer.loop import main, main_parsed, run, run_in_rank

__all__ = ["MegatronData", "build_parser", "check_args", "global_batch", "learning_rate", "main",
           "main_parsed", "model_config", "restore_scheduler", "run", "run_in_rank",
           "scheduler_state"]

if __name__ == "__main__":
    sys.exit(main())
