"""The registry of checkpoint formats: one :class:`CheckpointFormat` per format on disk.

Each format declares its name, how it is recognised by what is on disk, how a job loads it, and
its two converters to and from the common form, mfsdp's ``fsdp_dtensor`` (the form every
converter already reads or writes). Everything that needs to know the formats reads
:data:`REGISTRY`: detection (:func:`~mfsdp.checkpoint.formats.detect`), ``load_checkpoint`` and ``mfsdp train --load``,
``mfsdp convert`` (its ``--from``/``--to`` choices, and each conversion a lookup: source -> common
form -> destination, see :func:`convert`), ``--ckpt-format`` (the formats a training job writes,
and how: ``train_write``; how its ``--load`` reads each: ``train_converts``)
and the format table of ``docs/conversion-reference.md`` (:func:`guide_table`, checked by
the tests).

A new format is one :func:`register` call (``tests/test_checkpoint_formats.py`` registers a tiny
one and converts it to and from the others)::

    register(CheckpointFormat(name="tiny", holds="...", written_by="...",
                              recognise=lambda path: (path / "tiny.pt").is_file(),
                              to_common=tiny_to_fsdp, from_common=fsdp_to_tiny))
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mfsdp.checkpoint.detect import (describe_unreadable, is_megatron_fsdp,
                                     resolve_megatron_lm)
from mfsdp.checkpoint.full import fsdp_to_full, full_to_fsdp
from mfsdp.checkpoint.hf_format import fsdp_to_hf, hf_to_fsdp
from mfsdp.checkpoint.io import load_converted, load_fsdp_dtensor
from mfsdp.checkpoint.manifest import (CheckpointError, is_full_format, read_manifest,
                                       resolve_checkpoint)
from mfsdp.checkpoint.megatron_lm import (fsdp_to_megatron_lm, load_megatron_lm,
                                          megatron_lm_to_fsdp, not_carried_line)
from mfsdp.checkpoint.megatron_lm_dtensor import fsdp_to_megatron_lm_dtensor
from mfsdp.checkpoint.safetensors_format import fsdp_to_safetensors, safetensors_to_fsdp
from mfsdp.checkpoint.state import read_param_to_param_group_map
from mfsdp.checkpoint.upstream import (fsdp_to_megatron_fsdp, load_megatron_fsdp,
                                       megatron_fsdp_to_fsdp)

__all__ = ["COMMON", "CheckpointFormat", "REGISTRY", "register", "unregister", "names",
           "get", "detect", "checkpoint_format", "train_formats", "convert", "guide_table",
           "load", "loader_via_common"]

COMMON = "fsdp_dtensor"  # the form every converter reads or writes

# A converter: (input directory, output directory, options) -> a line saying what was written
# (None: "wrote <format> checkpoint <output>"). Options are ``mfsdp convert``'s parsed arguments
# (``--dtype``, ``--weights-only``, ...), plus ``model_cfg`` (the dict --model-config or
# --model-preset name, or None) and ``max_shard_bytes`` (--max-shard-size in bytes).
Converter = Callable[[Path, Path, Any], "str | None"]


@dataclass(frozen=True, kw_only=True)
class CheckpointFormat:
    """One checkpoint format: what it is, how it is recognised, read and written."""

    name: str  # as --from/--to spell it
    holds: str  # what it holds (the guide's format table)
    written_by: str  # who writes it (the guide's format table)
    # True: ``path`` is in this format; False: it is not; None: it is a checkpoint of this
    # family that cannot be read (an unreadable manifest): detection stops and says so.
    recognise: Callable[[Path], "bool | None"]
    to_common: Converter | None = None  # this format -> fsdp_dtensor
    from_common: Converter | None = None  # fsdp_dtensor -> this format
    # load(path, model, optimizer, verify) -> extra: read straight into a sharded model
    # (load_checkpoint); None: converted to the common form first, then loaded.
    load: Callable | None = None
    aliases: tuple[str, ...] = ()  # other --from/--to names (megatron_lm: torch_dist)
    resolves_latest: bool = False  # INPUT may be a root whose ``latest`` names the checkpoint
    streams: bool = False  # its converters spread tensors over the ranks of torchrun
    train_save: bool = False  # mfsdp train --ckpt-format can write it
    # train_write(written, root, iteration, options): how mfsdp train writes an iteration it
    # saved in the common form (``written``) into its --save ``root`` in this format, on rank
    # 0 (options: ``model_cfg``, ``expert_model_parallel_size``); None: the common form is
    # saved into ``root`` as it is (fsdp_dtensor)
    train_write: Callable[[Path, Path, int, Any], None] | None = None
    # mfsdp train --load converts it into the common form inside the --load root first (with
    # the job's model configuration), instead of reading it with its loader
    train_converts: bool = False
    # what mfsdp train --load says it loaded when it starts from it at iteration 0 ("": the
    # weights of an iteration-0 checkpoint, e.g. imported from Hugging Face)
    train_note: str = ""

    def display_name(self) -> str:
        """The name as the guide writes it (an alias first: ``torch_dist`` (or ``megatron_lm``))."""
        if self.aliases:
            return f"`{self.aliases[0]}` (or `{self.name}`)"
        return f"`{self.name}`"


REGISTRY: dict[str, CheckpointFormat] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add ``fmt`` (detection asks the formats in the order they were registered)."""
    taken = {n for f in REGISTRY.values() for n in (f.name, *f.aliases)}
    for n in (fmt.name, *fmt.aliases):
        if n in taken:
            raise ValueError(f"checkpoint format {n!r} is already registered; choose another name")
    REGISTRY[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove the format ``name`` (tests that register their own)."""
    REGISTRY.pop(name, None)


def names() -> list[str]:
    """Every ``--from``/``--to`` name: the formats and their aliases."""
    return [n for f in REGISTRY.values() for n in (f.name, *f.aliases)]


def get(name: str) -> CheckpointFormat:
    """The format called ``name`` (or one of its aliases)."""
    for f in REGISTRY.values():
        if name == f.name or name in f.aliases:
            return f
    raise ValueError(f"checkpoint format {name!r} is not one of {', '.join(names())}")


def detect(path: str | Path) -> str | None:
    """The format of what is at ``path``, by what is on disk (``None``: none of them, or a
    checkpoint that cannot be read)."""
    path = Path(path)
    if not path.exists():
        return None
    for fmt in REGISTRY.values():
        verdict = fmt.recognise(path)
        if verdict is None:
            return None
        if verdict:
            return fmt.name
    return None


checkpoint_format = detect  # the name mfsdp convert's messages and older callers use


def load(path: str | Path, model, optimizer=None, verify: bool = True) -> dict:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``) with the loader of
    the format :func:`~mfsdp.checkpoint.formats.detect` finds (mfsdp's own, ``fsdp_dtensor``, when none declares one). A
    collective call."""
    name = detect(path)
    fmt = REGISTRY.get(name) if name is not None else None
    if fmt is None or fmt.load is None:
        fmt = REGISTRY[COMMON]
    return fmt.load(path, model, optimizer, verify)


def loader_via_common(name: str) -> Callable:
    """A ``load`` for format ``name`` that has no loader of its own: rank 0 converts the
    checkpoint to the common form beside it, every rank loads that, rank 0 removes it."""
    def load_it(path, model, optimizer=None, verify: bool = True) -> dict:
        fmt = get(name)
        return load_converted(path, model, optimizer,
                              lambda tmp: fmt.to_common(Path(path), tmp, None), name)
    return load_it


def train_formats() -> tuple[str, ...]:
    """What ``mfsdp train --ckpt-format`` may write, in registry order (aliases first)."""
    return tuple((f.aliases[0] if f.aliases else f.name)
                 for f in REGISTRY.values() if f.train_save)


def guide_table() -> str:
    """The format table of ``docs/conversion-reference.md``, as the registry has it."""
    rows = ["| format | what it holds | who writes it |", "| --- | --- | --- |"]
    rows += [f"| {f.display_name()} | {f.holds} | {f.written_by} |" for f in REGISTRY.values()]
    return "\n".join(rows)


def convert(src_format: str, dst_format: str, src, out, options) -> str:
    """Convert ``src`` (in ``src_format``) into a new ``out`` (in ``dst_format``): through the
    common form, the registry's two converters; return the line saying what was written."""
    source, dest = get(src_format), get(dst_format)
    if source.name == dest.name:
        raise SystemExit(f"mfsdp convert: --from and --to are both {source.name}; nothing to do")
    if source.resolves_latest:
        src = resolve_checkpoint(src)
    out = Path(out)
    if source.name == COMMON:
        legs = [(dest.from_common, dest, src, out)]
    elif dest.name == COMMON:
        legs = [(source.to_common, source, src, out)]
    else:
        common = out.parent / f".tmp-{out.name}-{COMMON}"  # removed with OUTPUT's leftovers
        legs = [(source.to_common, source, src, common), (dest.from_common, dest, common, out)]
    for fn, fmt, _, _ in legs:
        if fn is None:
            raise SystemExit(f"mfsdp convert: {fmt.name} cannot be "
                             f"{'read' if fmt is source else 'written'} by mfsdp convert")
    said, left = None, ""
    for fn, fmt, leg_src, leg_out in legs:
        said = fn(leg_src, leg_out, options)
        if said and "\nnot carried: " in said:  # what the first leg left behind is said last
            left = said[said.index("\nnot carried: "):]
        _barrier()  # the next leg reads what every rank wrote
    if len(legs) == 2:
        _remove_on_rank0(legs[0][3])
    said = said or f"wrote {dest.name} checkpoint {out}"
    return said if left and left in said else said + left


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _remove_on_rank0(path: Path) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


# -- the formats mfsdp knows ----------------------------------------------------------------------
def _manifest_format(path: Path) -> str | None:
    """``fsdp_dtensor``/``mfsdp_full`` for mfsdp's directories (by the manifest), ``""`` for
    one whose manifest cannot be read, ``None`` for anything else."""
    if not ((path / "manifest.json").exists() or (path / "latest").exists()):
        return None
    try:
        manifest = read_manifest(path)
    except (CheckpointError, OSError, ValueError, KeyError):
        return ""
    return "mfsdp_full" if is_full_format(manifest) else manifest.get("format")


def _recognise_mfsdp(name: str) -> Callable[[Path], "bool | None"]:
    def recognise(path: Path) -> bool | None:
        found = _manifest_format(path)
        return None if found == "" else found == name
    return recognise


def _recognise_megatron_lm(path: Path) -> bool:
    try:
        return resolve_megatron_lm(path) is not None
    except CheckpointError:
        return True  # a tracker naming a missing iteration: still Megatron-LM's layout


def _safetensors_dir(path: Path, hf: bool) -> bool:
    if not ((path / "config.json").is_file() and ((path / "model.safetensors").exists() or
                                                  (path / "model.safetensors.index.json").exists())):
        return False
    try:
        return ("model_type" in json.loads((path / "config.json").read_text())) == hf
    except (OSError, ValueError):
        return False


def _progress(options) -> bool:
    return not getattr(options, "no_progress", False)


def _dtype(options):
    from mfsdp.config import DTYPES

    return DTYPES.get(getattr(options, "dtype", None))


def _megatron_lm_to_common(src: Path, out: Path, o) -> str:
    written = megatron_lm_to_fsdp(src, out, getattr(o, "model_cfg", None),
                                  weights_only=getattr(o, "weights_only", False),
                                  progress=_progress(o),
                                  model_flags=getattr(o, "model_flags", None))
    return (f"wrote fsdp_dtensor checkpoint {written} from the Megatron-LM checkpoint {src}"
            + not_carried_line(written))


def _common_to_megatron_lm(src: Path, out: Path, o) -> str:
    weights_only = getattr(o, "weights_only", False)
    impl = getattr(o, "transformer_impl", None) or "transformer_engine"
    if getattr(o, "ckpt_format", None) == "fsdp_dtensor":
        precision = "bf16" if getattr(o, "bf16", False) else "fp16" if getattr(o, "fp16", False) \
            else "fp32"
        written = fsdp_to_megatron_lm_dtensor(src, out, getattr(o, "model_cfg", None),
                                              weights_only=weights_only, precision=precision,
                                              transformer_impl=impl, progress=_progress(o))
        return (f"wrote Megatron-LM fsdp_dtensor checkpoint {written} (load it with "
                "--use-megatron-fsdp --ckpt-format fsdp_dtensor"
                + (f" --{precision}" if precision != "fp32" else "") + ")")
    written = fsdp_to_megatron_lm(
        src, out, getattr(o, "model_cfg", None), weights_only=weights_only,
        progress=_progress(o), transformer_impl=impl,
        expert_model_parallel_size=getattr(o, "expert_model_parallel_size", None) or 1,
        tensor_model_parallel_size=getattr(o, "tensor_model_parallel_size", None) or 1)
    from mfsdp.checkpoint.megatron_common import read_common_state
    from mfsdp.checkpoint.detect import resolve_megatron_lm

    args = read_common_state(resolve_megatron_lm(written)[0]).get("args")
    flag = ("" if weights_only or args is None or args.optimizer != "adam" else
            "; Adam state: --use-distributed-optimizer" if args.use_distributed_optimizer
            else "; Adam state: without --use-distributed-optimizer")
    return (f"wrote Megatron-LM torch_dist checkpoint {written} (load it with --ckpt-format "
            f"torch_dist{flag})")


def _megatron_fsdp_to_common(src: Path, out: Path, o) -> str:
    map_path = getattr(o, "param_to_param_group_map", None)
    group_of = read_param_to_param_group_map(map_path) if map_path else None
    model_config = getattr(o, "model_cfg", None)
    model_names = None
    if model_config is not None:
        import torch

        from mfsdp.models.gpt import GPT, GPTConfig

        with torch.device("meta"):
            model_names = [n for n, _ in GPT(GPTConfig.from_dict(model_config)).named_parameters()]
    elif group_of is not None:
        model_names = list(group_of)
    written = megatron_fsdp_to_fsdp(src, out, model_names=model_names, group_of=group_of,
                                    model_config=model_config)
    return f"wrote fsdp_dtensor checkpoint {written}"


def _common_to_megatron_fsdp(src: Path, out: Path, o) -> str:
    return f"wrote megatron_fsdp checkpoint {fsdp_to_megatron_fsdp(src, out)}"


def _hf_to_common(src: Path, out: Path, o) -> None:
    hf_to_fsdp(src, out, progress=_progress(o))


def _common_to_hf(src: Path, out: Path, o) -> None:
    fsdp_to_hf(src, out, _dtype(o), getattr(o, "max_shard_bytes", None) or 5 * 10**9,
               getattr(o, "model_cfg", None), progress=_progress(o))


def _full_to_common(src: Path, out: Path, o) -> None:
    full_to_fsdp(src, out, getattr(o, "param_to_param_group_map", None),
                 verify=getattr(o, "verify", True))


def _common_to_full(src: Path, out: Path, o) -> None:
    fsdp_to_full(src, out)


def _safetensors_to_common(src: Path, out: Path, o) -> None:
    safetensors_to_fsdp(src, out, True if getattr(o, "swiglu", False) else None)


def _common_to_safetensors(src: Path, out: Path, o) -> None:
    config_path = getattr(o, "config", None)
    config = json.loads(Path(config_path).read_text()) if config_path else None
    fsdp_to_safetensors(src, out, getattr(o, "swiglu", False), _dtype(o), config)


def _train_write_megatron_lm(written: Path, root: Path, iteration: int, o: Any) -> None:
    """Megatron-LM's ``torch_dist`` into the save root, as Megatron-LM lays it out (experts for
    the job's EP size): the iteration directory moved in whole, then the tracker replaced (a
    crash in between leaves the previous iteration the one that loads)."""
    import os

    from mfsdp.checkpoint.detect import TRACKER

    tmp_root = root / f".export-iter_{iteration:07d}"
    shutil.rmtree(tmp_root, ignore_errors=True)
    try:
        fsdp_to_megatron_lm(written, tmp_root, o.model_cfg, progress=False, verify=False,
                            expert_model_parallel_size=o.expert_model_parallel_size)
        name = f"iter_{iteration:07d}"
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp_root / name, final)
        (root / f".{TRACKER}.tmp").write_text(str(iteration))
        os.replace(root / f".{TRACKER}.tmp", root / TRACKER)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


