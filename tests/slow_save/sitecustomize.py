"""A test-only shim that slows the trainer's checkpoint save (the preemption and Slurm tests
slow a save past torchrun's 30 s to show that it still completes).

A process whose ``PYTHONPATH`` starts with this directory imports this module at start-up. With
``$MFSDP_TEST_SAVE_DELAY_S`` set to a positive number of seconds it wraps
``mfsdp.trainer.checkpointing.Checkpointer._save`` (the whole save, every format) to sleep that
long first; otherwise it does nothing (not even import mfsdp). mfsdp itself has no such hook.
``tests/slow_save/__init__.py`` builds the environment that enables it.
"""
import os

SAVE_DELAY_ENV = "MFSDP_TEST_SAVE_DELAY_S"


def _install(delay_s: float) -> None:
    import functools
    import time

    from mfsdp.trainer.checkpointing import Checkpointer

    save = Checkpointer._save

    @functools.wraps(save)
    def slowed(self, *args, **kwargs):
        time.sleep(delay_s)
        return save(self, *args, **kwargs)

    Checkpointer._save = slowed


_delay = float(os.environ.get(SAVE_DELAY_ENV) or 0)
if _delay > 0:
    _install(_delay)
