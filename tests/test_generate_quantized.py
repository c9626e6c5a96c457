"""``hfpatch generate --quantize`` (issue 50): the denoisers quantized while loading, with diffusers' quantizers.

One process on the tiny Wan checkpoint (the quickstart's ``./tiny-wan``): ``--quantize int8`` (torchao int8
weight-only through a ``PipelineQuantizationConfig``) and ``--quantize gguf:PATH`` (the transformer from a ``.gguf``
file written with the ``gguf`` package) write exactly what the same pipeline, loaded by diffusers with the same
quantization, computes unpatched (one rank splits nothing: bit for bit); ``--quantize gguf:PATH --shard-weights`` at 2
ranks writes what the same plan writes unsharded. Several ranks on quantized models are otherwise
tests/patches/test_quantized.py's. Skipped without the [quant] extra.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import torch
from cli_commands import ROOT, checkout_env, launch

from hfpatch import cli
from hfpatch.testing.quantized import available_kinds

WAN_ARGS = [
    "--prompt", "a cat", "--negative-prompt", "blurry", "--height", "32", "--width", "32",
    "--frames", "5", "--steps", "2", "--pipeline-kwargs", '{"max_sequence_length": 8}',
]  # fmt: skip


def _wan_call(pipe: Any) -> torch.Tensor:
    return pipe(
        prompt="a cat", negative_prompt="blurry", height=32, width=32, num_frames=5, num_inference_steps=2,
        max_sequence_length=8, output_type="pt", generator=torch.Generator().manual_seed(0),
    ).frames  # fmt: skip


@pytest.mark.skipif(
    not {"torchao-int8", "gguf-q8_0"} <= set(available_kinds()),
    reason="needs torchao and gguf ([quant] extra)",
)
def test_generate_quantize_int8_and_gguf(tmp_path, capsys):
    from diffusers import (
        GGUFQuantizationConfig,
        PipelineQuantizationConfig,
        TorchAoConfig,
        WanPipeline,
        WanTransformer3DModel,
    )
    from torchao.quantization import Int8WeightOnlyConfig

    from hfpatch.distributed.stored import quantized_kind
    from hfpatch.testing import tiny_wan_pipe
    from hfpatch.testing.quantized import write_gguf

    folder, gguf = tmp_path / "wan", str(tmp_path / "transformer.gguf")
    pipe = tiny_wan_pipe(text_encoder=True)
    pipe.save_pretrained(folder)
    write_gguf(pipe.transformer, gguf)

    assert (
        cli.main(["generate", str(folder), *WAN_ARGS, "--quantize", "int8", "--out", f"{tmp_path}/i.pt"]) == 0
    )
    config = PipelineQuantizationConfig(quant_mapping={"transformer": TorchAoConfig(Int8WeightOnlyConfig())})
    expected = WanPipeline.from_pretrained(folder, quantization_config=config, dtype=torch.float32)
    assert quantized_kind(expected.transformer.blocks[0].attn1.to_q.weight) == "torchao Int8Tensor"
    assert torch.equal(torch.load(tmp_path / "i.pt"), _wan_call(expected))

    assert (
        cli.main(
            ["generate", str(folder), *WAN_ARGS, "--quantize", f"gguf:{gguf}", "--out", f"{tmp_path}/g.pt"]
        )
        == 0
    )
    transformer = WanTransformer3DModel.from_single_file(
        gguf, config=str(folder), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32,
    )  # fmt: skip
    expected = WanPipeline.from_pretrained(folder, transformer=transformer, dtype=torch.float32)
    assert quantized_kind(expected.transformer.blocks[0].attn1.to_q.weight) == "GGUF Q8_0"
    assert torch.equal(torch.load(tmp_path / "g.pt"), _wan_call(expected))


@pytest.mark.skipif("gguf-q8_0" not in available_kinds(), reason="needs gguf ([quant] extra)")
def test_generate_gguf_shard_weights_on_two_ranks_equals_the_same_plan_unsharded(tmp_path):
    """``--quantize gguf:PATH --shard-weights`` at 2 ranks (``hfpatch.from_pretrained`` reads the file through a
    mapping, each rank copying its rows of the quantized weights) writes what the same command without
    ``--shard-weights`` writes, bit for bit: one launch runs both."""
    from hfpatch.testing import tiny_wan_pipe
    from hfpatch.testing.quantized import write_gguf

    folder, gguf = tmp_path / "wan", str(tmp_path / "transformer.gguf")
    pipe = tiny_wan_pipe(text_encoder=True)
    pipe.save_pretrained(folder)
    write_gguf(pipe.transformer, gguf)
    base = ["generate", str(folder), *WAN_ARGS, "--quantize", f"gguf:{gguf}", "--parallel", "2"]
    commands = [
        [*base, "--out", f"{tmp_path}/plain.pt"],
        [*base, "--shard-weights", "--out", f"{tmp_path}/sharded.pt"],
    ]
    done = subprocess.run(  # one launch runs both (tests/cli_commands.py)
        launch(commands, tmp_path), capture_output=True, text=True, timeout=600,
        env={**checkout_env(), "OMP_NUM_THREADS": "1"}, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert torch.equal(torch.load(tmp_path / "sharded.pt"), torch.load(tmp_path / "plain.pt"))


def test_generate_quantize_unknown_kind_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "org/model", "--prompt", "x", "--quantize", "int4", "--out", "x.pt"])
    assert exit_info.value.code == 2
    assert "unknown quantization 'int4'; known: int8, fp8, nf4, gguf:PATH" in capsys.readouterr().err
