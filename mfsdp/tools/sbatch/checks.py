"""What ``mfsdp sbatch`` refuses at render time, each in one line: values of the wrong type or
outside their choices, values Slurm would reject (time limits, CPU counts, ports, ``#SBATCH``
words), values the trainer would reject, and layouts the ranks cannot be split into."""

from __future__ import annotations

import math
import re
import shlex

from mfsdp.tools.sbatch.errors import RenderError
from mfsdp.tools.sbatch.presets import (CHOICES, FLEX_BACKENDS, PRESETS, SCHEMA,
                                        TEMPLATE_VALUES, Preset)

def _parse(key: str, raw: str) -> object:
    if key not in SCHEMA:
        known = ", ".join(sorted(SCHEMA))
        raise RenderError(f"--set {key}={raw!r}: unknown key {key!r}; known keys: {known}")
    typ, help_ = SCHEMA[key]
    try:
        if typ is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            value: object = raw.lower() in ("true", "1", "yes")
        else:
            value = typ(raw)
    except ValueError:
        kind = {int: "an integer", float: "a number", bool: "true or false"}.get(typ, "text")
        raise RenderError(f"--set {key}={raw!r}: {key} must be {kind} ({help_})") from None
    if key in CHOICES and value not in CHOICES[key]:
        raise RenderError(f"--set {key}={raw!r}: choose one of {', '.join(CHOICES[key])}")
    return value


def _num_experts(model_args: str) -> int | None:
    """The ``--num-experts`` of a ``model_args`` string (its last), ``None`` without one.

    >>> _num_experts("--model-preset deepseek-v3 --num-experts 64 --num-layers 4")
    64
    """
    import shlex

    words = shlex.split(model_args)
    found = None
    for i, word in enumerate(words):
        if word == "--num-experts" and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith("--num-experts="):
            found = word.split("=", 1)[1]
    if found is None:
        return None
    try:
        return int(found)
    except ValueError:
        raise RenderError(f"model_args: --num-experts {found!r} is not a whole number") from None


def resolve(preset: str, overrides: dict[str, str] | None = None) -> tuple[Preset, dict]:
    """The preset and its values with ``overrides`` (strings, as given to ``--set``) applied and
    checked: types, choices, values Slurm or the trainer would refuse, and that the ranks split
    into the requested parallel sizes. Every refusal is one line naming the key. A preset with
    ``micro_batches`` (gpu-smoke) scales a global batch not given with ``--set``: it is
    micro_batch_size x data-parallel ranks x micro_batches. A ``model_args`` without
    ``--model-preset`` is layered on the preset's own ``--model-preset`` (the flags change the
    preset's model, as ``mfsdp plan PRESET --model-args`` does); its ``--num-experts`` sets
    ``num_experts``.

    >>> resolve("gpu-smoke", {"nodes": "2"})[1]["global_batch_size"]
    16
    >>> values = resolve("gpu-smoke", {"nodes": "2", "global_batch_size": "32"})[1]
    >>> values["global_batch_size"]
    32
    >>> resolve("llama3-8b", {"model_args": "--num-layers 40"})[1]["model_args"]
    '--model-preset llama3-8b --num-layers 40'
    """
    if preset not in PRESETS:
        raise RenderError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    overrides = dict(overrides or {})
    parsed = {}
    for key, raw in overrides.items():
        value = _parse(key, raw)
        if key not in p.values:
            raise RenderError(f"--set {key}={raw!r}: the {p.template!r} template of preset "
                              f"{preset!r} does not use {key!r}")
        parsed[key] = value
    values = dict(TEMPLATE_VALUES.get(p.template, {}), **p.values)
    if parsed.get("trainer", values["trainer"]) == "megatron-lm":
        values.update(p.megatron_lm)
    values.update(parsed)
    own = _model_preset(p.values.get("model_args", ""))
    if "model_args" in parsed and own and _model_preset(parsed["model_args"]) is None:
        # flags alone change the preset's model, as mfsdp plan PRESET --model-args does (the
        # trainer's own base without a preset is a GPT-2-style model nothing here plans)
        values["model_args"] = f"--model-preset {own} {parsed['model_args']}".strip()
    if "model_args" in parsed:  # the experts the flags give are the experts the layout splits
        given = _num_experts(parsed["model_args"])
        if given is not None and "num_experts" in parsed and parsed["num_experts"] != given:
            raise RenderError(f"--set num_experts={parsed['num_experts']} but model_args has "
                              f"--num-experts {given}: drop num_experts (it follows model_args)")
        if given is not None:
            values["num_experts"] = given
    if p.micro_batches and "global_batch_size" not in parsed:  # scales with the ranks
        ranks = values["nodes"] * values["ranks_per_node"]
        dp = max(ranks // (values["tp"] * values["cp"]), 1)
        values["global_batch_size"] = values["micro_batch_size"] * dp * p.micro_batches
    for key, value in values.items():
        typ = SCHEMA[key][0]
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, typ):
            raise RenderError(f"preset {preset!r}: {key}={value!r} is not {typ.__name__}")
    _check_common(values)
    if p.template == "train":
        _check_train(values)
    elif p.template == "bandwidth":
        _check_bandwidth(values)
    else:
        _check_convert(values)
    return p, values


