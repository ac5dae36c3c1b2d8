"""The ``mfsdp`` console entry point.

Run ``mfsdp --help`` for the list of subcommands. A user error (a bad value, a missing file, a
checkpoint of the wrong format) prints one line naming the input and exits with status 2;
``mfsdp --debug COMMAND ...`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from mfsdp import __version__

_ROLES = re.compile(r":(?:func|class|meth|mod|attr|data|doc|py:\w+):`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def plain(text: str | None) -> str | None:
    """Docstring markup (reST roles, double backquotes) as plain terminal text.

    >>> plain("see :func:`~mfsdp.tools.plan.plan` and ``--world-size``")
    'see plan and --world-size'
    """
    if not text:
        return text
    text = _ROLES.sub(lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return text.replace("``", "")


class PlainFormatter(argparse.HelpFormatter):
    """argparse help without reST markup."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action) -> str:
        return plain(super()._expand_help(action))


_USER_ERRORS: tuple[type[BaseException], ...] = (FileNotFoundError, FileExistsError,
                                                 NotADirectoryError, IsADirectoryError,
                                                 ValueError, KeyError)


def _user_errors() -> tuple[type[BaseException], ...]:
    from mfsdp.checkpoint.manifest import CheckpointError
    from mfsdp.tools.sbatch import RenderError

    return _USER_ERRORS + (CheckpointError, RenderError)


# The subcommands: name -> (module with build_parser(parser), the function that runs the parsed
# arguments, the one-line summary of `mfsdp --help`).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "convert": ("mfsdp.tools.convert_cli", "run_distributed",
                "convert checkpoints: fsdp_dtensor, Megatron-LM (torch_dist), mfsdp_full, "
                "safetensors and Hugging Face (hf)"),
    "plan": ("mfsdp.tools.plan_cli", "run",
             "estimate per-rank memory and per-step communication of a layout"),
    "train": ("mfsdp.train", "main_parsed",
              "train Llama, Qwen, Mixtral, DeepSeek-V3 or GPT models with Megatron-LM's flags "
              "(under torchrun)"),
    "sbatch": ("mfsdp.tools.sbatch", "run", "render Slurm batch scripts from presets"),
    "bench": ("mfsdp.tools.benchmark", "run",
              "step time, memory and bytes: DDP, PyTorch FSDP2 and mfsdp side by side"),
    "bandwidth": ("mfsdp.tools.bandwidth", "run",
                  "all-gather and reduce-scatter bus bandwidth inside a node and across nodes, "
                  "beside mfsdp plan's link assumptions"),
    "check": ("mfsdp.check.cli", "run",
              "check that a model trains the same sharded as in one process, layout by layout"),
    "preprocess": ("mfsdp.data.preprocess", "run",
                   "tokenize JSONL into Megatron .bin/.idx datasets"),
}


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level ``mfsdp`` argument parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="mfsdp", formatter_class=PlainFormatter,
        description="Megatron-FSDP-style sharded training on torch.distributed: convert "
                    "checkpoints, plan memory, train, render Slurm scripts, benchmark, "
                    "measure bandwidth, check parity, preprocess data.",
        epilog="Run 'mfsdp COMMAND --help' for the options of a command.")
    parser.add_argument("--version", action="version", version=f"mfsdp {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str, doc: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=plain(doc.splitlines()[0]),
                              formatter_class=PlainFormatter)

    for name, (module, _, summary) in COMMANDS.items():
        mod = importlib.import_module(module)
        mod.build_parser(add(name, summary, mod.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand.

    User errors print ``mfsdp COMMAND: error: ...`` and return 2 (``--debug``: raise them).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.debug:
        return _run(parser, args)
    try:
        return _run(parser, args)
    except SystemExit as exc:
        if isinstance(exc.code, str):  # a command's own message: one line, status 2
            print(exc.code if exc.code.startswith("mfsdp") else
                  f"mfsdp {args.command}: error: {exc.code}", file=sys.stderr)
            return 2
        raise
    except _user_errors() as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"mfsdp {args.command}: error: {message} (run with --debug for the traceback)",
              file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command not in COMMANDS:
        parser.error(f"unknown command {args.command!r}")
    module, runner, _ = COMMANDS[args.command]
    return getattr(importlib.import_module(module), runner)(args)

if __name__ == "__main__":
    sys.exit(main())
