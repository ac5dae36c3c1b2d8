"""``mfsdp convert``: convert checkpoints between mfsdp's, Megatron-LM's, upstream Megatron-FSDP's
and Hugging Face's formats.

Run as ``mfsdp convert`` or ``python -m mfsdp.checkpoint.convert``::

    mfsdp convert --from megatron_lm --to fsdp_dtensor MLM_DIR OUT [--model-config CFG] [--weights-only]
    mfsdp convert --from fsdp_dtensor --to torch_dist IN MLM_DIR [--weights-only]
    mfsdp convert --from fsdp_dtensor --to megatron_lm IN MLM_DIR --ckpt-format fsdp_dtensor [--bf16]
    mfsdp convert --from hf --to fsdp_dtensor HF_DIR OUT
    mfsdp convert --from fsdp_dtensor --to hf IN HF_DIR [--dtype bf16] [--max-shard-size 5GB]
    mfsdp convert --from mfsdp_full --to fsdp_dtensor IN OUT [--param-to-param-group-map MAP]
    mfsdp convert --from fsdp_dtensor --to mfsdp_full IN OUT
    mfsdp convert --from fsdp_dtensor --to safetensors IN OUT [--swiglu] [--dtype bf16]
    mfsdp convert --from safetensors --to fsdp_dtensor IN OUT [--swiglu]

The formats, one module each, registered in :mod:`mfsdp.checkpoint.formats` (the CLI here only
parses, checks the flags and looks the conversion up there: INPUT -> ``fsdp_dtensor`` -> OUTPUT):

* ``fsdp_dtensor``: mfsdp's sharded checkpoint (:mod:`mfsdp.checkpoint.io`), read into any layout
  by :func:`mfsdp.checkpoint.load_checkpoint`, which reshards on load.
* ``torch_dist`` / ``megatron_lm``: what Megatron-LM's ``--ckpt-format torch_dist`` writes
  (:mod:`mfsdp.checkpoint.megatron_lm`), and with ``--ckpt-format fsdp_dtensor`` what Megatron-LM
  with ``--use-megatron-fsdp`` writes (:mod:`mfsdp.checkpoint.megatron_lm_dtensor`); the input's
  format is recognised by what is on disk (:mod:`mfsdp.checkpoint.formats`).
* ``mfsdp_full``: mfsdp's full-tensor form, optimizer state by position
  (:mod:`mfsdp.checkpoint.full`); ``--from torch_dist`` still reads it, with a one-line
  notice naming ``--from mfsdp_full`` (until 0.2.0; ``CHANGELOG.md``).
* ``hf``: a Hugging Face model directory that ``transformers`` loads (:mod:`mfsdp.checkpoint.hf_format`,
  streaming: one tensor in memory at a time).
* ``safetensors``: weights by mfsdp name (:mod:`mfsdp.checkpoint.safetensors_format`).
* ``megatron_fsdp``: upstream Megatron-FSDP's README checkpoint (:mod:`mfsdp.checkpoint.upstream`).

Checkpoints written by ``mfsdp train`` and by ``--from hf`` also hold ``model_config.json`` (the
:class:`~mfsdp.models.gpt.GPTConfig`), which ``--to hf`` and ``mfsdp train --load`` read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mfsdp.checkpoint import formats
from mfsdp.checkpoint.dcp import spread_over_ranks
from mfsdp.checkpoint.formats import COMMON, checkpoint_format
from mfsdp.checkpoint.manifest import describe_os_error, os_error_in, os_error_remedy
from mfsdp.config import DTYPES

__all__ = ["FORMATS", "build_parser", "run", "run_distributed", "main", "parse_size"]


# --from/--to names: every registered format and its aliases (mfsdp/checkpoint/formats.py); read
# when the parser is built, so a format registered later is offered too.
FORMATS = formats.names()


def parse_size(text: str) -> int:
    """Bytes in a size such as ``5GB``, ``500MB``, ``2GiB`` or ``1000000``.

    >>> parse_size("5GB"), parse_size("2GiB"), parse_size("100")
    (5000000000, 2147483648, 100)
    """
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        value, unit = float(num), t[len(num):]
        if unit not in units or value <= 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"mfsdp convert: --max-shard-size {text!r} is not a size; write e.g. "
                         "5GB, 500MB or 2GiB") from None
    return int(value * units[unit])


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``mfsdp convert`` argument parser."""
    parser = parser or argparse.ArgumentParser(prog="mfsdp convert", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="src_format", required=True,
                        choices=formats.names(), help="format of INPUT")
    parser.add_argument("--to", dest="dst_format", required=True,
                        choices=formats.names(), help="format of OUTPUT")
    parser.add_argument("input", metavar="INPUT", help="checkpoint directory (or its root with a 'latest' file)")
    parser.add_argument("output", metavar="OUTPUT", help="new directory to write")
    parser.add_argument("--param-to-param-group-map", "--param-to-param-group-map-json",
                        dest="param_to_param_group_map", metavar="PATH",
                        help="map parameter name -> optimizer group, in the optimizer's order "
                             "(mfsdp_full and megatron_fsdp input): mfsdp's or upstream's JSON, "
                             "or the directory --dump-param-to-param-group-map writes; upstream's "
                             "flag name --param-to-param-group-map-json works too")
    parser.add_argument("--swiglu", action="store_true",
                        help="split (to safetensors) or join (from safetensors) fused gate/up "
                             "projection weights named *.fc1.*")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="cast weights when writing safetensors or hf (default: keep fp32)")
    parser.add_argument("--config", metavar="JSON",
                        help="(--to safetensors) model config merged into config.json")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="(--to hf) largest safetensors file, e.g. 5GB or 500MB "
                             "(default: %(default)s)")
    parser.add_argument("--model-preset", metavar="NAME",
                        help="(--to hf, --from megatron_fsdp or megatron_lm) the model's "
                             "preset, for checkpoints without model_config.json (a Megatron-LM "
                             "torch_dist checkpoint's own arguments are read without it)")
    parser.add_argument("--model-config", metavar="FILE",
                        help="(--to hf, --from megatron_fsdp or megatron_lm) the model's "
                             "GPTConfig as JSON, for checkpoints without model_config.json")
    parser.add_argument("--weights-only", action="store_true",
                        help="(megatron_lm) leave the optimizer state out, e.g. to read the "
                             "weights of a checkpoint whose distributed-optimizer state mfsdp "
                             "cannot map (dp_reshardable buckets of pipeline parallelism "
                             "above 1, or of experts)")
    parser.add_argument("--ckpt-format", choices=("torch_dist", "fsdp_dtensor"),
                        help="(--to megatron_lm) the Megatron-LM checkpoint format to write: "
                             "torch_dist (default) or fsdp_dtensor, for a Megatron-LM job with "
                             "--use-megatron-fsdp")
    parser.add_argument("--bf16", action="store_true",
                        help="(--to megatron_lm --ckpt-format fsdp_dtensor) the job that loads "
                             "it trains with --bf16 (its optimizer's keys have one more "
                             "module. prefix)")
    parser.add_argument("--fp16", action="store_true",
                        help="(--to megatron_lm --ckpt-format fsdp_dtensor) the job that loads "
                             "it trains with --fp16")
    parser.add_argument("--transformer-impl", choices=("transformer_engine", "local"),
                        help="(--to megatron_lm) the loading job's layer spec: "
                             "transformer_engine (default) or local; the norms' names differ "
                             "for fsdp_dtensor, and for torch_dist with multi-latent attention")
    parser.add_argument("--expert-model-parallel-size", type=int, metavar="N",
                        help="(--to megatron_lm, torch_dist) the loading job's expert "
                             "parallelism: above 1, the optimizer's groups are written for "
                             "megatron-core's chained expert optimizer (default 1)")
    parser.add_argument("--tensor-model-parallel-size", type=int, metavar="N",
                        help="(--to megatron_lm, torch_dist) the loading job's tensor "
                             "parallelism, written into the checkpoint's args (which "
                             "--use-checkpoint-args reads); the tensors are global at any TP "
                             "size (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress report")
    return parser


