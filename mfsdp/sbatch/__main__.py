"""``python -m mfsdp.sbatch``: moved to ``python -m mfsdp.tools.sbatch`` (works for one release)."""

import runpy
import warnings

warnings.warn("python -m mfsdp.sbatch moved to python -m mfsdp.tools.sbatch (or: mfsdp sbatch)",
              DeprecationWarning, stacklevel=1)
runpy.run_module("mfsdp.tools.sbatch", run_name="__main__", alter_sys=True)
