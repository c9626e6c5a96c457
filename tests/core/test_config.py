"""The planner: a table of valid plans and of invalid ones with their exact error messages."""

from __future__ import annotations

import pytest

from hfpatch.core.config import ModelFacts, ParallelConfig, plan_parallel, resolve_parallel

VALID = [
    # (parallel, world, facts, expected degrees (data, cfg, ring, ulysses, vae))
    (1, 1, ModelFacts(num_heads=4), (1, 1, 1, 1, 1)),
    (2, 2, ModelFacts(num_heads=4, guides=True), (1, 2, 1, 1, 2)),
    (4, 4, ModelFacts(num_heads=4), (1, 1, 1, 4, 4)),
    (6, 6, ModelFacts(num_heads=4), (1, 1, 3, 2, 6)),  # Ulysses up to what divides the heads, rest Ring
    (8, 8, ModelFacts(num_heads=12, guides=True), (1, 2, 1, 4, 8)),
    (3, 3, ModelFacts(num_heads=4, guides=True), (1, 1, 3, 1, 3)),  # odd: no CFG split possible
    (5, 5, ModelFacts(num_heads=5), (1, 1, 1, 5, 5)),
    (4, 4, ModelFacts(), (1, 1, 1, 1, 4)),  # VAE only: every rank splits the VAE
    # A guiding pipeline without a sequence-parallel transformer (a UNet): CFG when it fills every rank.
    (2, 2, ModelFacts(guides=True, pipeline=True), (1, 2, 1, 1, 2)),
    (4, 4, ModelFacts(guides=True, pipeline=True), (1, 1, 1, 1, 4)),
    (None, 2, ModelFacts(num_heads=2), (1, 1, 1, 2, 2)),  # None = the world size
    (ParallelConfig(cfg=2, ulysses=2, ring=2), 8, ModelFacts(num_heads=4, guides=True), (1, 2, 2, 2, 8)),
    (ParallelConfig(data=2, ulysses=2), 4, ModelFacts(num_heads=4, pipeline=True), (2, 1, 1, 2, 4)),
    (ParallelConfig(data=2, ulysses=2), 4, ModelFacts(num_heads=4), (2, 1, 1, 2, 4)),  # sp replicas
    (ParallelConfig(ulysses=2, vae=1), 2, ModelFacts(num_heads=2), (1, 1, 1, 2, 1)),
    (1, 4, ModelFacts(num_heads=4), (1, 1, 1, 1, 1)),  # parallel=1 in a bigger world: each rank on its own
    # No family splits a VAE of the target (a bare transformer; issue 45: its plan printed vae=2): vae=1, by plan
    # or by an explicit config whose vae defaulted to every rank.
    (2, 2, ModelFacts(num_heads=4, splits_vae=False), (1, 1, 1, 2, 1)),
    (4, 4, ModelFacts(num_heads=2, splits_vae=False), (1, 1, 2, 2, 1)),
    (ParallelConfig(data=2, ulysses=2), 4, ModelFacts(num_heads=4, splits_vae=False), (2, 1, 1, 2, 1)),
    # a VAE-only plan on a transformer: whole on 2 ranks
    (ParallelConfig(vae=2), 2, ModelFacts(num_heads=4, splits_vae=False), (1, 1, 1, 1, 2)),
]


@pytest.mark.parametrize("parallel, world, facts, expected", VALID)
def test_resolve_parallel_valid_plans(parallel, world, facts, expected):
    config = resolve_parallel(parallel, world, facts)
    assert (config.data, config.cfg, config.ring, config.ulysses, config.vae) == expected
    assert config.world_size in (world, 1)