def _train_write_full(written: Path, root: Path, iteration: int, o: Any) -> None:
    """mfsdp's full-tensor form into the save root, then ``latest`` pointed at it."""
    import os

    final = root / written.name
    if final.exists():
        shutil.rmtree(final)
    fsdp_to_full(written, final, verify=False)  # hashed by this very save
    (root / ".latest-tmp").write_text(written.name + "\n")
    os.replace(root / ".latest-tmp", root / "latest")


def _load_megatron_lm(path, model, optimizer=None, verify: bool = True) -> dict:
    return load_megatron_lm(path, model, optimizer)


def _load_megatron_fsdp(path, model, optimizer=None, verify: bool = True) -> dict:
    return load_megatron_fsdp(path, model, optimizer)


def _load_mfsdp(path, model, optimizer=None, verify: bool = True) -> dict:
    unreadable = describe_unreadable(path)
    if unreadable:
        raise CheckpointError(unreadable)
    return load_fsdp_dtensor(path, model, optimizer, verify=verify)


register(CheckpointFormat(
    name="fsdp_dtensor", recognise=_recognise_mfsdp("fsdp_dtensor"), load=_load_mfsdp,
    resolves_latest=True, train_save=True,
    holds="DTensors of global shape, optimizer state by *name*",
    written_by="`mfsdp.checkpoint.save_checkpoint`, `mfsdp train`"))