# Slurm's time formats (sbatch --time): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")


def time_limit_seconds(text: str) -> int:
    """Seconds of a Slurm time limit, or RenderError naming the accepted forms.

    >>> time_limit_seconds("04:00:00"), time_limit_seconds("1-12"), time_limit_seconds("90")
    (14400, 129600, 5400)
    """
    m = _TIME.match(text)
    if not m:
        raise RenderError(f"time={text!r} is not a Slurm time limit: use MM, HH:MM:SS, D-HH, "
                          "D-HH:MM or D-HH:MM:SS (e.g. 04:00:00)")
    d, dh, dm, ds, a, b, c = (int(g) if g else None for g in m.groups())
    if d is not None:
        seconds = d * 86400 + dh * 3600 + (dm or 0) * 60 + (ds or 0)
    elif c is not None:
        seconds = a * 3600 + b * 60 + c
    else:
        seconds = a * 60 + (b or 0)
    if seconds < 60:
        raise RenderError(f"time={text!r}: a time limit under one minute (Slurm counts minutes)")
    return seconds


# What a #SBATCH line may hold: sbatch reads these lines itself, without a shell's quoting.
_SLURM_WORD = {
    "job_name": (re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$"),
                 "letters, digits and . _ + - (no spaces)"),
    "partition": (re.compile(r"^[A-Za-z0-9._,-]*$"), "letters, digits and . _ , -"),
    "account": (re.compile(r"^[A-Za-z0-9._-]*$"), "letters, digits and . _ -"),
    "output": (re.compile(r"^[A-Za-z0-9._/%+@=-]+$"),
               "a path of letters, digits, . _ / + @ = - and Slurm's %x %j patterns, no spaces"),
    "container_image": (re.compile(r"^[A-Za-z0-9._/:#@+-]*$"),
                        "an image name or path without spaces or quotes"),
}
# Values that are paths: a leading ~ would be kept literally (the script quotes every value)
_PATHS = ("log_dir", "save", "load", "log_jsonl", "tokenizer_model", "megatron_lm_dir", "src",
          "dst", "param_map")