def _normalise(args: argparse.Namespace) -> str | None:
    """Give ``torch_dist`` its one meaning, Megatron-LM's format, and return what is on disk at
    ``INPUT`` (:func:`~mfsdp.checkpoint.formats.detect`). ``--to torch_dist`` writes
    Megatron-LM's (as ``--to megatron_lm``); ``--from torch_dist`` reads it, or mfsdp's
    full-tensor format that had that name before, with a one-line notice."""
    if args.dst_format == "torch_dist":
        if args.ckpt_format == "fsdp_dtensor":
            raise SystemExit("mfsdp convert: --to torch_dist writes Megatron-LM's torch_dist; for "
                             "its fsdp_dtensor use --to megatron_lm --ckpt-format fsdp_dtensor")
        args.dst_format = "megatron_lm"
    found = checkpoint_format(args.input)
    if args.src_format == "torch_dist":
        if found == "megatron_lm":
            args.src_format = "megatron_lm"
        elif found == "mfsdp_full":
            if os.environ.get("RANK", "0") == "0":
                print("mfsdp convert: --from torch_dist names Megatron-LM's format now; mfsdp's "
                      "full-tensor format is --from mfsdp_full (the old spelling works for one "
                      "release)", file=sys.stderr, flush=True)
            args.src_format = "mfsdp_full"
        else:
            raise SystemExit(f"mfsdp convert: {args.input} is not a Megatron-LM torch_dist "
                             "checkpoint (no latest_checkpointed_iteration.txt, no "
                             "iter_XXXXXXX with metadata.json)")
    return found


