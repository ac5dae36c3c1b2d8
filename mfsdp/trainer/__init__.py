"""The trainer of ``mfsdp train``, split by concern: ``config`` (one typed, frozen ``kw_only``
dataclass per flag group, held by :class:`~mfsdp.trainer.config.TrainConfig`; the parser is
generated from them; ``config.rules``: every rule across the groups, which a config built in code
meets as the command line does), ``arguments`` (the parser, and the parsed flags turned into a
validated config: the argparse ``Namespace`` stops at ``checked_config``), ``refusals`` (the
names of the flags refused at start), ``build`` (model, precision policy, optimizer),
``saved_model`` (the model a Megatron-LM checkpoint's saved arguments name, for ``--load``),
``state`` (the components whose state a checkpoint keeps: learning-rate scheduler, the
Trainer's progress, the routers' bias), ``loop`` (the entry points: process group, ``--save``'s
lock, hang watch), ``trainer`` (the :class:`~mfsdp.trainer.trainer.Trainer` holding the run's
components, with ``train_step``, ``evaluate``, ``maybe_save`` and ``run``), ``checkpointing`` (the
``Checkpointer``: the model, the optimizer and the components' states, in the format the
registry writes), ``metrics`` (logging sinks), ``signals`` (stopping on SIGTERM). The data path
is :mod:`mfsdp.data.batches`; the commands are in :mod:`mfsdp.train`."""
