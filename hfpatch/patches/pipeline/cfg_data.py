"""CFG parallel and data parallel for diffusers pipelines, by patching the transformer calls of a pipeline.

Both parallelisms act on the batch of each transformer call and nothing else: every rank builds the same
full latents from the same generator, runs the scheduler and the VAE on the full batch, and only the
transformer work is divided. So the noise of every sample is the noise of the unpatched run (latents are
generated in full, then sliced), and every rank returns the full output.

- **CFG parallel** (``cfg=2``, mesh axis ``"cfg"``): cfg rank 0 computes the conditional prediction,
  cfg rank 1 the unconditional one, and one all-gather per step gives both ranks both predictions.
  Two call patterns are recognised:

  * *two calls per step* (``WanPipeline``): the cond call runs inside ``transformer.cache_context("cond")``,
    the uncond call inside ``cache_context("uncond")``. On cfg rank 1 the cond call returns a placeholder
    that is filled in place when the uncond call has run; on cfg rank 0 the uncond call computes nothing
    and receives. Any other order of calls raises ``RuntimeError`` instead of returning a wrong result.
    A transformer whose weights FSDP2 shards over ranks of both cfg branches (``shard_weights=True``, or the
    user's ``fully_shard``) all-gathers each block in every forward, so the branches must compute in the same
    call: there cfg rank 0 also returns a placeholder from the cond call and computes the cond prediction at
    the uncond call, in step with cfg rank 1 (still bit-exact: the same calls on the same arguments).
  * *batched* (``StableDiffusion3Pipeline``: ``torch.cat([uncond, cond])``, batch ``2B``): the batch is
    split over the cfg ranks inside the transformer call and the outputs are all-gathered.

- **Data parallel** (``data>1``, mesh axis ``"data"``): each transformer call's batch (prompts x
  ``num_images_per_prompt``, and both CFG halves where they are batched) is split over the data ranks,
  unevenly where it does not divide, and the outputs are all-gathered.

Any diffusers pipeline works, whatever its denoiser class. The denoisers are the components whose class is
in :data:`PER_SAMPLE_ARGS`, plus the diffusers models named ``transformer``, ``transformer_2`` or ``unet``
(:data:`DENOISER_NAMES`). How each forward argument is split:

- *Known classes* (:data:`PER_SAMPLE_ARGS`): an explicit list of batched arguments and of arguments passed
  whole (Flux's ``txt_ids``/``img_ids`` are ``[seq, 3]`` positions, not per sample); anything else is refused.
- *Any other class*, decided per call (:func:`generic_split`): the batch is the leading dim of the first
  forward argument (``hidden_states``, ``sample``). A tensor with that leading dim is split; ``None``, plain
  Python values, 0-d tensors and tensors of leading dim 1 pass whole; a flat dict of tensors (SDXL's
  ``added_cond_kwargs``) follows the same rule per entry; a tensor of another leading dim, or a list/tuple or
  nested structure holding tensors (``joint_attention_kwargs`` with IP-adapter embeds), raises ``TypeError``
  naming the argument, on every rank alike and before the split's collectives. **Limit:** a tensor without
  a batch dim whose leading dim happens to equal the batch (batch 3 and a ``[3, k]`` table) cannot be told
  apart from a batched one and is split: register such classes in :data:`PER_SAMPLE_ARGS`. Per-sample Python
  lists (QwenImage's ``img_shapes``) pass whole.

CFG parallel for a pipeline in neither CFG table (decided from its calls, any ``cfg=2`` request accepted):

- Calls with no ``cache_context`` or in ``cache_context("cond_uncond")`` hold the whole batch (diffusers'
  batched CFG, ``[uncond, cond]``): their batch is split over the cfg ranks, which is exact whatever it holds.
- Calls in ``cache_context("cond")``/``("uncond")`` (true CFG: Flux, QwenImage, HunyuanVideo, ...): the first
  step of every pipeline call runs each call on every cfg rank (exact) while hfpatch watches it. If it made one
  cond call, then one uncond call of the same transformer, and did not compute with the cond prediction in
  between, the later steps run cond on cfg rank 0 and uncond on cfg rank 1 (one all-gather per step,
  bit-exact); otherwise the call stays unsplit over cfg (exact, no CFG speed-up) and the reason is logged
  (``logging.INFO``: a Flux call without a negative prompt makes one call per step). The cond prediction
  returned in the parallel steps refuses any computation before its uncond call, on both cfg ranks alike, so a
  pipeline whose pattern changes after the first step raises instead of using a missing value. The planner
  proposes ``cfg=2`` (``parallel=N``) only for the tables and for batched-CFG pipelines (their ``__call__``
  builds ``torch.cat([latents] * 2)``): true CFG is opt-in per call, and without it the second cfg rank idles.

Sequence parallelism of the transformer (its own family, mesh axes ``"ring"``/``"ulysses"``) runs inside
these calls unchanged: the data and cfg groups are orthogonal to the sequence-parallel group. The wrapper
replaces the transformer's ``forward`` (per object), so module hooks on submodules run only where the
transformer really computes; a forward hook on the transformer itself would see the cfg-rank-1 placeholder
of the two-call pattern before it is filled.

>>> import hfpatch, torch
>>> from hfpatch.testing import tiny_wan_pipe
>>> from hfpatch.patches.pipeline import PipelineParallel
>>> PipelineParallel().facts(tiny_wan_pipe()).guides   # WanPipeline guides: parallel=N plans cfg=2
True
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..denoisers import DENOISER_NAMES, PER_SAMPLE_ARGS, known_class

__all__ = [
    "BATCHED_CFG_PIPELINES",
    "DENOISER_NAMES",
    "PER_SAMPLE_ARGS",
    "TWO_CALL_CFG_PIPELINES",
    "generic_split",
]

#: Pipelines that call the transformer twice per step, in ``cache_context("cond")`` then ``("uncond")``,
#: and expose ``do_classifier_free_guidance`` (read at the cond call to know that an uncond call follows).
TWO_CALL_CFG_PIPELINES: tuple[str, ...] = ("WanPipeline",)
#: Pipelines that batch ``[uncond, cond]`` into one transformer call.
BATCHED_CFG_PIPELINES: tuple[str, ...] = ("StableDiffusion3Pipeline",)


def holds_tensor(value: Any) -> bool:
    """Whether a dict/list/tuple/set holds a tensor, at any depth."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_tensor(v) for v in value)
    return False