INVALID = [
    (
        ParallelConfig(data=2),
        2,
        ModelFacts(num_heads=4, name="WanTransformer3DModel"),
        "data=2 splits a pipeline's prompts over ranks; WanTransformer3DModel is not a pipeline. Apply hfpatch "
        "to the pipeline, or use data=1 (wrap the model in DDP for data parallel training). On a transformer, "
        "data>1 only adds replicas to sequence parallel (ulysses/ring > 1).",
    ),
    (
        ParallelConfig(ulysses=6),
        6,
        ModelFacts(num_heads=4, name="WanTransformer3DModel"),
        "ulysses=6 exceeds the 4 attention heads of WanTransformer3DModel; use ulysses <= 4 and put the "
        "remaining ranks into ring",
    ),
    (
        ParallelConfig(cfg=2),
        2,
        ModelFacts(num_heads=4, name="WanTransformer3DModel"),
        "cfg=2 splits a pipeline's classifier-free guidance; WanTransformer3DModel is not a pipeline. Apply "
        "hfpatch to the pipeline, or use cfg=1 and put the ranks into ulysses/ring.",
    ),
    (
        ParallelConfig(ulysses=2, ring=2),
        8,
        ModelFacts(num_heads=4),
        "ParallelConfig(data=1, cfg=1, ring=2, ulysses=2, vae=4) uses 4 ranks (data*cfg*ring*ulysses) but the "
        "world size is 8; launch with `torchrun --nproc-per-node 4` or choose degrees that multiply to 8",
    ),
    (
        4,
        2,
        ModelFacts(num_heads=4),
        "ParallelConfig(data=1, cfg=1, ring=1, ulysses=4, vae=4) uses 4 ranks (data*cfg*ring*ulysses) but the "
        "world size is 2; launch with `torchrun --nproc-per-node 4` or choose degrees that multiply to 2",
    ),
    (
        ParallelConfig(ring=2),
        2,
        ModelFacts(name="AutoencoderKLWan"),
        "ulysses=1, ring=2 need a transformer; AutoencoderKLWan has none. Use ParallelConfig(vae=N) for a VAE.",
    ),
]


@pytest.mark.parametrize("parallel, world, facts, message", INVALID)
def test_resolve_parallel_invalid_plans_exact_messages(parallel, world, facts, message):
    with pytest.raises(ValueError) as info:
        resolve_parallel(parallel, world, facts)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cfg=3), "ParallelConfig.cfg must be 1 or 2 (cond and uncond), got 3"),
        (dict(ulysses=0), "ParallelConfig.ulysses must be a positive int, got 0"),
        (dict(ring=2.0), "ParallelConfig.ring must be a positive int, got 2.0"),
        (dict(ulysses=2, vae=3), "ParallelConfig.vae=3 must be 1 or data*cfg*ring*ulysses=2"),
    ],
)
def test_parallel_config_rejects_bad_degrees(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "4"])
def test_plan_rejects_non_positive_int(bad):
    with pytest.raises((ValueError, TypeError)):
        resolve_parallel(bad, 1, ModelFacts(num_heads=4))


def test_plan_parallel_is_pure_and_deterministic():
    facts = ModelFacts(num_heads=24, guides=True)
    assert all(plan_parallel(n, facts) == plan_parallel(n, facts) for n in range(1, 17))
    assert all(plan_parallel(n, facts).world_size == n for n in range(1, 17))


# ----------------------------------------------------------------------------------------------- PipeFusion
PIPEFUSION_PLANS = [
    # (n, facts, expected (cfg, pipefusion, ulysses, ring, vae)): CFG first (exact), then PipeFusion takes the rest
    (4, ModelFacts(num_heads=4, guides=True, num_blocks=5), (2, 2, 1, 1, 4)),
    (2, ModelFacts(num_heads=4, guides=True, num_blocks=5), (2, 1, 1, 1, 2)),  # CFG took both ranks
    (2, ModelFacts(num_heads=4, num_blocks=5), (1, 2, 1, 1, 2)),  # no guidance (Flux): PipeFusion takes both
    (3, ModelFacts(num_heads=4, guides=True, num_blocks=5), (1, 3, 1, 1, 3)),  # odd: no CFG split
    (5, ModelFacts(num_heads=4, num_blocks=5), (1, 5, 1, 1, 5)),  # one block per stage
    (8, ModelFacts(num_heads=4, guides=True, num_blocks=40), (2, 4, 1, 1, 8)),
    (1, ModelFacts(num_heads=4, num_blocks=5), (1, 1, 1, 1, 1)),
    # more ranks than blocks: the other factor runs sequence parallel in each stage (Ulysses, then Ring)
    (12, ModelFacts(num_heads=4, guides=True, num_blocks=5), (2, 3, 2, 1, 12)),
    (8, ModelFacts(num_heads=4, guides=True, num_blocks=2), (2, 2, 2, 1, 8)),
    (6, ModelFacts(num_heads=2, num_blocks=1), (1, 1, 2, 3, 6)),
]


