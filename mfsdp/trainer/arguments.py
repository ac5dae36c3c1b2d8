"""The trainer's command line: Megatron-LM's flags (``build_parser``, generated from the config
classes) and the parsed arguments turned into a validated
:class:`~mfsdp.trainer.config.TrainConfig` (``checked_config``): the rules themselves live in
``mfsdp.trainer.config.rules``, where a config built in code meets them too."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mfsdp.argtypes import MIN_TIMEOUT_MINUTES  # noqa: F401
from mfsdp.trainer.config import DTYPES, GROUPS, STRATEGIES, TrainConfig, add_flags  # noqa: F401


class OneRankParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are printed by rank 0 only (``RANK`` of torchrun):
    a typo on 512 ranks is one message, not 512. Every rank still exits with status 2."""

    def error(self, message: str) -> None:
        """Print the usage and ``message`` on rank 0 (or without a rank), then exit 2."""
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The trainer's argument parser, generated from the config classes of
    :mod:`mfsdp.trainer.config` (one argument group per flag group; the guide's flag reference
    is generated from it)."""
    if parser is None:
        parser = OneRankParser(prog="mfsdp train", description=__doc__.splitlines()[0])
    for title, kinds in GROUPS:
        group = parser.add_argument_group(title)
        for kind in kinds:
            add_flags(group, kind)
    return parser


def checked_config(args: argparse.Namespace, world: int, device: str | None = None,
                   model: Any = None) -> tuple[TrainConfig, Any]:
    """The :class:`~mfsdp.trainer.config.TrainConfig` of parsed arguments ``args`` (the
    Namespace stops here), validated for ``world`` ranks (:meth:`~mfsdp.trainer.config.TrainConfig.validate`) and
    ``device`` (None: the device's rules are left out, as for a dry run), with the model's
    configuration (``model``, else ``mfsdp.trainer.build.model_config``'s). A refusal is
    a ``SystemExit`` with its one line: the command line's form of the ``ValueError`` a config
    built in code gets."""
    from mfsdp.trainer.build import model_config

    config = TrainConfig.from_args(args)
    if model is None:
        model = model_config(config)
    try:
        config.validate(world, model=model, device=device)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return config, model


def check_args(args: argparse.Namespace, world: int, cfg: Any = None) -> int:
    """Validate parsed arguments for ``world`` ranks (see :func:`checked_config`; ``cfg``: the
    model's configuration, if known); return the micro-batches per iteration per rank."""
    config, _ = checked_config(args, world, model=cfg)
    return config.micro_batches(world)
