"""The training loop of ``mfsdp train`` (see :mod:`mfsdp.train` for the commands): build, load,
iterate with accumulation, clipping and the schedule, log, evaluate, save, stop."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from mfsdp.data.batches import MegatronData, global_batch, read_data
from mfsdp.models.tensor_parallel import loss_parallel_context
from mfsdp.trainer.arguments import build_parser, check_args
from mfsdp.trainer.build import (build_param_groups, flops_per_token, learning_rate, make_optimizer,
                                 model_config, model_family, precision_policy, routers_of, rss_mib)
from mfsdp.trainer.checkpointing import check_load_exists, load_for_training, save_step
from mfsdp.trainer.guard import SaveLock, Watch, report_error
from mfsdp.trainer.metrics import MetricSinks
from mfsdp.trainer.parallel import build_parallel, micro_batch
from mfsdp.trainer.profiling import Profiler, check_profile_args
from mfsdp.trainer.signals import install_early, stop_request


def run(args: argparse.Namespace) -> list[dict]:
    """Train with parsed ``args`` in an initialised process group; return rank 0's log records.

    ``--save``'s directory is locked for the run (:class:`~mfsdp.trainer.guard.SaveLock`) and a
    :class:`~mfsdp.trainer.guard.Watch` reports hangs (and, under torchrun, a dead launcher)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    is_cpu = device.type == "cpu"
    cfg = model_config(args)
    num_micro = check_args(args, world, cfg)
    check_profile_args(args, is_cpu)
    log = print if rank == 0 else (lambda *a, **k: None)
    if args.load and args.exit_on_missing_checkpoint:  # before the lock creates --save
        check_load_exists(args.load)
    lock = SaveLock(args.save) if (args.save and args.use_megatron_fsdp) else None
    take_save_lock(lock, log)
    watch = Watch(args.distributed_timeout_minutes * 60, lock if rank == 0 else None)
    try:
        return train(args, cfg, num_micro, device, log, watch)
    finally:  # (nothing here may raise: it would hide what ended the run)
        watch.stop()
        note = lock.release() if lock is not None else ""
        if note and sys.exc_info()[0] is None:
            log(f"note: {note}", flush=True)


def take_save_lock(lock: SaveLock | None, log) -> None:
    """Rank 0 takes ``--save``'s lock; every rank stops with its message when it cannot."""
    error = [None]
    if lock is not None and dist.get_rank() == 0:
        try:
            lock.acquire()
        except SystemExit as exc:
            error[0] = str(exc.code)
    if lock is not None and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise SystemExit(error[0])
    for note in lock.notes if lock is not None else ():
        log(f"note: {note}", flush=True)


