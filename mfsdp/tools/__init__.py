"""The tools around the engine: the planner (``mfsdp plan``: :mod:`mfsdp.tools.plan`,
:mod:`mfsdp.tools.plan_time`), Slurm script rendering (``mfsdp sbatch``:
:mod:`mfsdp.tools.sbatch`, its templates beside it) and the benchmark (``mfsdp bench``:
:mod:`mfsdp.tools.benchmark`, :mod:`mfsdp.tools.benchmark_systems`).

They sit on the top floor with the trainer and the CLI: nothing below imports them.
"""