def _check_common(v: dict) -> None:
    for key, value in v.items():
        if isinstance(value, str) and any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise RenderError(f"{key}={value!r}: a newline or control character cannot be part "
                              f"of {key}")
        if isinstance(value, float) and not math.isfinite(value):
            raise RenderError(f"{key}={value!r} must be a finite number")
    for key, (pattern, what) in _SLURM_WORD.items():
        if key in v and not pattern.match(v[key]):
            raise RenderError(f"{key}={v[key]!r}: Slurm reads it from an #SBATCH line; use {what}")
    for key in _PATHS:
        if v.get(key, "").startswith("~"):
            raise RenderError(f"{key}={v[key]!r}: a leading ~ is not expanded in a quoted value; "
                              "give the absolute path")
    for key in ("model_args", "extra_args"):
        if key in v:
            try:
                shlex.split(v[key])
            except ValueError as exc:
                raise RenderError(f"{key}={v[key]!r}: {exc} (it is split like a shell command "
                                  "line)") from None
    if "container_mounts" in v and not re.match(r"^[A-Za-z0-9._/:,@+=-]*$", v["container_mounts"]):
        raise RenderError(f"container_mounts={v['container_mounts']!r}: pyxis takes "
                          "src:dst[:flags] pairs separated by commas, without spaces or quotes")
    time_limit_seconds(v["time"])
    if v["cpus_per_task"] < 1:
        raise RenderError(f"cpus_per_task={v['cpus_per_task']}: Slurm needs at least 1 CPU per "
                          "task")
    if v.get("gpus_per_node", 0) < 0:
        raise RenderError(f"gpus_per_node={v['gpus_per_node']} must be 0 (a CPU job) or more")
    if v["trainer"] == "megatron-lm" and v["megatron_lm_dir"] and \
            not v["megatron_lm_dir"].startswith("/"):
        raise RenderError(f"megatron_lm_dir={v['megatron_lm_dir']!r} must be an absolute path "
                          "(every node resolves it alike)")


def _check_port(v: dict) -> None:
    if not (v["rdzv_port"] == 0 or 1024 <= v["rdzv_port"] <= 65535):
        raise RenderError(f"rdzv_port={v['rdzv_port']}: a TCP port from 1024 to 65535, or 0 to "
                          "derive it from the job id")


def _check_ranks(v: dict) -> None:
    if v["gpus_per_node"] and v["ranks_per_node"] != v["gpus_per_node"]:
        raise RenderError(f"ranks_per_node={v['ranks_per_node']} but gpus_per_node="
                          f"{v['gpus_per_node']}: a GPU job runs one rank per GPU; set both")