register(CheckpointFormat(
    name="megatron_lm", aliases=("torch_dist",), recognise=_recognise_megatron_lm,
    to_common=_megatron_lm_to_common, from_common=_common_to_megatron_lm,
    load=_load_megatron_lm, streams=True, train_save=True, train_write=_train_write_megatron_lm,
    train_converts=True,
    holds="Megatron-LM's `--ckpt-format torch_dist` (tracker, `iter_XXXXXXX/`, layers stacked, "
          "optimizer state by weight); as `megatron_lm` also its `--ckpt-format fsdp_dtensor` "
          "(Megatron-LM with `--use-megatron-fsdp`: a plain DCP, `model.module.<name>` per layer)",
    written_by="Megatron-LM, `mfsdp convert --to torch_dist`, `mfsdp train --ckpt-format "
               "torch_dist`"))
register(CheckpointFormat(
    name="mfsdp_full", recognise=_recognise_mfsdp("mfsdp_full"), to_common=_full_to_common,
    from_common=_common_to_full, resolves_latest=True, train_save=True,
    train_write=_train_write_full, train_converts=True,
    holds="full tensors: `model.<name>`, optimizer state by *position* (as "
          "`optimizer.state_dict()`), `param_to_param_group_map.json`",
    written_by="a single-process PyTorch job (`save_full_checkpoint`), `mfsdp train "
               "--ckpt-format mfsdp_full`"))
register(CheckpointFormat(
    name="safetensors", recognise=lambda p: _safetensors_dir(p, hf=False),
    to_common=_safetensors_to_common, from_common=_common_to_safetensors,
    holds="`model.safetensors` (weights under mfsdp's names) and `config.json`",
    written_by="`mfsdp convert --to safetensors`"))
register(CheckpointFormat(
    name="hf", recognise=lambda p: _safetensors_dir(p, hf=True), to_common=_hf_to_common,
    from_common=_common_to_hf, streams=True,
    holds="a Hugging Face model directory (`transformers` names and `config.json`, sharded)",
    written_by="`mfsdp convert --to hf`, `save_pretrained`"))
register(CheckpointFormat(
    name="megatron_fsdp", recognise=lambda p: is_megatron_fsdp(p),
    to_common=_megatron_fsdp_to_common, from_common=_common_to_megatron_fsdp,
    load=_load_megatron_fsdp, streams=True,
    train_note="an upstream Megatron-FSDP checkpoint (weights and optimizer state)",
    holds="upstream Megatron-FSDP's README checkpoint: `model.module.<name>`, optimizer state by "
          "position, param groups per field (no manifest)",
    written_by="the `megatron_fsdp` package"))
