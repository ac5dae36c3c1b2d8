"""The trainer of ``mfsdp train``, split by concern: ``arguments`` (Megatron-LM's flags and
checks), ``build`` (model, precision policy, optimizer, schedule), ``loop`` (the entry points: process
group, ``--save``'s lock, hang watch), ``trainer`` (the :class:`~mfsdp.trainer.trainer.Trainer`
holding the run's components, with ``train_step``, ``evaluate``, ``maybe_save`` and ``run``),
``config`` (typed configuration of the components, built from the flags), ``checkpointing`` (save and load in every format), ``metrics`` (logging sinks),
``signals`` (stopping on SIGTERM). The data path is :mod:`mfsdp.data.batches`; the commands are
in :mod:`mfsdp.train`."""
