"""``python -m mfsdp.sbatch``: the ``mfsdp sbatch`` command."""

import sys

from mfsdp.sbatch import main

sys.exit(main())