def leading_dim(value: Any) -> int | None:
    """The leading dim of a tensor of at least one dim, else ``None``."""
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def generic_split(model_name: str, arguments: dict[str, Any], batch_arg: str) -> tuple[str, ...]:
    """The arguments of a forward call of an unlisted denoiser class to split along dim 0 (see module doc).

    Args:
        model_name: The class name, for errors.
        arguments: Argument name -> value of the call (``**kwargs`` entries flattened in, ``self`` left out).
        batch_arg: The argument whose leading dim is the batch (the forward's first parameter).

    Raises:
        TypeError: An argument whose batch dim cannot be told: a tensor of another leading dim than the
            batch (and not 1), or a container holding tensors other than a flat dict of them.

    >>> import torch
    >>> x = torch.zeros(2, 4)
    >>> generic_split("M", {"hidden_states": x, "t": torch.zeros(2), "ids": torch.zeros(1, 3), "n": 3}, "hidden_states")
    ('hidden_states', 't')
    """
    hidden = arguments.get(batch_arg)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() == 0:
        raise TypeError(
            f"{model_name}.forward needs {batch_arg} as a batched tensor, got {type(hidden).__name__}"
        )
    batch = hidden.shape[0]
    split: list[str] = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            if value.dim() > 0 and value.shape[0] == batch:
                split.append(name)
            elif value.dim() > 0 and value.shape[0] != 1:
                raise TypeError(
                    f"hfpatch data/CFG parallel cannot tell whether {model_name}.forward argument {name} (shape "
                    f"{tuple(value.shape)}) carries the batch dim: its leading dim is neither the batch {batch} of "
                    f"{batch_arg} nor 1. Use cfg=1 and data=1 for this pipeline, or list {model_name} in "
                    "hfpatch.patches.pipeline.PER_SAMPLE_ARGS."
                )
        elif (
            isinstance(value, dict)
            and all(isinstance(v, torch.Tensor) or not holds_tensor(v) for v in value.values())
            and all(leading_dim(v) in (None, 1, batch) for v in value.values())
        ):
            # A flat dict of per-sample tensors (SDXL's added_cond_kwargs): its tensors follow the rule above.
            if any(leading_dim(v) == batch for v in value.values()):
                split.append(name)
        elif holds_tensor(value):
            raise TypeError(
                f"hfpatch data/CFG parallel cannot tell whether the tensors inside {model_name}.forward argument "
                f"{name} ({type(value).__name__}) carry the batch dim. Use cfg=1 and data=1 for this call, or list "
                f"{model_name} in hfpatch.patches.pipeline.PER_SAMPLE_ARGS."
            )
    return tuple(split)


# ----------------------------------------------------------------------------------------------- CFG mode
# They read the tables above at call time: code (and tests) that rebinds a table here is seen at the next apply.
def batches_cfg(pipe: Any) -> bool:
    """Whether a pipeline outside the CFG tables shows diffusers' batched-CFG pattern: it has
    ``do_classifier_free_guidance`` (a property, or a local of ``__call__`` as in PixArt) and its ``__call__``
    builds ``torch.cat([latents] * 2)`` and makes no ``cache_context("uncond")`` call (a read of its source).
    Only the plan depends on it: the calls themselves are checked when they come (``mode="generic"``)."""
    try:
        source = inspect.getsource(type(pipe).__call__)
    except (OSError, TypeError):  # no source (compiled, interactive): not recognised
        return False
    guides = hasattr(type(pipe), "do_classifier_free_guidance") or "do_classifier_free_guidance" in source
    return guides and "[latents] * 2" in source and 'cache_context("uncond")' not in source


def cfg_mode(pipe: Any) -> str:
    """``"two_call"``/``"batched"`` for the CFG tables, else ``"generic"`` (decided from the calls)."""
    if known_class(pipe, TWO_CALL_CFG_PIPELINES):
        return "two_call"
    if known_class(pipe, BATCHED_CFG_PIPELINES):
        return "batched"
    return "generic"


def plans_cfg(pipe: Any) -> bool:
    """Whether ``parallel=N`` should plan a cfg degree: the tables, and pipelines that batch their CFG (a read
    of ``__call__``'s source). Two-call pipelines outside the tables (Flux and QwenImage true CFG, opt-in per
    call) get ``cfg=2`` only when asked for: without a negative prompt that rank would idle."""
    return known_class(pipe, TWO_CALL_CFG_PIPELINES + BATCHED_CFG_PIPELINES) is not None or batches_cfg(pipe)
