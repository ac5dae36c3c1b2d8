"""The trainer of ``mfsdp train``, split by concern: ``arguments`` (Megatron-LM's flags and
checks), ``build`` (model, precision policy, optimizer, schedule), ``loop`` (the training loop and
the entry points), ``checkpointing`` (save and load in every format), ``metrics`` (logging sinks),
``signals`` (stopping on SIGTERM). The data path is :mod:`mfsdp.data.batches`; the commands are
in :mod:`mfsdp.train`."""
