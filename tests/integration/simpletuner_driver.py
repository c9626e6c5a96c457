"""SimpleTuner's ``train.py`` under torchrun, recorded (tests/integration/test_simpletuner.py runs it).

``HFPATCH_SIMPLETUNER=1``: through ``python -m hfpatch.training.simpletuner``'s :func:`main` (the integration);
otherwise SimpleTuner's script as it ships (the stock reference). Either way each rank writes
``$RECORD_DIR/rank{N}.pt`` at exit: per micro-step the batch's files, latents, noise, timesteps and loss; the patch
on the trained model (``repr(hfpatch.get_patch(model))``); each validation (no-grad) call's output and the tokens its
first block sees; per optimizer step the gradient the optimizer applies and the weights after it (every trained
parameter, in order).

On a machine without CUDA, pinned memory is a no-op (SimpleTuner's collate pins the latents, which a CUDA build of
torch refuses without a driver); LTX-Video's scheduler hook returns the model folder's scheduler
(:func:`_ltx_scheduler`); nothing else of SimpleTuner is touched.
"""

from __future__ import annotations

import atexit
import os
import runpy

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hfpatch import get_patch

if not torch.cuda.is_available():
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

RECORD = {"micro": [], "steps": []}


def _flat(optimizer, what):
    tensors = [getattr(p, what) for group in optimizer.param_groups for p in group["params"]]
    return torch.cat([t.detach().double().flatten() for t in tensors if t is not None])


def _count_validation_tokens(_module, args, kwargs) -> None:
    if not torch.is_grad_enabled():
        RECORD["validation_tokens"].append((args[0] if args else kwargs["hidden_states"]).shape[1])


def _validation_output(_module, _args, output) -> None:
    if not torch.is_grad_enabled():
        sample = output[0] if isinstance(output, tuple) else output.sample
        RECORD["validation"].append(sample.detach().double().cpu().clone())


def _install() -> None:
    from simpletuner.helpers.training.trainer import Trainer

    stock_prepare, stock_loss = Trainer.prepare_batch, Trainer._compute_model_prediction_loss

    def prepare_batch(self, batch):
        prepared = stock_prepare(self, batch)
        if not isinstance(prepared, dict):  # the fetch past an epoch's last batch
            return prepared
        RECORD["micro"].append(
            {
                "files": [
                    os.path.basename(f) for f in prepared.get("filepaths") or batch.get("filepaths") or []
                ],
                **{
                    k: prepared[k].detach().double().cpu().clone()
                    for k in ("latents", "noise", "timesteps", "encoder_hidden_states")
                },
            }
        )
        return prepared

    def compute_loss(self, prepared_batch):
        out = stock_loss(self, prepared_batch)
        RECORD["micro"][-1]["loss"] = float(out[0].detach())
        model = self.model.get_trained_component(unwrap_model=True)
        RECORD["patch"] = repr(get_patch(model))
        if "validation" not in RECORD:
            # The no-grad (validation) calls: the model's output, and the tokens its first block sees.
            RECORD["validation"], RECORD["validation_tokens"] = [], []
            first = model.blocks[0] if hasattr(model, "blocks") else model.transformer_blocks[0]
            first.register_forward_pre_hook(_count_validation_tokens, with_kwargs=True)
            model.register_forward_hook(_validation_output)
        return out

    Trainer.prepare_batch, Trainer._compute_model_prediction_loss = prepare_batch, compute_loss
    register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: RECORD["steps"].append(
            {"grad": _flat(opt, "grad"), "before": _flat(opt, "data"), "micro": len(RECORD["micro"])}
        )
    )
    register_optimizer_step_post_hook(
        lambda opt, args, kwargs: RECORD["steps"][-1].update(weights=_flat(opt, "data"))
    )


def _ltx_scheduler() -> None:
    """SimpleTuner 4.10.1's LTX-Video asks for a pipeline-specific scheduler (``requires_special_scheduler_setup``)
    and its hook returns none, so encoding the text cache builds ``LTXPipeline`` without one (a ``TypeError``): the
    hook loads the model folder's scheduler, in the stock and the hfpatch runs alike."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from simpletuner.helpers.models.ltxvideo.model import LTXVideo

    def load_scheduler(self, pipeline_type):
        return FlowMatchEulerDiscreteScheduler.from_pretrained(
            self._model_config_path(), subfolder="scheduler"
        )

    LTXVideo._load_scheduler_for_pipeline = load_scheduler


def _save() -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    torch.save(RECORD, os.path.join(os.environ["RECORD_DIR"], f"rank{rank}.pt"))


if __name__ == "__main__":
    _install()
    _ltx_scheduler()
    atexit.register(_save)
    if os.environ.get("HFPATCH_SIMPLETUNER") == "1":
        from hfpatch.training.simpletuner import main

        main()
    else:
        runpy.run_module("simpletuner.train", run_name="__main__", alter_sys=True)
