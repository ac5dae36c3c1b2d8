"""The :class:`Trainer` of ``mfsdp train`` (torchtitan's shape): one object holding the run's
components (data, model, optimizer, routers, metric sinks, stop request, profiler, watch) with
``build``, ``train_step``, ``evaluate``, ``maybe_save``, ``close`` and ``run`` (the loop).

:func:`mfsdp.trainer.loop.run` makes one once the save directory is locked; see :mod:`mfsdp.train`
for the commands."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from typing import Callable, TextIO

import torch
import torch.distributed as dist
from torch.profiler import record_function

from mfsdp.data.batches import MegatronData, global_batch, read_data
from mfsdp.layout import rank_device
from mfsdp.models.tensor_parallel import loss_parallel_context
from mfsdp.models.config import GPTConfig
from mfsdp.trainer.build import flops_per_token, model_family, routers_of, rss_mib
from mfsdp.trainer.checkpointing import Checkpointer, Stateful
from mfsdp.trainer.config import TrainConfig
from mfsdp.trainer.guard import Watch
from mfsdp.trainer.metrics import MetricSinks
from mfsdp.trainer.parallel import build_sharded_model, micro_batch
from mfsdp.trainer.preemption import SaveBudget, write_marker
from mfsdp.trainer.profiling import Profiler
from mfsdp.trainer.signals import StopRequest
from mfsdp.trainer.state import LRScheduler, RouterState, TrainState


class Trainer:
    """Build, load and train with a :class:`~mfsdp.trainer.config.TrainConfig` in an initialised
    process group whose ``--save`` directory is already ours; ``run()`` returns rank 0's log
    records. From code: :meth:`from_config`."""

    def __init__(self, config: TrainConfig, cfg: GPTConfig, num_micro: int,
                 device: torch.device, log: Callable[..., None], watch: Watch,
                 stop: StopRequest | None = None) -> None:
        # the run's typed configuration (checked) and the model's configuration it gives
        self.config = config
        self.cfg = cfg
        # what rank 0 reports and where (--log-*, TensorBoard, W&B)
        self.logging = config.logging
        # saves to --save and resumes from --load: the model, the optimizer and self.states
        self.checkpointer = Checkpointer(config.checkpoint, cfg,
                                         config.parallel.expert_model_parallel_size)
        # micro-batches per rank and iteration (gradient accumulation; TrainConfig.micro_batches)
        self.num_micro = num_micro
        # where this rank computes; the log prints on rank 0 only
        self.device = device
        self.log = log
        # hears where this rank is, to report a hang (guard.Watch); stopped by close() when
        # from_config made it (else its maker stops it)
        self.watch = watch
        self.owns_watch = False
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # built by build(): the data (mock or Megatron indexed), this rank's TP/CP/DP place,
        # the wrapped model (mfsdp or DDP), the unwrapped one (aux losses, routers, clipping),
        # the optimizer and the MoE routers (their bias follows the global token counts)
        self.data = None
        self.par = None
        self.model = None
        self.inner: torch.nn.Module | None = None
        self.opt = None
        self.routers: list = []
        # the components whose state a checkpoint keeps, by their name in it (made by build()):
        # the learning-rate schedule (its steps), this Trainer's progress, the routers' bias
        self.scheduler: LRScheduler | None = None
        self.state = TrainState()
        self.states: dict[str, Stateful] = {}
        # the iteration --load resumed from (0: a fresh start)
        self.start = 0
        # opened by open_outputs(), closed by close(): --log-jsonl's file (rank 0), TensorBoard
        # and W&B, the agreed stop (signals, --exit-duration-in-mins) and --profile's profiler
        self.jsonl = None
        self.sinks: MetricSinks | None = None
        # the stop request this Trainer owns: handed in by the entry point (made before the
        # process group, so an early SIGTERM is kept), else made by open_outputs()
        self.stop: StopRequest | None = stop
        # why the agreed stop ended the run ('' while none did): a save on SIGTERM writes the
        # marker the job script reads (preemption.write_marker)
        self.stop_why = ""
        # rank 0's clock on saves against the preemption grace (opened by open_outputs)
        self.budget: SaveBudget | None = None
        self.profiler: Profiler | None = None
        # model FLOPs per token for --log-throughput (None without it)
        self.token_flops: float | None = None
        # rank 0's records, one per iteration, returned by run(); the clock of elapsed_s
        self.records: list[dict] = []
        self.t_start = 0.0

    @classmethod
    def from_config(cls, config: TrainConfig, log: Callable[..., None] = print,
                    watch: Watch | None = None) -> Trainer:
        """A Trainer for ``config`` in an initialised process group (every rank calls it): the
        model's configuration and the micro-batches per rank follow from ``config``, which is
        validated for this world and device first (:meth:`~mfsdp.trainer.config.TrainConfig.validate`: the rules the
        command line meets, refused with a ``ValueError``); the device is the process group's
        (CUDA under NCCL, else the CPU). ``watch``: the hang report
        (default: one with ``--distributed-timeout-minutes``, not started by anything here)."""
        from mfsdp.trainer.build import model_config

        world = dist.get_world_size()
        device = rank_device()
        cfg = model_config(config)
        # the same rules as the command line's (mfsdp.trainer.config.rules): a ValueError
        config.validate(world, model=cfg, device=device.type)
        num_micro = config.micro_batches(world)
        owns = watch is None
        if owns:
            watch = Watch(config.job.distributed_timeout_minutes * 60)
        log = log if dist.get_rank() == 0 else (lambda *a, **k: None)
        trainer = cls(config, cfg, num_micro, device, log, watch)
        trainer.owns_watch = owns
        return trainer

    # -- building --------------------------------------------------------------------------

    def build(self) -> None:
        """Read the data, build and shard the model with its optimizer, dump the parameter map,
        load ``--load`` and say what runs."""
        self.watch.mark("reading the data")
        c = self.config
        self.data = read_data(c.data, c.training, c.model.vocab_size)
        self.watch.mark("building the model")
        self._build_model()
        if c.checkpoint.dump_param_to_param_group_map:
            from mfsdp.checkpoint.state import dump_param_to_param_group_map

            dump = c.checkpoint.dump_param_to_param_group_map
            dump_param_to_param_group_map(self.model, self.opt, dump)
            self.log(f"wrote the parameter-to-group map to {dump}",
                     flush=True)
        self.scheduler = LRScheduler.from_config(c.training, c.checkpoint, self.opt)
        self.states = {"trainer": self.state, "opt_param_scheduler": self.scheduler,
                       "expert_bias": RouterState(self.routers)}
        self.watch.mark(f"loading --load {c.checkpoint.load}")
        self.start = self.checkpointer.load(self.model, self.opt, self.states)
        if self.state.iteration != self.start:  # a checkpoint from before the state was kept
            self.state.load_state_dict({"iteration": self.start, "consumed_samples":
                                        self.start * c.training.global_batch_size})
        # steps are iterations here (Megatron-LM's scheduler counts samples; a conversion
        # gives them in iterations)
        self.scheduler.num_steps = self.start
        if self.start:
            self.log(f"resumed from iteration {self.start} of {c.checkpoint.load}", flush=True)
        self._announce()

    def _build_model(self) -> None:
        """Every rank builds the same model, splits it over TP and shards it over the
        data-parallel ranks (mfsdp) or replicates it (PyTorch's DDP), with its optimizer."""
        built = build_sharded_model(self.config, self.cfg, self.world, self.device, self.log)
        self.model, self.inner, self.opt, self.par = built
        self.routers = routers_of(self.inner)

    def _announce(self) -> None:
        """Rank 0's one line saying the layout, the model and the batch."""
        c, cfg, par = self.config, self.cfg, self.par
        layout_name = (c.parallel.data_parallel_sharding_strategy
                       if c.parallel.use_megatron_fsdp else "ddp")
        tp_note = ((f", TP {par.tp}{' + SP' if par.sequence_parallel else ''}" if par.tp > 1
                    else "") + (f", CP {par.cp}" if par.cp > 1 else ""))
        ranks = f"{self.world} rank{'s' if self.world != 1 else ''}"
        self.log(f"mfsdp train: {ranks} ({dist.get_backend()}), {layout_name}, outer "
                 f"{c.parallel.num_distributed_optimizer_instances}, EP "
                 f"{c.parallel.expert_model_parallel_size}{tp_note}, model "
                 f"{model_family(c.model.model_preset, cfg, c.checkpoint.load)} "
                 f"({cfg.num_layers} layers, hidden {cfg.hidden_size}, experts "
                 f"{cfg.num_experts}), "
                 f"{self.num_micro} micro-batch{'es' if self.num_micro != 1 else ''} of "
                 f"{c.training.micro_batch_size} per rank",
                 flush=True)

    def open_outputs(self) -> None:
        """Open what :meth:`close` closes: ``--log-jsonl`` (appended to when resuming), the
        metric sinks, the stop request and the profiler; start the clock."""
        c, logging = self.config, self.logging
        if logging.log_jsonl and self.rank == 0:
            self.jsonl = open(logging.log_jsonl, "a" if self.start else "w")
        self.sinks = MetricSinks.open(logging, self.rank)
        self.token_flops = (flops_per_token(self.cfg, c.training.seq_length)
                            if logging.log_throughput else None)
        if self.stop is None:
            self.stop = StopRequest(c.checkpoint.exit_signal_handler)
        # (only a run that saves on SIGTERM has a grace to fit, and records its saves' times)
        self.budget = SaveBudget(c.checkpoint.save if c.parallel.use_megatron_fsdp else None,
                                 self.log, saves_on_signal=c.checkpoint.exit_signal_handler)
        self.budget.at_start()
        self.profiler = Profiler(c.profiling, logging.tensorboard_dir, self.device)
        self.t_start = time.perf_counter()

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Build, then train from the iteration after ``--load``'s to ``--train-iters`` (or a
        stop): step, report, evaluate, save; return rank 0's records."""
        self.build()
        try:
            done = self.nothing_to_train()
            if done:  # (exit 0, as Megatron-LM's run that resumes at its last iteration)
                self.log(done, flush=True)
                return self.records
            self.open_outputs()
            for iteration in range(self.start + 1, self.config.training.train_iters + 1):
                self.profiler.before(iteration)
                rec = self.train_step(iteration)
                self.report(iteration, rec)
                self.evaluate(iteration, rec)
                leaving = self.should_leave(iteration)
                self.maybe_save(iteration, leaving)
                if leaving:
                    self.log(f"exiting after iteration {iteration}", flush=True)
                    break
        finally:  # cleanup never hides the error that ended the run
            self.close()
        return self.records

    def nothing_to_train(self) -> str:
        """The line rank 0 prints when ``--load`` resumed at or past the last iteration (a
        second run with the first one's ``--save`` and ``--load``), else ``''``: the run then
        trains, evaluates and saves nothing, and says why rather than ending without a word."""
        c = self.config
        last = c.training.train_iters
        if self.start < last:
            return ""
        samples = c.data.train_samples
        asked = (f"--train-samples {samples} is {last} iteration{'s' if last != 1 else ''} of "
                 f"--global-batch-size {c.training.global_batch_size}" if samples
                 else f"--train-iters is {last}")
        flag = "--train-samples" if samples else "--train-iters"
        return (f"mfsdp train: nothing to train: the checkpoint in {c.checkpoint.load} is at "
                f"iteration {self.start} and {asked}; raise {flag} to train on, or point "
                "--save and --load at a new directory to start over")

    def _read_batch(self, iteration: int) -> tuple[list, int, int]:
        """This rank's samples of iteration ``iteration``'s global batch, and the global batch's
        predicted tokens and sequences."""
        c, par = self.config, self.par
        per_rank = c.training.global_batch_size // par.dp_size
        rows = range(par.dp_rank * per_rank, (par.dp_rank + 1) * per_rank)
        mine = par.read_once(lambda: global_batch(c.training, iteration, self.cfg.vocab_size,
                                                  self.data, rows,
                                                  packing=c.data.sequence_packing))
        # with packing of indexed samples, each sample is a list of its documents
        pieces = [t for s in mine for t in (s if isinstance(s, list) else [s])]
        # predicted tokens and sequences of the global batch
        counted = torch.tensor([sum(len(t) - 1 for t in pieces), len(pieces)],
                               device=self.device)
        dist.all_reduce(counted, group=par.dp_group)
        global_tokens, global_pieces = (int(c) for c in counted)
        return mine, global_tokens, global_pieces

    def _accumulate(self, iteration: int, mine: list, global_tokens: int) -> torch.Tensor:
        """Forward and backward of every micro-batch (gradients synchronised on the last);
        return this rank's summed loss."""
        from mfsdp.moe import collect_aux_losses

        c, par, model = self.config, self.par, self.model
        # The engine averages gradients over the data-parallel ranks (never over TP) unless
        # per-token loss asks it to sum; PyTorch's DDP always averages.
        n_dp = par.grad_ranks
        sums = c.parallel.calculate_per_token_loss and c.parallel.use_megatron_fsdp
        scale = (1.0 if sums else n_dp) / global_tokens
        aux_scale = (1.0 / n_dp if sums else 1.0) / self.num_micro
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(self.num_micro):
            chunk = mine[i * c.training.micro_batch_size:(i + 1) * c.training.micro_batch_size]
            chunk = [t for s in chunk for t in (s if isinstance(s, list) else [s])]
            batch = micro_batch(chunk, par, self.device)
            self.watch.mark(f"iteration {iteration}: forward and backward of micro-batch {i + 1}")
            last = i == self.num_micro - 1
            with contextlib.nullcontext() if last else model.no_sync():
                with record_function("mfsdp::forward"):  # labels for --profile's trace
                    loss, _ = batch.loss(model, self.routers)
                    total = (loss * scale
                             + collect_aux_losses(self.inner).to(loss.device) * aux_scale)
                with record_function("mfsdp::backward"), loss_parallel_context(par.tp):
                    total.backward()  # (the vocabulary-parallel loss's backward needs it)
            loss_sum += loss.detach().double()
        return loss_sum

    def _step_optimizer(self, iteration: int, loss_sum: torch.Tensor, global_tokens: int):
        """Clip (or measure) the gradient norm, stop on a non-finite loss or norm, step, and
        update the routers' bias; return the gradient norm."""
        c = self.config
        self.watch.mark(f"iteration {iteration}: gradient norm and optimizer step")
        if c.parallel.use_megatron_fsdp:
            grad_norm = (self.opt.clip_grad_norm_(c.training.clip_grad) if c.training.clip_grad > 0
                         else self.opt.grad_norm())
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.inner.parameters(), c.training.clip_grad if c.training.clip_grad > 0 else float("inf"))
        self.par.sum_over_tokens(loss_sum)  # every rank: the global loss
        if c.training.check_for_nan_in_loss_and_grad:
            check_finite(iteration, loss_sum.item() / global_tokens, float(grad_norm), self.rank)
        with record_function("mfsdp::optimizer_step"):
            self.opt.step()
        for _, router in self.routers:  # balance from the global token counts: layout-invariant
            load = router.load.to(self.device)
            self.par.sum_over_tokens(load)  # (TP ranks route the same tokens)
            router.update_expert_bias(load, c.moe.moe_router_bias_update_rate)
        return grad_norm

    def train_step(self, iteration: int) -> dict:
        """One iteration: read the global batch, set the learning rate, accumulate gradients over
        the micro-batches, step; return the iteration's record."""
        t0 = time.perf_counter()
        mine, global_tokens, global_pieces = self._read_batch(iteration)
        lr = self.scheduler.apply()  # (the rate after iteration - 1 steps)
        self.opt.zero_grad()
        loss_sum = self._accumulate(iteration, mine, global_tokens)
        grad_norm = self._step_optimizer(iteration, loss_sum, global_tokens)
        self.scheduler.step()
        self.state.advance(self.config.training.global_batch_size)
        now = time.perf_counter()
        rec = {"iteration": iteration, "loss": loss_sum.item() / global_tokens,
               "grad_norm": float(grad_norm), "lr": lr,
               "tokens_per_s": (global_tokens + global_pieces) / (now - t0),
               "elapsed_s": now - self.t_start, "tokens": global_tokens + global_pieces,
               "rss_mib": rss_mib()}
        if self.config.parallel.use_megatron_fsdp:
            rec["state_mib"] = (sum(self.model.fsdp_state().memory_by_kind().values())
                                + self.opt.local_state_bytes()) / 2**20
        if self.token_flops is not None:
            rec["tflops_per_rank"] = self.token_flops * rec["tokens_per_s"] / self.world / 1e12
            if self.device.type == "cuda":
                rec["max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        return rec

    def report(self, iteration: int, rec: dict) -> None:
        """Keep the record, write it to ``--log-jsonl`` and the metric sinks, let the profiler
        step, and print the ``--log-interval`` line."""
        c, logging = self.config, self.logging
        self.records.append(rec)
        if self.jsonl:
            _write_log(self.jsonl, logging.log_jsonl, rec)
        self.sinks.training(rec, iteration)
        logged = iteration % logging.log_interval == 0 or iteration == c.training.train_iters
        self.profiler.after(iteration, logged)
        if logged:
            extra = ""
            if "tflops_per_rank" in rec:
                extra = f" | TFLOP/s per rank {rec['tflops_per_rank']:.3g}"
                if "max_allocated_mib" in rec:
                    extra += f" | max allocated {rec['max_allocated_mib']:.0f} MiB"
            self.log(f"iteration {iteration:>5}/{c.training.train_iters} | loss {rec['loss']:.4f} | "
                     f"grad norm {rec['grad_norm']:.3f} | lr {rec['lr']:.2e} | tokens/s "
                     f"{rec['tokens_per_s']:,.0f} | rss {rec['rss_mib']:.0f} MiB{extra}",
                     flush=True)

    def evaluate(self, iteration: int, rec: dict) -> None:
        """Every ``--eval-interval`` iterations and at the last, with a validation split: the
        validation loss and perplexity, added to ``rec`` and reported."""
        c, data = self.config, self.data
        if not (isinstance(data, MegatronData) and data.valid is not None and c.data.eval_iters > 0
                and (iteration % c.data.eval_interval == 0 or iteration == c.training.train_iters)):
            return
        self.watch.mark(f"iteration {iteration}: validation")
        valid_loss = self.validation_loss(iteration)
        rec.update(valid_loss=valid_loss, valid_ppl=math.exp(min(valid_loss, 700.0)))
        if self.jsonl:
            _write_log(self.jsonl, self.logging.log_jsonl, {"iteration": iteration,
                                                            "valid_loss": valid_loss,
                                                            "valid_ppl": rec["valid_ppl"]})
        self.log(f"validation after iteration {iteration} | loss {valid_loss:.4f} | "
                 f"perplexity {rec['valid_ppl']:.2f}", flush=True)
        self.sinks.write({"lm loss validation": valid_loss,
                          "lm loss validation ppl": rec["valid_ppl"]}, iteration)

    @torch.no_grad()
    def validation_loss(self, iteration: int) -> float:
        """Mean next-token loss over ``--eval-iters`` global batches of the validation split.

        The validation after iteration ``i`` reads run ``i // eval_interval`` of ``eval_iters x
        global batch`` validation samples (wrapping around); the routers' token counts are left
        as training made them."""
        c, par, data, device = self.config, self.par, self.data, self.device
        rank, world = par.dp_rank, par.dp_size  # the ranks that read different samples
        k = iteration // c.data.eval_interval
        n = c.data.eval_iters * c.training.global_batch_size
        per_rank = c.training.global_batch_size // world
        loads = [router.load.clone() for _, router in self.routers]
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for b in range(c.data.eval_iters):
            base = k * n + b * c.training.global_batch_size
            mine = par.read_once(lambda: [data.sample(data.valid, (base + j) % len(data.valid))
                                          for j in range(rank * per_rank, (rank + 1) * per_rank)])
            for i in range(0, per_rank, c.training.micro_batch_size):
                loss, count = micro_batch(mine[i:i + c.training.micro_batch_size], par,
                                          device).loss(self.model, self.routers)
                sums += torch.stack([loss.detach().double(),
                                     torch.tensor(float(count), dtype=torch.float64,
                                                  device=device)])
        for (_, router), load in zip(self.routers, loads):
            router.load = load
        par.sum_over_tokens(sums)
        return (sums[0] / sums[1]).item()

    def should_leave(self, iteration: int) -> bool:
        """Whether the run ends after ``iteration`` before ``--train-iters``: ``--exit-interval``,
        or a stop every rank agrees on (a signal, ``--exit-duration-in-mins``), said once."""
        c = self.config
        leaving = bool(c.checkpoint.exit_interval) and iteration % c.checkpoint.exit_interval == 0
        self.watch.mark(f"iteration {iteration}: end")
        # every rank agrees (one all-reduce)
        why = self.stop.reason(c.checkpoint, self.t_start, self.device)
        if why and iteration < c.training.train_iters:
            leaving = True
            self.stop_why = why
            if not c.checkpoint.save:
                self.log(f"warning: {why} but no --save: nothing is kept", flush=True)
            self.log(f"{why}: stopping after iteration {iteration}", flush=True)
        return leaving

    def maybe_save(self, iteration: int, leaving: bool) -> None:
        """Save to ``--save`` every ``--save-interval`` iterations, at the last and when
        leaving (mfsdp only: ``--save`` under DDP locks nothing and saves nothing)."""
        c = self.config
        if c.checkpoint.save and c.parallel.use_megatron_fsdp and (
                (c.checkpoint.save_interval and iteration % c.checkpoint.save_interval == 0)
                or iteration == c.training.train_iters or leaving):
            self.watch.mark(f"iteration {iteration}: saving")
            t0 = time.perf_counter()
            self.checkpointer.save(self.model, self.opt, iteration, self.states)
            seconds = time.perf_counter() - t0
            self.log(f"saved iteration {iteration} to {c.checkpoint.save} ({c.checkpoint.ckpt_format})",
                     flush=True)
            if self.rank == 0:
                self.budget.after_save(iteration, seconds)
                if leaving and self.stop_why.startswith("SIGTERM"):
                    write_marker(iteration, c.checkpoint.save)

    def close(self) -> None:
        """Stop the profiler, restore the signal handlers, close ``--log-jsonl`` and the sinks;
        a failure here is raised only when no other error is on its way out."""
        closers = (self.profiler.stop if self.profiler else None,
                   self.stop.restore if self.stop else None,
                   self.jsonl.close if self.jsonl else None,
                   self.sinks.close if self.sinks else None,
                   self.watch.stop if self.owns_watch else None)
        for close in closers:
            try:
                if close is not None:
                    close()
            except Exception:  # noqa: BLE001
                if sys.exc_info()[0] is None:
                    raise


def _write_log(jsonl: TextIO, flag_value: str, rec: dict) -> None:
    """One JSON line into ``--log-jsonl`` (rank 0), or a user error naming the file."""
    try:
        jsonl.write(json.dumps(rec) + "\n")
        jsonl.flush()
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise SystemExit(f"mfsdp train: --log-jsonl {flag_value}: cannot write ({why}); free "
                         "space there or point --log-jsonl elsewhere") from None


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