@pytest.mark.parametrize("n, facts, expected", PIPEFUSION_PLANS)
def test_plan_parallel_pipefusion_only_when_asked(n, facts, expected):
    config = resolve_parallel(n, n, facts, pipefusion=True)
    assert (config.cfg, config.pipefusion, config.ulysses, config.ring, config.vae) == expected
    assert config.world_size == n
    default = resolve_parallel(n, n, facts)  # never proposed unless asked: it is approximate
    assert default.pipefusion == 1 and default == plan_parallel(n, facts)


def test_plan_parallel_pipefusion_sequence_parallel_only_for_ranks_over_the_blocks():
    for n in range(1, 33):
        for blocks in (1, 2, 3, 5, 8):
            for guides in (False, True):
                facts = ModelFacts(num_heads=4, guides=guides, num_blocks=blocks, name="WanPipeline")
                config = plan_parallel(n, facts, pipefusion=True)
                rest = n // config.cfg
                assert config.pipefusion <= blocks and config.world_size == n
                assert config.pipefusion == max(d for d in range(1, blocks + 1) if rest % d == 0)
                assert 4 % config.ulysses == 0  # Ulysses within the heads, Ring for the rest
                if config.sequence_parallel > 1:
                    assert rest > blocks


@pytest.mark.parametrize(
    "parallel, world, facts, message",
    [
        (
            2,
            2,
            ModelFacts(num_heads=4, name="StableDiffusion3Pipeline"),
            "pipefusion=True lets the planner split a transformer's blocks over ranks, but StableDiffusion3Pipeline "
            "has no transformer that hfpatch's PipeFusion supports; drop pipefusion=True",
        ),
        (
            ParallelConfig(ulysses=2),
            2,
            ModelFacts(num_heads=4, num_blocks=5),
            "pipefusion=True lets the planner of an int parallel=N choose a PipeFusion degree, but parallel="
            "ParallelConfig(data=1, cfg=1, ring=1, ulysses=2, vae=2) names the degrees; set "
            "ParallelConfig(pipefusion=P, ...) there instead",
        ),
    ],
)
def test_plan_parallel_pipefusion_errors(parallel, world, facts, message):
    with pytest.raises(ValueError) as info:
        resolve_parallel(parallel, world, facts, pipefusion=True)
    assert str(info.value) == message


def test_pipefusion_degree_needs_a_pipefusion_family():
    facts = ModelFacts(num_heads=4, name="StableDiffusion3Pipeline", pipeline=True)  # no num_blocks
    with pytest.raises(ValueError) as info:
        resolve_parallel(ParallelConfig(pipefusion=2, ulysses=2), 4, facts)
    assert str(info.value) == (
        "pipefusion=2 splits a transformer's blocks, but StableDiffusion3Pipeline has no transformer that "
        "hfpatch's PipeFusion supports; use ulysses/ring (and cfg/data) without PipeFusion"
    )


def test_plan_parallel_pipefusion_flag_must_be_bool():
    with pytest.raises(ValueError, match="pipefusion must be True or False"):
        resolve_parallel(2, 2, ModelFacts(num_heads=4, num_blocks=5), pipefusion=2)


def test_a_bare_transformer_plans_no_vae_split_and_its_pipeline_does(monkeypatch):
    """Issue 45: a bare transformer's plan printed ``vae=2``. The plan ``apply`` resolves (no group is created:
    the launcher's variables only) says ``vae=1`` for a transformer, ``vae=N`` for a pipeline whose VAE splits."""
    from hfpatch.api import _plan
    from hfpatch.core.ranks import LAUNCH_VARS
    from hfpatch.testing import tiny_wan_pipe, tiny_wan_transformer

    for name in LAUNCH_VARS:
        monkeypatch.setenv(name, {"WORLD_SIZE": "2"}.get(name, "0"))
    assert (
        repr(_plan(tiny_wan_transformer(), 2, {}))
        == "ParallelConfig(data=1, cfg=1, ring=1, ulysses=2, vae=1)"
    )
    assert _plan(tiny_wan_pipe(), 2, {}).vae == 2