def _check_train(v: dict) -> None:
    from mfsdp.layout import ParallelLayout
    from mfsdp.models.gpt import GPT_PRESETS

    for key in ("nodes", "ranks_per_node", "outer", "ep", "tp", "cp", "micro_batch_size",
                "global_batch_size", "train_iters", "seq_length", "save_interval", "log_interval"):
        if v[key] < 1:
            raise RenderError(f"{key}={v[key]} must be at least 1")
    for key in ("max_restarts", "num_experts"):
        if v[key] < 0:
            raise RenderError(f"{key}={v[key]} must be 0 or more")
    _check_port(v)
    limit = time_limit_seconds(v["time"])
    if not 0 <= v["signal_seconds"] <= 65535:
        raise RenderError(f"signal_seconds={v['signal_seconds']}: Slurm's --signal takes 0 to "
                          "65535 seconds")
    if v["save"] and v["signal_seconds"] >= limit:
        raise RenderError(f"signal_seconds={v['signal_seconds']} is not less than the time limit "
                          f"time={v['time']} ({limit} s): the signal would come before the start")
    if v["lr"] <= 0:
        raise RenderError(f"lr={v['lr']} must be positive")
    if not 0 <= v["min_lr"] <= v["lr"]:
        raise RenderError(f"min_lr={v['min_lr']} must be from 0 to lr={v['lr']}")
    if v["lr_warmup_iters"] < 0 or v["lr_decay_iters"] < 0:
        raise RenderError("lr_warmup_iters and lr_decay_iters must be 0 or more")
    decay = v["lr_decay_iters"] or v["train_iters"]
    if v["lr_decay_style"] != "constant" and v["lr_warmup_iters"] >= decay:
        raise RenderError(f"lr_warmup_iters={v['lr_warmup_iters']} must be less than "
                          f"{'lr_decay_iters' if v['lr_decay_iters'] else 'train_iters'}="
                          f"{decay}: the decay comes after the warm-up")
    if v["distributed_timeout_minutes"] <= 0:
        raise RenderError("distributed_timeout_minutes must be positive")
    if v["split"] and not re.match(r"^\d+(\.\d+)?(,\d+(\.\d+)?){0,2}$", v["split"]):
        raise RenderError(f"split={v['split']!r}: up to three comma-separated numbers, e.g. "
                          "969,30,1")
    _check_ranks(v)
    if v["launcher"] == "srun" and v["cpus_per_task"] < v["ranks_per_node"]:
        raise RenderError(f"launcher=srun runs {v['ranks_per_node']} tasks per node: "
                          f"cpus_per_task={v['cpus_per_task']} (per node) gives them less than "
                          "one core each")
    if v["launcher"] == "srun" and v["max_restarts"]:
        raise RenderError("max_restarts is torchrun's: with launcher=srun a failed rank ends the "
                          "step (resume by resubmitting, or use launcher=torchrun)")
    world = v["nodes"] * v["ranks_per_node"]
    what = f"nodes x ranks_per_node = {v['nodes']} x {v['ranks_per_node']} = {world} ranks"
    if world % (v["tp"] * v["cp"] * v["outer"]):
        raise RenderError(f"{what} cannot be split with tp={v['tp']} x cp={v['cp']} x "
                          f"outer={v['outer']}")
    if v["tp"] > v["ranks_per_node"]:
        raise RenderError(f"tp={v['tp']} exceeds ranks_per_node={v['ranks_per_node']}: keep "
                          "tensor parallelism inside a node (it communicates in every layer)")
    try:
        ParallelLayout(world, v["outer"], v["ep"], v["num_experts"] or None, tp=v["tp"],
                       cp=v["cp"])
    except ValueError as exc:
        raise RenderError(f"{what} cannot be split with outer={v['outer']}, ep={v['ep']}, "
                          f"tp={v['tp']}, cp={v['cp']}, num_experts={v['num_experts']}: "
                          f"{exc}") from None
    if v["ep"] > 1 and not v["num_experts"]:
        raise RenderError(f"ep={v['ep']} needs an MoE model: set num_experts (and the model_args)")
    dp = world // (v["tp"] * v["cp"])
    per = v["micro_batch_size"] * dp
    if v["global_batch_size"] % per:
        raise RenderError(f"global_batch_size={v['global_batch_size']} is not divisible by "
                          f"micro_batch_size x data-parallel ranks = {v['micro_batch_size']} x "
                          f"{dp}")
    if v["outer_strategy"] == "optim" and v["outer"] < 2:
        raise RenderError("outer_strategy=optim needs outer of at least 2")
    backends = FLEX_BACKENDS[v["trainer"]]
    if v["num_experts"] and v["dispatcher"] == "flex" and v["flex_backend"] not in backends:
        raise RenderError(f"flex_backend={v['flex_backend']!r} is not one of trainer="
                          f"{v['trainer']}'s: {', '.join(backends)}")
    if v["nccl_ub"] and v["trainer"] == "mfsdp":
        raise RenderError("nccl_ub=true: mfsdp train refuses --use-nccl-ub (mfsdp registers no "
                          "NCCL user buffers); leave nccl_ub=false, or render with "
                          "trainer=megatron-lm")
    _check_recompute(v)
    if v["trainer"] == "megatron-lm":
        for key, why in (("compile", "Megatron-LM's pretrain_gpt.py has no --compile (its "
                                     "Transformer Engine kernels are fused already)"),
                         ("fused_adam", "Megatron-LM's Adam is fused already (Transformer "
                                        "Engine's or Apex's FusedAdam)")):
            if v[key]:
                raise RenderError(f"{key}=true is mfsdp train's --{key.replace('_', '-')}: "
                                  f"{why}; leave {key}=false with trainer=megatron-lm")
        if not v["gpus_per_node"]:
            raise RenderError("trainer=megatron-lm needs GPUs (gpus_per_node > 0): Megatron-LM's "
                              "pretrain_gpt.py does not train on CPU; use trainer=mfsdp")
        preset = _model_preset(v["model_args"])
        if preset is None or preset not in GPT_PRESETS:
            raise RenderError(f"model_args={v['model_args']!r}: trainer=megatron-lm needs "
                              f"--model-preset NAME (one of {', '.join(sorted(GPT_PRESETS))}) to "
                              "write Megatron-LM's architecture flags")


