"""``hfpatch`` commands run one after the other in ONE process: one torchrun launch of this script runs them all (a
launch costs ~7 s of CPU per process). Used by tests/test_generate.py, test_generate_quantized.py and test_serve.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/cli_commands.py COMMANDS.json

``COMMANDS.json``: a list of ``hfpatch`` argument lists; the first command that fails ends the run with its status.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_env() -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH`` (for a launch run from :data:`ROOT`)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def launch(commands: list[list[str]], folder: Path, nproc: int = 2) -> list[str]:
    """The torchrun command line that runs ``commands`` (written to ``folder/commands.json``) on ``nproc`` processes
    (run it from :data:`ROOT` with :func:`checkout_env`)."""
    path = folder / "commands.json"
    path.write_text(json.dumps(commands))
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        __file__,
        str(path),
    ]


def main(path: str) -> None:
    from hfpatch.cli import main as hfpatch

    for argv in json.loads(Path(path).read_text()):
        status = hfpatch(argv)
        if status:
            sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1])
