"""``python -m hfpatch.cli``: the ``hfpatch`` command, as ``python -m hfpatch`` and the console script."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
