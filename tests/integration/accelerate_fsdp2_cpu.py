"""Run a script under accelerate's FSDP2 on CPU ranks: ``accelerate launch --use_fsdp ... THIS SCRIPT ARGS``.

accelerate turns ``--use_fsdp`` into ``DistributedType.FSDP`` only for accelerator devices: with
``ACCELERATE_USE_CPU=true`` its state says ``MULTI_CPU`` (gloo) and the FSDP plugin it built from the launch
flags is dropped. This shim sets that one decision as accelerate makes it on GPUs (distributed type FSDP,
the plugin kept) and then runs the script unchanged, so the script's ``accelerator.prepare`` (accelerate's
``fsdp2_prepare_model``: ``fully_shard`` per ``_no_split_modules`` block), ``clip_grad_norm_``,
``get_state_dict`` and ``save_state``/``load_state`` (sharded DCP checkpoints) run accelerate's own FSDP2
code on gloo.
"""

from __future__ import annotations

import functools
import runpy
import sys

from accelerate.state import AcceleratorState, DistributedType, PartialState

_init = AcceleratorState.__init__


@functools.wraps(_init)
def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):  # type: ignore[no-untyped-def]
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # Every later AcceleratorState() copies PartialState's shared fields: set the type there too.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


if __name__ == "__main__":
    AcceleratorState.__init__ = _fsdp_on_cpu
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
