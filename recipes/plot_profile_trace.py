"""
Profile a training step: where the all-gathers and reduce-scatters go
=====================================================================

Run ``mfsdp train`` with Megatron-LM's profiling flags on two CPU ranks, read the
``torch.profiler`` trace it writes, and draw rank 0's timeline of one iteration with mfsdp's
collective labels.

**What you will learn**

* the trainer flags that write a trace (``--profile --use-pytorch-profiler``, the iteration
  window, the ranks, ``--tensorboard-dir``), as you would pass them on a cluster;
* where the trace lands and how to read it without TensorBoard (it is Chrome trace JSON:
  Perfetto opens it too);
* what ZeRO-3 does in one step: an all-gather per unit before its forward and again before its
  backward, a reduce-scatter per unit after its backward.
"""

# %%
# Train with the profiler on
# --------------------------
# The same command runs on GPUs (the trace then has CUDA kernels too). Iterations 3 and 4 are
# traced (``--profile-step-end`` is exclusive, as in Megatron-LM) on rank 0.
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

out = Path(tempfile.mkdtemp())
command = [
    sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
    "--standalone",
    "-m", "mfsdp.train", "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy", "optim_grads_params",
    "--model-preset", "gpt-tiny", "--train-iters", "4", "--log-interval", "4",
    "--profile", "--use-pytorch-profiler", "--profile-step-start", "3",
    "--profile-step-end", "5", "--profile-ranks", "0",
    "--tensorboard-dir", str(out / "tb"),
]
done = subprocess.run(command, capture_output=True, text=True,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))
assert done.returncode == 0, done.stderr[-2000:]
for line in done.stdout.splitlines():
    if line.startswith("iteration"):
        print(line)

# %%
# Read the trace
# --------------
# One file per profiled rank under ``--tensorboard-dir/profile``. Every event has a name, a
# start (``ts``) and a duration (``dur``) in microseconds; mfsdp's collectives are the events
# named ``mfsdp::all_gather``, ``mfsdp::reduce_scatter`` and ``mfsdp::all_reduce``, the trainer's
# phases ``mfsdp::forward``, ``mfsdp::backward`` and ``mfsdp::optimizer_step``.
trace = next((out / "tb" / "profile").glob("rank0.*.pt.trace.json"))
events = [e for e in json.loads(trace.read_text())["traceEvents"]
          if e.get("ph") == "X" and "dur" in e]
labels = sorted({e["name"] for e in events if e["name"].startswith("mfsdp::")})
print(f"{trace.name}: {len(events):,} events; mfsdp's labels:")
for label in labels:
    mine = [e for e in events if e["name"] == label]
    total_ms = sum(e["dur"] for e in mine) / 1e3
    print(f"  {label:<22} {len(mine):>3} calls, {total_ms:7.1f} ms")
assert {"mfsdp::all_gather", "mfsdp::reduce_scatter"} <= set(labels)

# %%
# Draw the last iteration
# -----------------------
# The trainer labels its phases too (``mfsdp::forward``, ``mfsdp::backward`` per micro-batch,
# ``mfsdp::optimizer_step``). So the last iteration is the span from its first forward to its
# optimizer step.
#
# The plot has one row per label. With 2 micro-batches of ZeRO-3, each unit is all-gathered
# before its forward and again before its backward, and reduce-scattered after its backward.
#
# On CPU with gloo, the bars are the time to launch an asynchronous collective. Waiting for one
# shows up in the phase that needs its result.
import matplotlib.pyplot as plt

step = max((e for e in events if e["name"] == "mfsdp::optimizer_step"),
           key=lambda e: e["ts"])
forwards = [e for e in events if e["name"] == "mfsdp::forward" and e["ts"] < step["ts"]]
begin = sorted(e["ts"] for e in forwards)[-2]  # this iteration's 2 micro-batches
end = step["ts"] + step["dur"]
collectives = ["mfsdp::all_gather", "mfsdp::reduce_scatter", "mfsdp::all_reduce"]
rows = ["mfsdp::forward", "mfsdp::backward", "mfsdp::optimizer_step", *collectives]
colours = dict(zip(rows, ["0.75", "0.55", "0.35",
                          "tab:blue", "tab:orange", "tab:green"]))
fig, ax = plt.subplots(figsize=(8, 3.4))
for row, name in enumerate(rows):
    spans = [((e["ts"] - begin) / 1e3, max(e["dur"] / 1e3, 0.12)) for e in events
             if e["name"] == name and begin <= e["ts"] <= end]
    ax.broken_barh(spans, (row - 0.35, 0.7), color=colours[name])
    print(f"{name:<22} {len(spans):>3} in the last iteration")
ax.set_yticks(range(len(rows)), [r.removeprefix("mfsdp::") for r in rows], fontsize=11)
ax.invert_yaxis()
ax.set_xlabel("ms since the iteration began", fontsize=11)
ax.tick_params(axis="x", labelsize=10)
fig.tight_layout()

# %%
# Open the same file in https://ui.perfetto.dev or TensorBoard's profile plugin
# (``tensorboard --logdir <--tensorboard-dir>``) for the full picture with every operator. On
# GPUs, ``--profile`` without ``--use-pytorch-profiler`` marks an ``nsys`` capture range instead
# (``nsys profile --capture-range=cudaProfilerApi``), as Megatron-LM does.