def train(args, cfg, num_micro: int, device, log, watch: Watch) -> list[dict]:
    """Build, load and train (the body of :func:`run`, once the save directory is ours);
    ``watch`` hears where this rank is."""
    from mfsdp import fully_shard
    from mfsdp.models.gpt import GPT, TransformerLayer
    from mfsdp.models.tensor_parallel import apply_tensor_parallel
    from mfsdp.moe import collect_aux_losses, shard_experts

    rank, world = dist.get_rank(), dist.get_world_size()
    watch.mark("reading the data")
    data = read_data(args)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    watch.mark("building the model")

    torch.manual_seed(args.seed)  # every rank builds the same model
    meta = args.init_model_with_meta_device  # (refused without --use-megatron-fsdp)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPT(cfg)
    model = model.to(dtype=dtype) if meta else model.to(device=device, dtype=dtype)
    ep = args.expert_model_parallel_size
    par = build_parallel(args, world, cfg, device, log)
    groups = par.groups
    if par.tp_mesh is not None:  # Megatron-LM's split, before the data-parallel sharding
        apply_tensor_parallel(model, par.tp_mesh, par.sequence_parallel, vocab_parallel_loss=True)
    if args.use_megatron_fsdp:
        global_names = shard_experts(model, groups["ep"] if groups else None)
        opt = make_optimizer(build_param_groups(model, args), args)
        model, opt = fully_shard(
            model, opt, fsdp_unit_modules=[TransformerLayer],
            zero_dp_strategy=args.data_parallel_sharding_strategy,
            outer_dp_sharding_strategy=args.outer_dp_sharding_strategy, process_groups=groups,
            device=device, init_model_with_meta_device=meta, mixed_precision_policy=precision_policy(args),
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            calculate_per_token_loss=args.calculate_per_token_loss,
            fsdp_double_buffer=args.fsdp_double_buffer)
        if global_names:
            model.set_global_names(global_names)
        inner = model.module
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        inner = model
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = make_optimizer(build_param_groups(inner, args), args)
    routers = routers_of(inner)
    if args.dump_param_to_param_group_map:
        from mfsdp.checkpoint.state import dump_param_to_param_group_map

        dump_param_to_param_group_map(model, opt, args.dump_param_to_param_group_map)
        log(f"wrote the parameter-to-group map to {args.dump_param_to_param_group_map}", flush=True)
    watch.mark(f"loading --load {args.load}")
    start = load_for_training(args, model, opt, routers, cfg) if args.load else 0
    if start:
        log(f"resumed from iteration {start} of {args.load}", flush=True)
    layout_name = (f"{args.data_parallel_sharding_strategy}" if args.use_megatron_fsdp else "ddp")
    tp_note = ((f", TP {par.tp}{' + SP' if par.sequence_parallel else ''}" if par.tp > 1 else "")
               + (f", CP {par.cp}" if par.cp > 1 else ""))
    log(f"mfsdp train: {world} ranks ({dist.get_backend()}), {layout_name}, outer "
        f"{args.num_distributed_optimizer_instances}, EP {ep}{tp_note}, model "
        f"{model_family(args, cfg)} "
        f"({cfg.num_layers} layers, hidden {cfg.hidden_size}, experts {cfg.num_experts}), "
        f"{num_micro} micro-batches of {args.micro_batch_size} per rank", flush=True)

    jsonl = open(args.log_jsonl, "a" if start else "w") if (args.log_jsonl and rank == 0) else None
    sinks = MetricSinks.open(args, rank)
    token_flops = flops_per_token(cfg, args.seq_length) if args.log_throughput else None
    stop = stop_request(args.exit_signal_handler)
    profiler = Profiler(args, device)
    records: list[dict] = []
    t_start = time.perf_counter()
    per_rank = args.global_batch_size // par.dp_size
    try:
        for iteration in range(start + 1, args.train_iters + 1):
            profiler.before(iteration)
            t0 = time.perf_counter()
            rows = range(par.dp_rank * per_rank, (par.dp_rank + 1) * per_rank)
            mine = par.read_once(lambda: global_batch(args, iteration, cfg.vocab_size, data, rows))
            # with packing of indexed samples, each sample is a list of its documents
            pieces = [t for s in mine for t in (s if isinstance(s, list) else [s])]
            # predicted tokens and sequences of the global batch
            counted = torch.tensor([sum(len(t) - 1 for t in pieces), len(pieces)], device=device)
            dist.all_reduce(counted, group=par.dp_group)
            global_tokens, global_pieces = (int(c) for c in counted)
            lr = learning_rate(args, iteration)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad()
            # The engine averages gradients over the data-parallel ranks (never over TP) unless
            # per-token loss asks it to sum; PyTorch's DDP always averages.
            n_dp = par.grad_ranks
            sums = args.calculate_per_token_loss and args.use_megatron_fsdp
            scale = (1.0 if sums else n_dp) / global_tokens
            aux_scale = (1.0 / n_dp if sums else 1.0) / num_micro
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for i in range(num_micro):
                chunk = mine[i * args.micro_batch_size:(i + 1) * args.micro_batch_size]
                chunk = [t for s in chunk for t in (s if isinstance(s, list) else [s])]
                batch = micro_batch(chunk, par, device)
                watch.mark(f"iteration {iteration}: forward and backward of micro-batch {i + 1}")
                last = i == num_micro - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    with record_function("mfsdp::forward"):  # labels for --profile's trace
                        loss, _ = batch.loss(model, routers)
                        total = (loss * scale
                                 + collect_aux_losses(inner).to(loss.device) * aux_scale)
                    with record_function("mfsdp::backward"), loss_parallel_context(par.tp):
                        total.backward()  # (the vocabulary-parallel loss's backward needs it)
                loss_sum += loss.detach().double()
            watch.mark(f"iteration {iteration}: gradient norm and optimizer step")
            if args.use_megatron_fsdp:
                grad_norm = (opt.clip_grad_norm_(args.clip_grad) if args.clip_grad > 0
                             else opt.grad_norm())
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    inner.parameters(), args.clip_grad if args.clip_grad > 0 else float("inf"))
            par.sum_over_tokens(loss_sum)  # every rank: the global loss
            if args.check_for_nan_in_loss_and_grad:
                check_finite(iteration, loss_sum.item() / global_tokens, float(grad_norm), rank)
            with record_function("mfsdp::optimizer_step"):
                opt.step()
            for _, router in routers:  # balance from the global token counts: layout-invariant
                load = router.load.to(device)
                par.sum_over_tokens(load)  # (TP ranks route the same tokens)
                router.update_expert_bias(load, args.moe_router_bias_update_rate)
            now = time.perf_counter()
            rec = {"iteration": iteration, "loss": loss_sum.item() / global_tokens,
                   "grad_norm": float(grad_norm), "lr": lr,
                   "tokens_per_s": (global_tokens + global_pieces) / (now - t0),
                   "elapsed_s": now - t_start, "tokens": global_tokens + global_pieces,
                   "rss_mib": rss_mib()}
            if args.use_megatron_fsdp:
                rec["state_mib"] = (sum(model.memory_by_kind().values())
                                    + opt.local_state_bytes()) / 2**20
            if token_flops is not None:
                rec["tflops_per_rank"] = token_flops * rec["tokens_per_s"] / world / 1e12
                if device.type == "cuda":
                    rec["max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            records.append(rec)
            if jsonl:
                _write_log(jsonl, args.log_jsonl, rec)
            sinks.training(rec, iteration)
            logged = iteration % args.log_interval == 0 or iteration == args.train_iters
            profiler.after(iteration, logged)
            if logged:
                extra = ""
                if "tflops_per_rank" in rec:
                    extra = f" | TFLOP/s per rank {rec['tflops_per_rank']:.3g}"
                    if "max_allocated_mib" in rec:
                        extra += f" | max allocated {rec['max_allocated_mib']:.0f} MiB"
                log(f"iteration {iteration:>5}/{args.train_iters} | loss {rec['loss']:.4f} | "
                    f"grad norm {rec['grad_norm']:.3f} | lr {lr:.2e} | tokens/s "
                    f"{rec['tokens_per_s']:,.0f} | rss {rec['rss_mib']:.0f} MiB{extra}", flush=True)
            if (isinstance(data, MegatronData) and data.valid is not None and args.eval_iters > 0
                    and (iteration % args.eval_interval == 0 or iteration == args.train_iters)):
                watch.mark(f"iteration {iteration}: validation")
                valid_loss = evaluate(args, model, data, routers, device, iteration, par)
                rec.update(valid_loss=valid_loss, valid_ppl=math.exp(min(valid_loss, 700.0)))
                if jsonl:
                    _write_log(jsonl, args.log_jsonl, {"iteration": iteration,
                                                       "valid_loss": valid_loss,
                                                       "valid_ppl": rec["valid_ppl"]})
                log(f"validation after iteration {iteration} | loss {valid_loss:.4f} | "
                    f"perplexity {rec['valid_ppl']:.2f}", flush=True)
                sinks.write({"lm loss validation": valid_loss,
                             "lm loss validation ppl": rec["valid_ppl"]}, iteration)
            leaving = bool(args.exit_interval) and iteration % args.exit_interval == 0
            watch.mark(f"iteration {iteration}: end")
            why = stop.reason(args, t_start, device)  # every rank agrees (one all-reduce)
            if why and iteration < args.train_iters:
                leaving = True
                if not args.save:
                    log(f"warning: {why} but no --save: nothing is kept", flush=True)
                log(f"{why}: stopping after iteration {iteration}", flush=True)
            if args.save and args.use_megatron_fsdp and (
                    (args.save_interval and iteration % args.save_interval == 0)
                    or iteration == args.train_iters or leaving):
                watch.mark(f"iteration {iteration}: saving")
                save_step(args, model, opt, iteration, routers, cfg)
                log(f"saved iteration {iteration} to {args.save} ({args.ckpt_format})", flush=True)
            if leaving:
                log(f"exiting after iteration {iteration}", flush=True)
                break
    finally:  # cleanup never hides the error that ended the run
        for close in (profiler.stop, stop.restore, jsonl.close if jsonl else None,
                      sinks.close):
            try:
                if close is not None:
                    close()
            except Exception:  # noqa: BLE001
                if sys.exc_info()[0] is None:
                    raise
    return records


def _write_log(jsonl, flag_value: str, rec: dict) -> None:
    """One JSON line into ``--log-jsonl`` (rank 0), or a user error naming the file."""
    try:
        jsonl.write(json.dumps(rec) + "\n")
        jsonl.flush()
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise SystemExit(f"mfsdp train: --log-jsonl {flag_value}: cannot write ({why}); free "
                         "space there or point --log-jsonl elsewhere") from None


@torch.no_grad()
def evaluate(args, model, data: MegatronData, routers, device, iteration: int, par) -> float:
    """Mean next-token loss over ``--eval-iters`` global batches of the validation split.

    The validation after iteration ``i`` reads run ``i // eval_interval`` of ``eval_iters x
    global batch`` validation samples (wrapping around); the routers' token counts are left as training made them.
    """
    rank, world = par.dp_rank, par.dp_size  # the ranks that read different samples
    k = iteration // args.eval_interval
    n = args.eval_iters * args.global_batch_size
    per_rank = args.global_batch_size // world
    loads = [router.load.clone() for _, router in routers]
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for b in range(args.eval_iters):
        base = k * n + b * args.global_batch_size
        mine = par.read_once(lambda: [data.sample(data.valid, (base + j) % len(data.valid))
                                      for j in range(rank * per_rank, (rank + 1) * per_rank)])
        for i in range(0, per_rank, args.micro_batch_size):
            loss, count = micro_batch(mine[i:i + args.micro_batch_size], par,
                                      device).loss(model, routers)
            sums += torch.stack([loss.detach().double(),
                                 torch.tensor(float(count), dtype=torch.float64, device=device)])
    for (_, router), load in zip(routers, loads):
        router.load = load
    par.sum_over_tokens(sums)
    return (sums[0] / sums[1]).item()


def run_in_rank(argv: list[str]) -> list[dict]:
    """Parse ``argv`` and :func:`run` it in a rank of :func:`mfsdp.launch.launch` (tests, recipes)."""
    return run(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Entry point under ``torchrun``: initialise the process group, train, clean up."""
    args = build_parser().parse_args(argv)
    return main_parsed(args)


def main_parsed(args: argparse.Namespace) -> int:
    """Run parsed ``mfsdp train`` arguments as a job: start the process group when none is, train,
    and end the process cleanly (see :func:`mfsdp.launch.shutdown`)."""
    started = False
    install_early(args.exit_signal_handler)  # a SIGTERM from here on is kept, not fatal
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m mfsdp.train`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get(
                                  "MASTER_PORT", "29511"))
        from mfsdp.launch import init_from_env

        # NCCL on GPUs, gloo otherwise; survives torchrun restarts
        init_from_env(timeout_s=args.distributed_timeout_minutes * 60)
        started = True
    from mfsdp.launch import shutdown

    try:
        run(args)
    except BaseException as exc:  # noqa: BLE001 - said once, in one line when it is the user's
        if not started:
            raise
        # no barrier (a peer may never come); leave without the interpreter's teardown
        shutdown(barrier=False, exit_code=report_error(exc, args.debug))
    if started:
        # This process owns the group: barrier, destroy, and leave without the interpreter's
        # teardown, in which gloo's threads can abort a finished run (see shutdown()).
        shutdown(exit_code=0)
    return 0


def check_finite(iteration: int, loss: float, grad_norm: float, rank: int) -> None:
    """Stop every rank, before the optimizer step, when the global loss or gradient norm is NaN
    or Inf (Megatron-LM's --check-for-nan-in-loss-and-grad): the weights and every checkpoint
    stay as they were after the last finite iteration. Rank 0 says why, in one line."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = (f"the loss is {loss}" if not math.isfinite(loss) else
            f"the gradient norm is {grad_norm}")
    raise SystemExit(
        f"mfsdp train: iteration {iteration}: {what}; stopped before the optimizer step, so "
        "the weights and checkpoints are those of the last finite iteration. Lower --lr, check "
        "the data, or pass --no-check-for-nan-in-loss-and-grad to train on"
        if rank == 0 else 1)
