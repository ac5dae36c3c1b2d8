"""Check that your model trains the same under every mfsdp layout as in one process.

``mfsdp check MODEL`` runs each layout on ``--nproc`` gloo ranks of this machine for ``--steps``
steps next to a single-process reference, prints one line per layout as it finishes, then the
table, and exits 0 when every layout passes, 1 when one fails, 2 on bad input::

    mfsdp check llama-tiny --nproc 2 --steps 3
    mfsdp check mypkg.model:build --optimizer adamw --layouts optim_grads_params bf16
    mfsdp check ./tiny-llama-config --nproc 4 --json check.json --plot check.png
    mfsdp check mymodel:build --engine megatron_fsdp --optimizer adamw   # upstream's engine
"""

from __future__ import annotations

import argparse

__all__ = ["build_parser", "run"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add ``mfsdp check``'s arguments to ``parser`` (a new one when ``None``)."""
    from mfsdp.check.engines import engine_names
    from mfsdp.check.layouts import LAYOUTS

    parser = parser or argparse.ArgumentParser(prog="mfsdp check")
    parser.add_argument("model", metavar="MODEL",
                        help="package.module:factory (a zero-argument function returning the "
                             "model), a Hugging Face config directory, or a trainer preset "
                             "(e.g. llama-tiny)")
    parser.add_argument("--model-args", metavar="FLAGS", default=None,
                        help="mfsdp train's model flags layered on a preset MODEL, as mfsdp "
                             "plan --model-args takes them (e.g. \"--num-layers 4 "
                             "--hidden-size 256\")")
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks per layout (gloo processes; the hsdp and hfsdp layouts need 4)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per layout")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                        help="SGD shows a scale error as it is; AdamW normalises it away")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default 0.1 for sgd, 1e-3 for adamw)")
    parser.add_argument("--layouts", nargs="+", metavar="LAYOUT", default=None,
                        help=f"layouts to run (default: all that fit --nproc and the "
                             f"model; tp, tp_sp, cp and ep need mfsdp's GPT, ep a MoE one): "
                             f"{', '.join(LAYOUTS)}")
    parser.add_argument("--units", nargs="+", metavar="CLASS", default=None,
                        help="FSDP unit classes (default: the class of the modules in the "
                             "nn.ModuleList that holds most of the parameters: the layers)")
    parser.add_argument("--recursive-gather", nargs="+", metavar="CLASS", default=None,
                        help="classes whose forward bypasses their children's "
                             "(recursive_gather_modules)")
    parser.add_argument("--optimizer-factory", metavar="MODULE:FN", default=None,
                        help="fn(module, lr) building the optimizer your script uses (default: "
                             "the --optimizer over every parameter)")
    parser.add_argument("--resume-fn", metavar="MODULE:FN", default=None,
                        help="fn(path, model, optimizer) loading a checkpoint as your script "
                             "resumes, for the resume layout (default: "
                             "mfsdp.checkpoint.load_checkpoint)")
    parser.add_argument("--engine", choices=engine_names(), default="mfsdp",
                        help="what shards the model: mfsdp's fully_shard, PyTorch's FSDP2 "
                             "(torch.distributed.fsdp.fully_shard) or upstream Megatron-FSDP "
                             "(the installed megatron_fsdp package: pip install "
                             "'mfsdp[upstream]'); layouts an engine lacks are skipped")
    parser.add_argument("--after-shard", metavar="MODULE:FN", default=None,
                        help="fn(model, optimizer) your script calls right after sharding (a "
                             "workaround, e.g. mfsdp.check.engines.upstream:"
                             "reset_optimizer_step for megatron-fsdp 0.6.1's AdamW)")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per random sequence")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="save a plot of the gradient-norm and update-norm ratios per step")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the check ``args`` describe; print progress and the table; 0 pass, 1 fail. The
    current directory is importable for MODEL and the factories, as under ``python -m``."""
    import os
    import sys

    from mfsdp.check import check

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    model = args.model
    if args.model_args:
        from mfsdp.models.config import GPT_PRESETS

        if model not in GPT_PRESETS:
            raise SystemExit(f"mfsdp check: --model-args layers flags on a preset MODEL (one of "
                             f"{', '.join(sorted(GPT_PRESETS))}); {model!r} is not one")
        model = f"{model} {args.model_args}"
    report = check(model, nproc=args.nproc, steps=args.steps, optimizer=args.optimizer,
                   lr=args.lr, layouts=args.layouts, units=args.units,
                   optimizer_factory=args.optimizer_factory,
                   recursive_gather=args.recursive_gather, resume_fn=args.resume_fn,
                   seq_len=args.seq_len, engine=args.engine,
                   after_shard=args.after_shard,
                   json_path=args.json, plot_path=args.plot, progress=print)
    print()
    print(report.table())
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0 if report.passed else 1
