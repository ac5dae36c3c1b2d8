"""Benchmarks that run inside launched ranks (see :mod:`mfsdp.launch`).

(The communication timeline of separate all-gather groups is a runnable example now,
:mod:`mfsdp.examples.comm_timeline`.)
"""

from __future__ import annotations

import math

import torch

__all__ = ["conversion_memory", "unused_parameter_peak"]

def unused_parameter_peak(blocks: int = 8, dim: int = 256, unused: bool = True) -> float:
    """Peak full-gradient buffer bytes of a ZeRO-3 model as a share of all its gradient buckets,
    when every block holds a parameter that gets no gradient (``unused``) or not (run in every
    rank; rank 0's value is the one to read).

    Full gradient buffers live from a bucket's first gradient to the end of its reduce-scatter;
    with per-unit completion, an unused parameter no longer keeps them until the end of backward.
    """
    from torch import nn

    import mfsdp

    class _Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)
            self.spare = nn.Linear(dim, dim) if unused else None  # never called

        def forward(self, x):
            return x + self.fc2(torch.tanh(self.fc1(x)))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, dim), *[_Block() for _ in range(blocks)], nn.Linear(dim, 1))
    model, opt = mfsdp.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                   fsdp_unit_modules=[_Block], zero_dp_strategy=3)
    for _ in range(2):
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    total = sum(b.plan.padded_numel * 4 for b in model.fsdp_state().buckets if b.requires_grad)
    return model.fsdp_state().memory["peak_grad_full_bytes"] / total


_HWM = ("import sys, runpy\n"
        "argv = sys.argv[1:]\n"
        "try:\n"
        "    if argv:\n"
        "        sys.argv = argv\n"
        "        runpy.run_module(argv[0], run_name='__main__')\n"
        "    else:\n"
        "        import mfsdp.checkpoint.convert, mfsdp.models.hf\n"
        "except SystemExit as e:\n"
        "    if e.code:\n"
        "        raise\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print('PEAK', int(hwm.split()[1]) * 1024)\n")


def _peak_rss_of(argv: list[str]) -> int:
    """Peak resident memory (bytes, the kernel's ``VmHWM``) of a fresh Python process running
    module ``argv[0]`` with arguments ``argv[1:]`` (or only importing mfsdp when empty)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HWM, *argv], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stderr}")
    return int(out.stdout.split("PEAK")[-1])


def megatron_lm_conversion_memory(workdir, layers: int = 16, hidden: int = 1024,
                                  vocab: int = 2048) -> dict:
    """Peak memory of ``mfsdp convert --to megatron_lm`` and ``--from megatron_lm`` on a Llama
    checkpoint of many thin layers (about 0.7 GiB fp32 at the defaults), each in a fresh process,
    above a process that only imports mfsdp (bytes). Megatron-LM stacks each weight over the
    layers, so its largest tensor on disk is ``layers`` times the largest weight: the figures
    show whether a conversion holds a layer or the stack.

    The mfsdp checkpoint is written tensor by tensor (random values)."""
    import json
    from pathlib import Path

    from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE, write_streaming
    from mfsdp.models.gpt import GPT, GPTConfig

    work = Path(workdir)
    cfg = GPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=hidden * 11 // 4,
                    num_layers=layers, num_attention_heads=16, num_query_groups=4,
                    normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                    add_bias_linear=False)
    with torch.device("meta"):
        specs = {f"model.{k}": (tuple(v.shape), torch.float32)
                 for k, v in GPT(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    write_streaming(work / "mfsdp", specs, lambda k: torch.randn(specs[k][0], generator=g) * 0.02,
                    {"extra": {"iteration": 5}}, "fsdp_dtensor", {},
                    {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict())})
    sizes = {k: math.prod(s) * 4 for k, (s, _) in specs.items()}
    layer_keys = [k for k in sizes if k.startswith("model.layers.")]
    largest_stack = max(sum(sizes[k] for k in layer_keys if k.split(".", 3)[3] == suffix)
                        for suffix in {k.split(".", 3)[3] for k in layer_keys})
    base = _peak_rss_of([])
    cli = ["mfsdp.cli", "convert", "--no-progress"]
    export = _peak_rss_of(cli + ["--from", "fsdp_dtensor", "--to", "megatron_lm",
                                 str(work / "mfsdp"), str(work / "megatron")])
    (work / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    import_ = _peak_rss_of(cli + ["--from", "megatron_lm", "--to", "fsdp_dtensor",
                                  str(work / "megatron"), str(work / "back"),
                                  "--model-config", str(work / "cfg.json")])
    return {"checkpoint_bytes": sum(sizes.values()), "largest_tensor_bytes": max(sizes.values()),
            "largest_stacked_bytes": largest_stack, "export_peak_bytes": export - base,
            "import_peak_bytes": import_ - base, "baseline_bytes": base}


def conversion_memory(workdir, layers: int = 4, hidden: int = 2048, vocab: int = 32000) -> dict:
    """Peak memory of ``mfsdp convert --from hf`` and ``--to hf`` on a Llama checkpoint of about
    1.2 GiB (fp32; larger with more ``layers``), each in a fresh process.

    Returns the checkpoint size, its largest tensor and, per direction, the conversion's peak
    resident memory above that of a process that only imports the same modules (bytes).

    The checkpoint is written tensor by tensor (random values), so building it holds one tensor.
    """
    import json
    from pathlib import Path

    from mfsdp.checkpoint.safetensors import write_sharded
    from mfsdp.models.gpt import GPT, GPTConfig
    from mfsdp.models.hf import config_to_hf, weight_rules

    work = Path(workdir)
    src = work / "hf"
    src.mkdir(parents=True)
    cfg = GPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=hidden * 11 // 4,
                    num_layers=layers, num_attention_heads=16, num_query_groups=4,
                    normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                    add_bias_linear=False)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}
    specs = {}
    for rule in weight_rules(cfg):
        rows = shapes[rule.ours][0] // (len(rule.hf) if rule.kind == "cat" else 1)
        for name in rule.hf:
            if rule.kind == "qkv":
                h = cfg.head_dim
                rows = (cfg.num_attention_heads * h if name.endswith("q_proj.weight")
                        else cfg.num_query_groups * h)
            specs[name] = ((rows, *shapes[rule.ours][1:]), torch.float32)
    g = torch.Generator().manual_seed(0)
    write_sharded(((n, torch.randn(s, generator=g) * 0.02) for n, (s, _) in specs.items()),
                  specs, src, max_shard_bytes=2**30)
    (src / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    total = sum(math.prod(s) * 4 for s, _ in specs.values())
    largest = max(math.prod(s) * 4 for s, _ in specs.values())
    base = _peak_rss_of([])
    cli = ["mfsdp.cli", "convert", "--no-progress"]
    to_dcp = _peak_rss_of(cli + ["--from", "hf", "--to", "fsdp_dtensor", str(src),
                                 str(work / "dcp")])
    to_hf = _peak_rss_of(cli + ["--from", "fsdp_dtensor", "--to", "hf", str(work / "dcp"),
                                str(work / "back")])
    return {"checkpoint_bytes": total, "largest_tensor_bytes": largest,
            "import_peak_bytes": to_dcp - base, "export_peak_bytes": to_hf - base,
            "baseline_bytes": base}
