"""Run an example's ``main`` several times in ONE process (plain, or launched by torchrun or accelerate launch).

    python -m torch.distributed.run --nproc-per-node 2 several_runs.py SCRIPT '["--a", "1"]' '["--a", "2"]'

Each JSON list is one run's command line: passed as ``main(argv)``, or as ``sys.argv`` to a ``main()`` that
parses its own. A list whose first item is a ``.py`` path runs that script's ``main`` instead of SCRIPT's (two
scripts' runs in one launch).

For cases that differ only in arguments: each run builds its own Accelerator, models, loader, optimizer and
scheduler and seeds every RNG it draws from. Between runs the process group stays up (only the last run's
``end_training`` destroys it: re-initialising a default group against torchrun's store is not reliable) and
accelerate's state singletons are reset, as a new process would start them. Launching 2 processes costs ~13 s
of CPU (torch, diffusers, transformers, peft, accelerate); a tiny run under a second.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from types import ModuleType

import accelerate
from accelerate.state import AcceleratorState, GradientState


def _load(script: str, loaded: dict[str, ModuleType]) -> ModuleType:
    if script not in loaded:
        spec = importlib.util.spec_from_file_location(f"example_under_test_{len(loaded)}", script)
        loaded[script] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded[script])
    return loaded[script]


def main(script: str, argvs: list[str]) -> None:
    loaded: dict[str, ModuleType] = {}
    end_training = accelerate.Accelerator.end_training

    def finish_trackers(self: accelerate.Accelerator) -> None:  # end_training without destroying the group
        for tracker in self.trackers:
            tracker.finish()

    try:
        for i, argv in enumerate(argvs):
            last = i == len(argvs) - 1
            accelerate.Accelerator.end_training = end_training if last else finish_trackers
            run = json.loads(argv)
            path = run.pop(0) if run and run[0].endswith(".py") else script
            module = _load(path, loaded)
            if inspect.signature(module.main).parameters:
                module.main(run)
            else:
                sys.argv = [path, *run]
                module.main()
            if not last:
                AcceleratorState._reset_state(reset_partial_state=True)
                GradientState._reset_state()
    finally:
        accelerate.Accelerator.end_training = end_training


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
