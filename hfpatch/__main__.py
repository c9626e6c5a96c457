"""``python -m hfpatch``: the ``hfpatch`` command, also under a launcher (``torchrun -m hfpatch generate ...``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
