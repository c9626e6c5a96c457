"""``hfpatch.apply`` refuses when the launcher and the process group disagree (issue 33: under ``torchrun
--nproc-per-node 2`` without ``ACCELERATE_USE_CPU=true``, accelerate on CPU saw one process in each rank, and
the LoRA example ran two independent single-process trainings without a word).

In this process, with a launcher's environment (``WORLD_SIZE=2``) set by the test: accelerate state of one
process, and a torch.distributed group of one rank. Both raise before anything is created or patched, with the
fix in the message. The example itself under torchrun: ``tests/integration/test_lora_sp_accelerate.py``.
"""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

import hfpatch
from hfpatch.distributed import runtime
from hfpatch.testing import tiny_wan_transformer


@pytest.fixture
def launched(monkeypatch):
    """The environment ``torchrun --nproc-per-node 2`` gives rank 0 (LOCAL_RANK left out: with it, accelerate
    would initialise a process group of 2 and wait for the other rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)


def test_accelerate_seeing_one_process_of_two_raises_with_the_fix(launched):
    from accelerate.state import PartialState

    PartialState._reset_state()
    try:
        assert PartialState().num_processes == 1  # CPU, no ACCELERATE_USE_CPU: accelerate counts one process
        model = tiny_wan_transformer()
        for parallel in (1, None):  # the LoRA example passes accelerator.num_processes (1)
            with pytest.raises(RuntimeError) as error:
                hfpatch.apply(model, parallel=parallel)
            message = str(error.value)
            assert "WORLD_SIZE=2 processes, but accelerate sees 1 process" in message, message
            assert "set ACCELERATE_USE_CPU=true" in message, message
        assert hfpatch.get_patch(model) is None and not dist.is_initialized()
    finally:
        PartialState._reset_state()


def test_a_process_group_of_another_size_raises(launched):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="default process group has 1 rank"):
            hfpatch.apply(tiny_wan_transformer(), parallel=1)
    finally:
        dist.destroy_process_group()
        runtime._reset_state()


def test_no_launcher_is_not_checked(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    runtime.check_launch_agrees()  # nothing to compare with
    monkeypatch.setenv("WORLD_SIZE", "1")
    runtime.check_launch_agrees()