def _check_bandwidth(v: dict) -> None:
    from mfsdp.tools.bandwidth import _sizes

    for key in ("nodes", "ranks_per_node"):
        if v[key] < 1:
            raise RenderError(f"{key}={v[key]} must be at least 1")
    _check_port(v)
    _check_ranks(v)
    if "%" in re.sub(r"%[xj]", "", v["output"]):
        raise RenderError(f"output={v['output']!r}: the bandwidth script names its JSON file "
                          "after the log and knows only %x (job name) and %j (job id); use "
                          "those, e.g. output=%x-%j.log")
    world = v["nodes"] * v["ranks_per_node"]
    try:
        _sizes([float(x) for x in v["size_mib"].split()] or [0.0], world)
    except (ValueError, OverflowError) as exc:  # (float's own messages name no key)
        why = str(exc) if "--size-mib" in str(exc) else "MiB as numbers, such as 256 1024"
        raise RenderError(f"size_mib={v['size_mib']!r} for {world} ranks: {why}") from None


def _check_convert(v: dict) -> None:
    if v["trainer"] == "megatron-lm":
        if (v["from_format"], v["to_format"]) != ("torch_dist", "fsdp_dtensor"):
            raise RenderError(f"trainer=megatron-lm converts torch_dist to fsdp_dtensor only "
                              f"(checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor), not "
                              f"{v['from_format']} to {v['to_format']}; use trainer=mfsdp")
        if v["gpus_per_node"] < 1:
            raise RenderError("trainer=megatron-lm: checkpoint_inspector.py converts on GPUs "
                              "(NCCL); set gpus_per_node")
    elif v["gpus_per_node"]:
        raise RenderError("trainer=mfsdp: mfsdp convert runs on CPU; leave gpus_per_node=0")


def recompute_layout(value: str) -> tuple[str | None, str, int]:
    """``(granularity, method, layers)`` of a ``recompute`` value, as Megatron-LM's
    ``--recompute-granularity``, ``--recompute-method`` and ``--recompute-num-layers`` take them
    (None: no recomputation), or RenderError naming the accepted values.

    >>> recompute_layout("full"), recompute_layout("block:26"), recompute_layout("none")
    (('full', 'uniform', 1), ('full', 'block', 26), (None, 'uniform', 1))
    """
    if value in ("none", "full", "selective"):
        return (None if value == "none" else value), "uniform", 1
    m = re.fullmatch(r"block:(\d+)", value)
    if not m:
        raise RenderError(f"recompute={value!r}: use none, full (every layer), block:N (the "
                          "first N layers) or selective")
    return "full", "block", int(m.group(1))


# A recompute flag passed anywhere but the recompute key would be invisible to its plan
_RECOMPUTE_FLAGS = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                    "--recompute-modules")


def _flag(word: str) -> str:
    return word.split("=", 1)[0]


def _num_layers(model_args: str) -> int | None:
    """The layers of the model ``model_args`` builds: its ``--num-layers``, else its preset's."""
    from mfsdp.models.gpt import GPT_PRESETS

    words = shlex.split(model_args)
    for i, word in enumerate(words):
        if word == "--num-layers" and i + 1 < len(words) and words[i + 1].isdigit():
            return int(words[i + 1])
        if word.startswith("--num-layers=") and word[len("--num-layers="):].isdigit():
            return int(word[len("--num-layers="):])
    preset = _model_preset(model_args)
    return GPT_PRESETS[preset].num_layers if preset in GPT_PRESETS else None


def _check_recompute(v: dict) -> None:
    _, method, n = recompute_layout(v["recompute"])
    layers = _num_layers(v["model_args"])
    if method == "block" and not 1 <= n <= (layers or n):
        raise RenderError(f"recompute={v['recompute']!r}: block:N recomputes the first N layers; "
                          f"N must be from 1 to the model's {layers} layers (or use full)")
    for word in shlex.split(v["model_args"]):
        if _flag(word) in _RECOMPUTE_FLAGS:
            raise RenderError(f"model_args passes {_flag(word)}: set recomputation with --set "
                              "recompute=none|full|block:N|selective, which the memory plan "
                              "and the header follow")


def _model_preset(model_args: str) -> str | None:
    tokens = shlex.split(model_args)
    for i, token in enumerate(tokens):
        if token == "--model-preset" and i + 1 < len(tokens):
            return tokens[i + 1]
        if token.startswith("--model-preset="):
            return token.split("=", 1)[1]
    return None