def _check_input(args: argparse.Namespace, found: str | None) -> None:
    """Refuse a ``--from`` that is not ``found``, what is on disk: reading one format as another
    keeps only what the two share and drops the rest without a word."""
    if found is None or found == args.src_format:
        return
    if {found, args.src_format} == {"hf", "safetensors"}:
        return  # both are config.json with safetensors: the reader of each says what it misses
    raise SystemExit(f"mfsdp convert: {args.input} is a {found} checkpoint (recognised by what is "
                     f"on disk), not {args.src_format}; pass --from {found}")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp convert`` command.

    A conversion that fails (the file system full, read-only or not writable, Ctrl-C) leaves
    nothing behind: no ``OUTPUT`` that was not there before, no ``.tmp-*`` directory; a file
    system error is one line naming the path."""
    out = Path(args.output)
    before = _ours_to_clean(out)
    try:
        return _run(args)
    except BaseException as exc:
        if os.environ.get("RANK", "0") == "0":
            _clean(out, before)
        cause = os_error_in(exc)
        if cause is None or isinstance(cause, _USER_OS_ERRORS):
            raise
        raise SystemExit(f"mfsdp convert: writing {out} failed: {describe_os_error(cause)}; "
                         f"nothing was left behind; {os_error_remedy(cause)} or choose another "
                         "OUTPUT") from None


# (a missing input, an output that exists: the command line's own one-line errors)
_USER_OS_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)


def _ours_to_clean(out: Path) -> set[str]:
    """What is at ``out`` and beside it under a temporary name before a conversion."""
    if not out.parent.is_dir():
        return set()
    return {p.name for p in out.parent.iterdir()
            if p.name == out.name or p.name.startswith(f".tmp-{out.name}-")}


def _clean(out: Path, before: set[str]) -> None:
    """Remove what a failed conversion wrote: ``out`` and its temporary directories, unless they
    were there before it."""
    import shutil

    for name in _ours_to_clean(out) - before:
        target = out.parent / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            try:
                target.unlink()
            except OSError:
                pass


def _run(args: argparse.Namespace) -> int:
    """:func:`run` without the clean-up."""
    _check_input(args, _normalise(args))
    pair = (args.src_format, args.dst_format)
    to_megatron_lm = args.dst_format == "megatron_lm"  # (torch_dist is megatron_lm by now)
    shard_bytes = parse_size(args.max_shard_size)  # a bad value is reported before any work
    dtensor_flags = [f for f, on in (("--bf16", args.bf16), ("--fp16", args.fp16)) if on]
    for flag, kind in (("expert_model_parallel_size", "expert"),
                       ("tensor_model_parallel_size", "tensor")):
        if getattr(args, flag) and not (to_megatron_lm and args.ckpt_format != "fsdp_dtensor"):
            raise SystemExit(f"mfsdp convert: --{flag.replace('_', '-')} names the {kind} "
                             "parallelism of the Megatron-LM job that loads the torch_dist "
                             "output of --to megatron_lm (an fsdp_dtensor checkpoint serves "
                             "any)")
    if args.transformer_impl and not to_megatron_lm:
        raise SystemExit("mfsdp convert: --transformer-impl names the layer spec of the "
                         "Megatron-LM job that loads the output of --to megatron_lm")
    if args.ckpt_format and not to_megatron_lm:
        raise SystemExit("mfsdp convert: --ckpt-format chooses what --to megatron_lm writes; the "
                         "input's format is recognised by what is on disk")
    if dtensor_flags and not (to_megatron_lm and args.ckpt_format == "fsdp_dtensor"):
        raise SystemExit(f"mfsdp convert: {', '.join(dtensor_flags)} name the Megatron-LM job "
                         "that loads an fsdp_dtensor checkpoint: use them with --to megatron_lm "
                         "--ckpt-format fsdp_dtensor")
    if args.bf16 and args.fp16:
        raise SystemExit("mfsdp convert: --bf16 or --fp16, not both")
    if args.weights_only and "megatron_lm" not in pair:
        raise SystemExit("mfsdp convert: --weights-only applies to Megatron-LM checkpoints "
                         "(--from megatron_lm or --to megatron_lm)")
    model_config = None
    if args.model_config:
        model_config = json.loads(Path(args.model_config).read_text())
        if "num_attention_heads" not in model_config and "num_attention_heads" not in (
                getattr(args, "model_flags", None) or {}):
            # the shapes cannot tell 4 heads of 16 channels from 8 of 8: never a default
            raise SystemExit(f"mfsdp convert: --model-config {args.model_config} names no "
                             "num_attention_heads, which the tensors' shapes cannot tell; add "
                             "it, or pass --num-attention-heads")
    elif args.model_preset:
        from mfsdp.models.gpt import GPT_PRESETS

        if args.model_preset not in GPT_PRESETS:
            raise SystemExit(f"mfsdp convert: --model-preset {args.model_preset!r} is not one "
                             f"of {', '.join(sorted(GPT_PRESETS))}")
        model_config = GPT_PRESETS[args.model_preset].to_dict()
    args.model_cfg, args.max_shard_bytes = model_config, shard_bytes
    # a lookup: INPUT -> the common form (fsdp_dtensor) -> OUTPUT (mfsdp/checkpoint/formats.py)
    print(formats.convert(args.src_format, args.dst_format, args.input, args.output, args))
    return 0


def _parallel(src_format: str, dst_format: str) -> bool:
    """Whether every leg of a conversion streams over the ranks of ``torchrun``."""
    legs = [formats.get(f) for f in (src_format, dst_format) if formats.get(f).name != COMMON]
    return bool(legs) and all(f.streams for f in legs)


def run_distributed(args: argparse.Namespace) -> int:
    """``mfsdp convert`` under ``torchrun``: a gloo process group over the ranks, each converting
    its share of the tensors (the conversions that stream: ``--from hf``, ``--from/--to
    megatron_lm``, ``--from megatron_fsdp``); rank 0 prints. Others run on rank 0 alone."""
    import os

    import torch.distributed as dist

    from mfsdp.runtime import init_from_env

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return run(args)
    _normalise(args)
    pair = (args.src_format, args.dst_format)
    if not _parallel(*pair):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"mfsdp convert: {pair[0]} -> {pair[1]} runs in one process; ranks other "
                  "than 0 have nothing to do", flush=True)
            return run(args)
        return 0
    from mfsdp.runtime import shutdown

    init_from_env(backend="gloo")
    code = None
    try:
        with spread_over_ranks():
            if dist.get_rank() != 0:
                args.no_progress = True
                import contextlib
                import io as _io

                with contextlib.redirect_stdout(_io.StringIO()):
                    code = run(args)
            else:
                code = run(args)
    finally:
        # A finished conversion leaves without the interpreter's teardown (see shutdown()).
        shutdown(barrier=code is not None, exit_code=code)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mfsdp.checkpoint.convert`` (under ``torchrun`` too)."""
    return run_distributed(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
