"""The ``mfsdp`` console entry point.

Run ``mfsdp --help`` for the list of subcommands.
"""

from __future__ import annotations

import argparse
import sys

from mfsdp import __version__


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level ``mfsdp`` argument parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(prog="mfsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mfsdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from mfsdp.checkpoint import convert

    convert.build_parser(sub.add_parser(
        "convert", help="convert checkpoints: torch_dist <-> fsdp_dtensor <-> safetensors",
        description=convert.__doc__.splitlines()[0]))
    from mfsdp import plan

    plan.build_parser(sub.add_parser(
        "plan", help="estimate per-rank memory and per-step communication of a layout",
        description=plan.__doc__.splitlines()[0]))
    from mfsdp import benchmark, sbatch, train

    train.build_parser(sub.add_parser(
        "train", help="train the small GPT or MoE GPT with Megatron-LM's flags (under torchrun)",
        description=train.__doc__.splitlines()[0]))
    sbatch.build_parser(sub.add_parser(
        "sbatch", help="render Slurm batch scripts from presets",
        description=sbatch.__doc__.splitlines()[0]))
    benchmark.build_parser(sub.add_parser(
        "bench", help="step time, memory and bytes: DDP, PyTorch FSDP2 and mfsdp side by side",
        description=benchmark.__doc__.splitlines()[0]))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "convert":
        from mfsdp.checkpoint import convert

        return convert.run(args)
    if args.command == "plan":
        from mfsdp import plan

        return plan.run(args)
    if args.command == "train":
        from mfsdp import train

        return train._main(args)
    if args.command == "bench":
        from mfsdp import benchmark

        return benchmark.run(args)
    if args.command == "sbatch":
        from mfsdp import sbatch

        try:
            return sbatch.run(args)
        except sbatch.RenderError as exc:
            parser.exit(2, f"mfsdp sbatch: error: {exc}\n")
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
