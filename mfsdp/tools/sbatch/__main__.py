"""``python -m mfsdp.tools.sbatch``: the ``mfsdp sbatch`` command."""

import sys

from mfsdp.tools.sbatch import main

sys.exit(main())
