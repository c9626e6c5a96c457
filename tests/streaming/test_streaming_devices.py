"""The streaming pipeline and streaming training follow the model's device and diffusers' generator
convention (``diffusers.utils.torch_utils.randn_tensor``): a CPU generator drives noise for a model on any
device; a list of generators seeds each batch item.

No GPU here, so CUDA's rule is emulated: :func:`hfpatch.testing.devices.generator_device_rule` raises, as CUDA does ("Expected a 'cuda'
device type for generator but found 'cpu'"), when a random op's generator lives on another device type than
its output; the model, VAE and prompt live on ``meta`` (another device than the CPU generator, shapes only).
Before the fix both the pipeline (``_renoise``) and training raised this on a CUDA model seeded with a CPU
generator (measured on an H100); here the same calls raise under the rule.
"""

from __future__ import annotations

import pytest
import torch

import hfpatch
from hfpatch.streaming import StreamingConfig, StreamingTrainingModel, StreamingWanPipeline
from hfpatch.testing import tiny_wan_pipe, tiny_wan_transformer, wan_prompt_embeds
from hfpatch.testing.devices import generator_device_rule

CONFIG = StreamingConfig(num_frame_per_block=2, local_attn_size=6, sink_size=2)
KWARGS = dict(height=16, width=32, denoising_step_list=(1000, 600, 300), context_noise=50)


def test_rule_raises_like_cuda_on_a_device_mismatch():
    with (
        generator_device_rule(),
        pytest.raises(RuntimeError, match="Expected a 'meta' device type for generator"),
    ):
        torch.randn(3, generator=torch.Generator(), device="meta")
    with generator_device_rule() as rule:
        torch.randn(3, generator=torch.Generator()).to("meta")
    assert rule.draws == [("cpu", "cpu")]


def test_streaming_pipeline_on_another_device_than_the_cpu_generator():
    pipe = tiny_wan_pipe()
    pipe.transformer.to("meta")
    pipe.vae.to("meta")
    stream = StreamingWanPipeline.from_pipe(pipe, CONFIG)
    try:
        with generator_device_rule() as rule:
            chunks = list(
                stream.stream(
                    wan_prompt_embeds().to("meta"), 3, generator=torch.Generator().manual_seed(0), **KWARGS
                )
            )
    finally:
        stream.remove()
    assert [c.latents.device.type for c in chunks] == ["meta"] * 3
    assert chunks[-1].frames.shape == (1, 8, 3, 16, 32) and chunks[-1].frames.device.type == "meta"
    assert rule.draws and all(d == ("cpu", "cpu") for d in rule.draws)  # drawn on the generator's device


def test_streaming_training_on_another_device_than_the_cpu_generator():
    model = tiny_wan_transformer().to("meta")
    with hfpatch.apply(model, streaming=CONFIG):
        trainer = StreamingTrainingModel(
            model, CONFIG, chunk_size=6, min_new_frames=2, denoising_step_list=(1000, 750, 500)
        )
        trainer.setup_sequence(wan_prompt_embeds().to("meta"), latent_shape=(4, 4, 4), max_length=16)
        with generator_device_rule() as rule:
            for requires_grad in (True, False):
                chunk, info = trainer.generate_next_chunk(
                    requires_grad=requires_grad, generator=torch.Generator().manual_seed(0)
                )
                assert chunk.device.type == "meta" and chunk.shape == (1, 4, 6, 4, 4)
                assert info.gradient_mask.device.type == "meta"
    assert rule.draws and all(d == ("cpu", "cpu") for d in rule.draws)


def test_streaming_pipeline_list_of_generators_seeds_each_batch_item():
    """diffusers' convention: generator i draws item i's noise, as a batch-1 run seeded with it would."""
    stream = StreamingWanPipeline.from_pipe(tiny_wan_pipe(), CONFIG)
    try:
        prompt = wan_prompt_embeds(batch=2)
        both = list(stream.stream(prompt, 2, generator=[torch.Generator().manual_seed(s) for s in (0, 1)],
                                  output_type="latent", **KWARGS))  # fmt: skip
        alone = [list(stream.stream(prompt[i : i + 1], 2, generator=torch.Generator().manual_seed(i),
                                    output_type="latent", **KWARGS)) for i in (0, 1)]  # fmt: skip
    finally:
        stream.remove()
    for block in range(2):
        for i in (0, 1):
            # Same noise, same model: batch 1 and batch 2 differ only by GEMM blocking (fp32 reassociation).
            torch.testing.assert_close(
                both[block].latents[i : i + 1], alone[i][block].latents, rtol=1e-4, atol=1e-5
            )
    # Different seeds per item: the items differ.
    assert not torch.allclose(both[-1].latents[0], both[-1].latents[1])
