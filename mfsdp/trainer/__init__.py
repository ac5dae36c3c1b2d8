"""The trainer of ``mfsdp train``, split by concern: ``config`` (one typed ``kw_only`` dataclass per
flag group, held by :class:`~mfsdp.trainer.config.TrainConfig`; the parser is generated from
them), ``arguments`` (the parser and the checks across groups), ``refusals`` (flags refused at
start), ``build`` (model, precision policy, optimizer, schedule), ``loop`` (the entry points:
process group, ``--save``'s lock, hang watch), ``trainer`` (the
:class:`~mfsdp.trainer.trainer.Trainer` holding the run's components, with ``train_step``,
``evaluate``, ``maybe_save`` and ``run``), ``checkpointing`` (the ``Checkpointer``: save and load
in every format), ``metrics`` (logging sinks), ``signals`` (stopping on SIGTERM). The argparse
``Namespace`` stops at ``TrainConfig.from_args``. The data path is :mod:`mfsdp.data.batches`; the
commands are in :mod:`mfsdp.train`."""
