"""The keys of ``mfsdp sbatch`` (``SCHEMA``: type and meaning), their choices, and the presets
(``PRESETS``: a template and a value for each key it uses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mfsdp.tools.plan_time import GPUS

# key -> (type, help). bool values are written true/false; str values may be empty (= not used).
# Every value is written into the script as a literal (shell-quoted) string, except env_setup,
# which is a line of shell code by design.
SCHEMA: dict[str, tuple[type, str]] = {
    "trainer": (str, "what trains: mfsdp (`mfsdp train`) or megatron-lm (Megatron-LM's "
                     "pretrain_gpt.py with --use-megatron-fsdp; conversion: its "
                     "checkpoint_inspector.py)"),
    "launcher": (str, "torchrun: one torchrun per node starts the ranks; srun: one Slurm task per "
                      "rank, no torchrun (either way SIGTERM before the time limit reaches the "
                      "ranks only)"),
    "megatron_lm_dir": (str, "trainer=megatron-lm: the Megatron-LM checkout, absolute (empty: "
                             "MEGATRON_LM_DIR from the environment at submission)"),
    "job_name": (str, "Slurm job name (also the name of the singleton chain)"),
    "nodes": (int, "number of nodes"),
    "gpus_per_node": (int, "GPUs per node (0: a CPU job)"),
    "ranks_per_node": (int, "training processes per node (GPUs per node on GPU jobs)"),
    "cpus_per_task": (int, "CPU cores per node (torchrun) or per node's ranks together (srun)"),
    "time": (str, "time limit: MM, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"),
    "output": (str, "the batch log's file pattern (%x: job name, %j: job id)"),
    "log_dir": (str, "per-rank logs, provenance and TensorBoard: LOG_DIR/JOB_NAME/JOB_ID/ "
                     "(relative: to the submission directory)"),
    "partition": (str, "partition (empty: the cluster's default)"),
    "account": (str, "account to charge (empty: your default)"),
    "exclusive": (bool, "whole nodes only"),
    "requeue": (bool, "with save: #SBATCH --requeue, and a job that saved on the time-limit "
                      "signal requeues itself and resumes from its checkpoint"),
    "env_setup": (str, "one line of shell that activates the Python environment, e.g. 'source "
                       "~/venvs/mfsdp/bin/activate' or 'conda activate mfsdp' (empty: PYTHON "
                       "from the environment, default python3; the job stops at once when it "
                       "cannot import the trainer)"),
    "container_image": (str, "pyxis/enroot image (empty: no container)"),
    "container_mounts": (str, "more pyxis mounts, src:dst[,src:dst] (data, checkpoints; the "
                              "code is mounted from MFSDP_SRC or MEGATRON_LM_DIR)"),
    "rdzv_port": (int, "TCP port of the rendezvous on the first node (0: derived from the job "
                       "id, so that two jobs on one node do not collide)"),
    "strategy": (str, "--data-parallel-sharding-strategy"),
    "outer": (int, "--num-distributed-optimizer-instances (HSDP outer size)"),
    "outer_strategy": (str, "--outer-dp-sharding-strategy"),
    "ep": (int, "--expert-model-parallel-size"),
    "tp": (int, "--tensor-model-parallel-size (inside a node: TP talks every layer)"),
    "sequence_parallel": (bool, "with tp > 1: --sequence-parallel"),
    "cp": (int, "--context-parallel-size"),
    "distributed_timeout_minutes": (float, "--distributed-timeout-minutes: how long a collective "
                                           "waits before the job stops with a hang report"),
    "num_experts": (int, "routed experts per MoE layer (0: dense; model_args' --num-experts sets it)"),
    "dispatcher": (str, "--moe-token-dispatcher-type"),
    "flex_backend": (str, "--moe-flex-dispatcher-backend (mfsdp: torch or deepep; Megatron-LM: "
                          "deepep, hybridep or ncclep)"),
    "model_args": (str, "model-size flags passed to the trainer (split like a shell command "
                        "line; for megatron-lm, --model-preset NAME becomes Megatron-LM's "
                        "architecture flags)"),
    "micro_batch_size": (int, "--micro-batch-size"),
    "global_batch_size": (int, "--global-batch-size"),
    "seq_length": (int, "--seq-length"),
    "train_iters": (int, "--train-iters"),
    "lr": (float, "--lr: the peak learning rate"),
    "min_lr": (float, "--min-lr: where the decay ends"),
    "lr_warmup_iters": (int, "--lr-warmup-iters: linear warm-up from 0 to lr over this many "
                             "iterations"),
    "lr_decay_style": (str, "--lr-decay-style: from lr to min_lr after the warm-up"),
    "lr_decay_iters": (int, "--lr-decay-iters: iterations of warm-up and decay together (0: "
                            "train_iters)"),
    "per_token_loss": (bool, "--calculate-per-token-loss: the loss is averaged over the tokens "
                             "of the whole global batch, not per micro-batch"),
    "bf16": (bool, "--bf16"),
    "compile": (bool, "trainer=mfsdp: --compile, torch.compile of each transformer layer (fused "
                      "kernels, after a compile at the start of each job)"),
    "fused_adam": (bool, "trainer=mfsdp: --fused-adam, PyTorch's one-kernel AdamW (Megatron-LM's "
                         "Adam is fused already)"),
    "meta_init": (bool, "--init-model-with-meta-device"),
    "all_gather_group": (bool, "--create-all-gather-group"),
    "grad_reduce_in_bf16": (bool, "--grad-reduce-in-bf16"),
    "double_buffer": (bool, "--fsdp-double-buffer"),
    "nccl_ub": (bool, "--use-nccl-ub (NCCL user buffers)"),
    "data_path": (str, "DATA_PATH: Megatron .bin/.idx prefixes, optionally weighted, separated "
                       "by spaces (empty: the job stops at once unless mock_data)"),
    "mock_data": (bool, "an empty DATA_PATH trains on synthetic data (with a banner in the "
                        "log) instead of stopping the job"),
    "split": (str, "--split of DATA_PATH, e.g. 969,30,1"),
    "tokenizer_model": (str, "TOKENIZER_MODEL: a Hugging Face tokenizer directory (empty: none)"),
    "save": (str, "--save directory, made absolute (empty: no checkpoints); with an empty "
                  "load, also --load, so a requeued job resumes"),
    "save_interval": (int, "--save-interval"),
    "signal_seconds": (int, "with save: SIGTERM this many seconds before the time limit "
                            "(#SBATCH --signal) and --exit-signal-handler: the time a save may "
                            "take (0: off)"),
    "max_restarts": (int, "launcher=torchrun: torchrun --max-restarts, restarts after a rank "
                          "dies (0: none)"),
    "ckpt_format": (str, "--ckpt-format"),
    "load": (str, "--load directory (empty: start fresh); with save, only until the save "
                  "directory holds a checkpoint, which a requeued job resumes from"),
    "log_interval": (int, "--log-interval"),
    "log_jsonl": (str, "trainer=mfsdp: --log-jsonl file, the metrics of every iteration "
                       "(relative: to the job's log directory LOG_DIR/JOB_NAME/JOB_ID/"
                       "attempt-N, beside ranks/; empty: none)"),
    "wandb_project": (str, "trainer=megatron-lm: the W&B project, used when WANDB_API_KEY is set "
                           "at submission (empty: the job name)"),
    "recompute": (str, "activation recomputation: none; full (every layer: "
                       "--recompute-granularity full --recompute-method uniform "
                       "--recompute-num-layers 1); block:N (the first N layers: --recompute-method "
                       "block --recompute-num-layers N); selective (--recompute-granularity "
                       "selective)"),
    "allow_over_memory": (bool, "render a script whose planned peak per GPU is over what the "
                                "gpu leaves (4 GiB kept), with a warning, instead of refusing it"),
    "extra_args": (str, "more trainer flags (split like a shell command line); a flag the "
                        "script writes itself, or that a key sets, is refused: set the key"),
    "src": (str, "conversion input checkpoint"),
    "dst": (str, "conversion output directory"),
    "from_format": (str, "conversion --from"),
    "to_format": (str, "conversion --to"),
    "param_map": (str, "--param-to-param-group-map file (empty: none)"),
    "model_preset": (str, "--model-preset of a Megatron-LM checkpoint's model (empty: none)"),
    "swiglu": (bool, "--swiglu (split/join fused gate and up projections)"),
    "gpu": (str, "the GPU of mfsdp plan --gpu: train scripts are planned for its memory and "
                 "priced with its peak and links; mfsdp bandwidth sets its link assumptions "
                 "beside the measured bandwidths"),
    "size_mib": (str, "mfsdp bandwidth --size-mib: the gathered (full) sizes in MiB, separated "
                      "by spaces; the largest gives the mfsdp plan flags"),
}

_FORMATS = ("torch_dist", "megatron_lm", "mfsdp_full", "fsdp_dtensor", "safetensors", "hf",
            "megatron_fsdp")
CHOICES = {
    "trainer": ("mfsdp", "megatron-lm"),
    "launcher": ("torchrun", "srun"),
    "strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "outer_strategy": ("no_shard", "optim"),
    "dispatcher": ("allgather", "alltoall", "flex"),
    "flex_backend": ("torch", "deepep", "hybridep", "ncclep"),
    "ckpt_format": ("fsdp_dtensor", "torch_dist"),
    "lr_decay_style": ("constant", "linear", "cosine"),
    "from_format": _FORMATS,
    "to_format": _FORMATS,
    "gpu": tuple(sorted(GPUS)),
}
FLEX_BACKENDS = {"mfsdp": ("torch", "deepep"), "megatron-lm": ("deepep", "hybridep", "ncclep")}

_SLURM = dict(trainer="mfsdp", megatron_lm_dir="", partition="", account="", exclusive=False,
              env_setup="", container_image="", container_mounts="", log_dir="logs")
# What a template reads but its presets do not take from --set: the bandwidth script runs
# mfsdp's own tool, so the shared Python check (_python.sbatch.j2) looks for mfsdp.
TEMPLATE_VALUES = {"bandwidth": dict(trainer="mfsdp")}
_TRAIN = dict(_SLURM, launcher="torchrun", rdzv_port=0, requeue=True, strategy="optim_grads_params",
              outer=1, outer_strategy="no_shard", ep=1, tp=1, sequence_parallel=True, cp=1,
              distributed_timeout_minutes=10, num_experts=0, dispatcher="alltoall",
              flex_backend="torch", meta_init=False, all_gather_group=False,
              grad_reduce_in_bf16=False, double_buffer=False, nccl_ub=False, save="",
              save_interval=1000, ckpt_format="fsdp_dtensor", load="", signal_seconds=120,
              max_restarts=0, log_interval=1, log_jsonl="", wandb_project="", extra_args="",
              recompute="none", allow_over_memory=False, gpu="h100",
              bf16=False, data_path="", mock_data=False, split="969,30,1", tokenizer_model="",
              min_lr=0.0, lr_warmup_iters=0, lr_decay_style="linear", lr_decay_iters=0,
              per_token_loss=False, compile=False, fused_adam=False)

# Whole 8-GPU nodes, one rank per GPU: what every GPU preset asks of Slurm. mfsdp train compiles
# the layers and fuses AdamW there, the GPU tuning page's first step (25.6% -> 42.9% MFU on an
# H100); the MoE preset leaves compile off (see deepseek-v3).
_GPU_NODES = dict(gpus_per_node=8, ranks_per_node=8, cpus_per_task=64, output="%x-%j.log",
                  exclusive=True, grad_reduce_in_bf16=True, per_token_loss=True, compile=True,
                  fused_adam=True)
# What the upstream guide's Megatron-LM scripts add for Megatron-FSDP on GPUs: the persistent
# double buffer and NCCL user buffers (Megatron-LM only: mfsdp train refuses --use-nccl-ub);
# Megatron-LM has no --compile, and its Adam is fused already.
_MEGATRON_LM_GPU = dict(double_buffer=True, nccl_ub=True, compile=False, fused_adam=False)

# The real architectures (RMSNorm, RoPE, grouped-query or multi-latent attention, SwiGLU) are
# the trainer's presets; the planner reads the same definitions (``mfsdp plan``).
_LLAMA3_8B = "--model-preset llama3-8b"

# The learning-rate schedules and batch sizes of published pretraining recipes, so that a preset
# submitted as it is trains on the schedule its model was tuned with (the time limit is one job's:
# a job saves on the time-limit signal and requeues until train_iters). Sources:
# - Llama 3 (8B, 8B at 64K tokens, 70B, 3.1 405B): Megatron-Bridge's
#   recipes/llama/llama3.py (llama3_8b_pretrain_config, llama3_8b_64k_pretrain_config,
#   llama3_70b_pretrain_config, llama31_405b_pretrain_config): 1,168,251 iterations of 512
#   sequences, 2,000 warm-up iterations, cosine decay from 3e-4 to 3e-5 (recipes/common.py,
#   _pretrain_common).
# - DeepSeek-V3: Megatron-Bridge's recipes/deepseek/deepseek_v3.py
#   (deepseek_v3_pretrain_config_32nodes, 32 nodes as here): 1,000,000 iterations of 4,096
#   sequences, 2,000 warm-up iterations, the same cosine decay from 3e-4 to 3e-5.
_BRIDGE_LLAMA3 = dict(global_batch_size=512, train_iters=1_168_251, lr=3e-4, min_lr=3e-5,
                      lr_warmup_iters=2000, lr_decay_style="cosine")
_BRIDGE_DEEPSEEK_V3 = dict(global_batch_size=4096, train_iters=1_000_000, lr=3e-4, min_lr=3e-5,
                           lr_warmup_iters=2000, lr_decay_style="cosine")

# Each trainer's variant recomputes the fewest layers that leave 5 GiB of 80 spare in the plan of
# its own layer (schedule.recompute_phrase): mfsdp train's measured layer, or Megatron-LM's
# Transformer Engine layer (its default --transformer-impl), which keeps fewer activations.
_DEEPSEEK_V3_MODEL = "--model-preset deepseek-v3 --moe-aux-loss-coeff 0.0001 --moe-grouped-gemm"


@dataclass(frozen=True)
class Preset:
    """A template and the values of every variable it uses."""

    template: str
    # may name values: "{train_iters:,} iterations"; {layout}: the script's parallel layout,
    # recomputation and precision, from its values (header.py)
    description: str
    values: dict
    megatron_lm: dict = field(default_factory=dict)  # values that differ with trainer=megatron-lm
    recipe: str = ""  # the Megatron-Bridge recipe whose batch and schedule the values are
    # > 0: a global_batch_size not given with --set is micro_batch_size x data-parallel ranks
    # x this, so that the preset renders at any node count (checks.resolve)
    micro_batches: int = 0


PRESETS: dict[str, Preset] = {
    "cpu-smoke": Preset("train", "CPU smoke test: the small GPT trained for {train_iters:,} "
                        "iterations {layout}; runs anywhere Slurm runs.", dict(
                            _TRAIN, job_name="mfsdp-cpu-smoke", nodes=1, gpus_per_node=0,
                            ranks_per_node=2, cpus_per_task=2, time="00:10:00",
                            output="mfsdp-cpu-smoke-%j.log", model_args="--model-preset gpt-tiny",
                            micro_batch_size=2, global_batch_size=8, seq_length=64, train_iters=10,
                            # the recipes' shape (cosine to lr/10), warm-up cut to 2 of the
                            # 10 iterations so that every phase of the schedule runs
                            lr=0.003, min_lr=0.0003, lr_warmup_iters=2,
                            lr_decay_style="cosine", mock_data=True)),
    "gpu-smoke": Preset("train", "GPU smoke test: a 4-layer Llama-3-8B-shaped model trained "
                        "for {train_iters:,} iterations {layout}; one sequence per data-parallel "
                        "rank a step ({global_batch_size:,}), saving every {save_interval:,} "
                        "iterations and resuming if requeued; minutes, before you book a real "
                        "preset.", dict(
                            _TRAIN, **_GPU_NODES, job_name="mfsdp-gpu-smoke", nodes=1,
                            time="00:30:00", model_args=_LLAMA3_8B + " --num-layers 4",
                            micro_batch_size=1, global_batch_size=8, seq_length=4096,
                            train_iters=50, lr=3e-4, min_lr=3e-5, lr_warmup_iters=5,
                            lr_decay_style="cosine", mock_data=True, bf16=True,
                            meta_init=True, save="checkpoints/gpu-smoke", save_interval=25,
                            log_jsonl="gpu-smoke.jsonl"), _MEGATRON_LM_GPU,
                        micro_batches=1),
    "bandwidth": Preset("bandwidth", "Bus bandwidth of FSDP's all-gather and reduce-scatter on "
                        "{nodes} x {ranks_per_node} ranks (nodes x ranks per node; mfsdp bandwidth "
                        "under torchrun): "
                        "inside each node, across nodes and over the job, beside mfsdp plan's "
                        "link assumptions for --gpu {gpu}, with the --nvlink-gbps and "
                        "--network-gbps flags to pass to mfsdp plan; minutes, before the first "
                        "multi-node job.", dict(
                            job_name="mfsdp-bandwidth", nodes=2, gpus_per_node=8,
                            ranks_per_node=8, cpus_per_task=64, time="00:15:00",
                            output="%x-%j.log", log_dir="logs", partition="", account="",
                            # the node to itself: another job's traffic would lower the figures
                            exclusive=True, env_setup="", container_image="",
                            container_mounts="", rdzv_port=0, gpu="h100",
                            size_mib="256 1024")),
    # mfsdp train: context parallelism 2 instead of recomputing 3 layers (47.2 GiB, not 70.1,
    # and the planner's step is 2% shorter); Megatron-LM's Transformer Engine layer fits
    # without CP (54.4 GiB), and CP 2 would not shorten its step (34.30 s, not 34.11 s).
    "llama3-8b": Preset("train", "Llama-3-8B-style dense model {layout}.", dict(
                            _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-8b", nodes=2,
                            time="04:00:00", model_args=_LLAMA3_8B, cp=2,
                            micro_batch_size=1, seq_length=8192, **_BRIDGE_LLAMA3,
                            bf16=True, meta_init=True,
                            save="checkpoints/llama3-8b", save_interval=100,
                            log_jsonl="llama3-8b.jsonl"),
                        dict(_MEGATRON_LM_GPU, cp=1),
                        recipe="llama3_8b_pretrain_config"),
    "llama3-8b-container": Preset(
        "train", "The llama3-8b job in NGC's PyTorch container (pyxis/enroot; the image's torch, "
        "mfsdp mounted from its source checkout) {layout}.", dict(
            _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-8b", nodes=2, time="04:00:00",
            model_args=_LLAMA3_8B, cp=2, micro_batch_size=1, seq_length=8192,
            **_BRIDGE_LLAMA3, bf16=True, meta_init=True, save="checkpoints/llama3-8b",
            save_interval=100, log_jsonl="llama3-8b.jsonl",
            container_image="nvcr.io#nvidia/pytorch:25.10-py3"),
        dict(_MEGATRON_LM_GPU, cp=1),
        recipe="llama3_8b_pretrain_config"),
    "deepseek-v3": Preset("train", "DeepSeek-V3-style MoE (256 routed experts, top-8, "
                          "group-limited sigmoid routing) {layout}.", dict(
                              # compile off: the routed experts' token counts change every
                              # step, and each new count would compile the MoE layers again;
                              # fp32 gradient reduction: its shard groups have 256 ranks
                              _TRAIN, **dict(_GPU_NODES, compile=False, grad_reduce_in_bf16=False),
                              job_name="mfsdp-deepseek-v3", nodes=32,
                              time="24:00:00", model_args=_DEEPSEEK_V3_MODEL, recompute="full",
                              ep=32, num_experts=256,
                              dispatcher="flex", flex_backend="deepep", micro_batch_size=1,
                              seq_length=4096, **_BRIDGE_DEEPSEEK_V3,
                              bf16=True, meta_init=True, all_gather_group=True,
                              save="checkpoints/deepseek-v3", save_interval=50,
                              log_jsonl="deepseek-v3.jsonl"),
                          # (MLA and MoE layers keep the planner's GPT estimate under either
                          # layer; the Transformer Engine plan's activations are 0.14 GiB more
                          # at its peak, in backward: 59 of 61 layers, not 58, keep 5 GiB)
                          dict(_MEGATRON_LM_GPU, flex_backend="hybridep", recompute="block:59"),
                          recipe="deepseek_v3_pretrain_config_32nodes"),
    "llama3-70b": Preset("train", "Llama-3-70B-style dense model {layout}.", dict(
                             _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-70b", nodes=8,
                             time="24:00:00",
                             model_args="--model-preset llama3-70b", recompute="block:26",
                             tp=4, micro_batch_size=1, seq_length=8192, **_BRIDGE_LLAMA3,
                             bf16=True, meta_init=True,
                             save="checkpoints/llama3-70b", save_interval=40,
                             log_jsonl="llama3-70b.jsonl"),
                         dict(_MEGATRON_LM_GPU, recompute="none"),
                         recipe="llama3_70b_pretrain_config"),
    "llama3.1-405b": Preset("train", "Llama-3.1-405B-shaped dense model {layout}. "
                            "(Megatron-Bridge's published Megatron-FSDP run uses TP 2 on 128 "
                            "GB200s, which hold 186 GiB; on 80 GiB GPUs TP 2 needs 79 nodes.)",
                            dict(
                                _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3.1-405b", nodes=32,
                                time="48:00:00",
                                model_args="--model-preset llama3.1-405b", recompute="full",
                                tp=4, sequence_parallel=True, micro_batch_size=1,
                                seq_length=8192, **_BRIDGE_LLAMA3,
                                bf16=True, meta_init=True, all_gather_group=True,
                                save="checkpoints/llama3.1-405b", save_interval=24,
                                log_jsonl="llama3.1-405b.jsonl"),
                            dict(_MEGATRON_LM_GPU, recompute="block:112"),
                            recipe="llama31_405b_pretrain_config"),
    "llama3-8b-long": Preset("train", "Llama-3-8B-style model on sequences of "
                             "{seq_length:,} tokens (attention exact over all of each) {layout}.",
                             dict(
                                 _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-8b-long", nodes=2,
                                 time="12:00:00",
                                 model_args=_LLAMA3_8B, recompute="full",
                                 cp=4, micro_batch_size=1, seq_length=65536,
                                 **_BRIDGE_LLAMA3, bf16=True,
                                 meta_init=True, save="checkpoints/llama3-8b-long",
                                 save_interval=5, log_jsonl="llama3-8b-long.jsonl"),
                             dict(_MEGATRON_LM_GPU, recompute="block:10"),
                             recipe="llama3_8b_64k_pretrain_config"),
    "convert": Preset("convert", "Checkpoint conversion: a Megatron-LM torch_dist checkpoint to "
                      "fsdp_dtensor, on one node (mfsdp convert: CPU only; Megatron-LM's "
                      "checkpoint_inspector.py: 8 GPUs).", dict(
                          _SLURM, job_name="mfsdp-convert", gpus_per_node=0, cpus_per_task=16,
                          time="02:00:00",
                          output="%x-%j.log", src="checkpoints/megatron",
                          dst="checkpoints/fsdp_dtensor/iter_0001000", from_format="torch_dist",
                          to_format="fsdp_dtensor", param_map="", model_preset="llama3-8b",
                          swiglu=False),
                      # checkpoint_inspector.py converts on GPUs (NCCL), under torchrun
                      dict(gpus_per_node=8, exclusive=True, swiglu=True)),
}
