"""pytest collects the package's doctests (``--doctest-modules``); the old import paths kept for
one release are aliases of the moved modules, whose doctests run where they live now."""

collect_ignore = ["plan.py", "plan_time.py", "benchmark.py", "benchmark_systems.py", "sbatch",
                  "_moved.py"]
