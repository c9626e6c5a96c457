"""The MoE load-balancing loss under sequence parallelism, exact.

transformers' ``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6: Qwen3-VL-MoE, GLM-4.5V) is
``E * sum_e f_e * P_e``, where ``f_e`` is the share of top-k assignments that go to expert ``e`` and ``P_e`` the mean
router probability of ``e``, both means over every real token of every layer: a product of two GLOBAL means, which
no sum of per-shard losses equals. Under the split each rank holds the router logits of its own tokens only
(``[B * L, E]`` per layer), so each rank sums its rows' top-k hits, probabilities and count, weighted by its shard
of the 2D ``attention_mask`` with hfpatch's end padding left out, and the three partial sums are added over the
``sp`` group (``2 E + 1`` numbers, never the router logits: 128k tokens x 512 experts x 48 layers would be 12 GB in
fp32); the loss is then the stock formula on the sums, identical on every rank. The probability sums are
differentiable, with hfpatch's gradient convention (each rank's gradient scaled by the group size, the mean over
the group the unpatched gradient). Routing itself is per token and untouched.

How it is reached, per object: the decoder's outputs carry the router logits as :class:`RouterLogits` (a tuple
with the split), and the modeling module's ``load_balancing_loss_func`` is, while any patch needs it, a dispatcher
that computes the exact loss for a :class:`RouterLogits` and calls the stock function for anything else (another
model of the class, or this one inside ``patch.disabled()``); the last patch removed puts the stock function back.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from ...core.patch import Patch
from ...distributed.collectives import all_gather
from ...distributed.gradients import grad_scaled_by_group

__all__ = ["RouterLogits", "exact_load_balancing_loss", "install_exact_aux_loss"]

_NAME = "load_balancing_loss_func"
#: Modeling module name -> [stock function, dispatcher, patches using it].
_INSTALLED: dict[str, list[Any]] = {}


class RouterLogits(tuple):
    """A forward's router logits, per layer ``[B * L, E]`` for this rank's ``L`` tokens, with what the exact
    load-balancing loss needs: the split and which of the rows are real tokens (``valid``, ``[B, L]``: hfpatch's end
    padding is 0). A copy or a pickle is a plain tuple."""

    split: Any
    valid: torch.Tensor

    def __new__(cls, logits: tuple[torch.Tensor, ...], split: Any, valid: torch.Tensor) -> RouterLogits:
        self = super().__new__(cls, logits)
        self.split = split
        self.valid = valid
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (tuple(self),))


def exact_load_balancing_loss(
    gate_logits: RouterLogits, num_experts: int, top_k: int, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over the whole sequence from each rank's own router logits: the
    partial sums are added over the ``sp`` group (see the module docstring); the same value on every rank."""
    split = gate_logits.split
    weights = gate_logits.valid.to(torch.float32)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"the load-balancing loss under sequence parallelism takes a 2D attention_mask, got shape "
                f"{tuple(attention_mask.shape)}"
            )
        weights = weights * split.shard(attention_mask.to(weights.device, torch.float32), 1)
    device = gate_logits[0].device
    flat = weights.reshape(-1).to(device)
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer_gate in gate_logits:
        if layer_gate.shape[0] != flat.numel():
            raise RuntimeError(
                f"router logits of {layer_gate.shape[0]} rows, expected this rank's {flat.numel()} tokens"
            )
        routing_weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(routing_weights, top_k, dim=-1)
        hits = torch.zeros(num_experts, dtype=torch.float32, device=device)
        tokens = tokens + hits.scatter_add_(0, selected.reshape(-1), flat.repeat_interleave(top_k))
        probs = probs + (routing_weights.float() * flat.unsqueeze(-1)).sum(dim=0)
        rows = rows + flat.sum()
    partial = torch.cat([tokens.detach(), probs, rows.detach().reshape(1)])  # the counts carry no gradient
    parts = all_gather(partial[None], 0, split.group, backward="slice")
    total = grad_scaled_by_group(parts, split.group).sum(0)
    tokens, probs, rows = total[: tokens.numel()], total[tokens.numel() : -1], total[-1]
    return torch.sum((tokens / rows) * (probs / rows).unsqueeze(0)) * num_experts


def install_exact_aux_loss(module: types.ModuleType, patch: Patch) -> None:
    """Make ``module.load_balancing_loss_func`` the dispatcher (see the module docstring) for the life of
    ``patch``; shared by every patch of a model of that module, the stock function back when the last is removed."""
    entry = _INSTALLED.get(module.__name__)
    if entry is None or getattr(module, _NAME) is not entry[1]:
        stock: Callable = getattr(module, _NAME)

        def load_balancing_loss_func(
            gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: Any = None
        ) -> Any:
            if isinstance(gate_logits, RouterLogits):
                return exact_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask)
            return stock(gate_logits, num_experts, top_k, attention_mask)

        entry = _INSTALLED[module.__name__] = [stock, load_balancing_loss_func, 0]
        setattr(module, _NAME, load_balancing_loss_func)
    entry[2] += 1

    def release() -> None:
        entry[2] -= 1
        if entry[2] == 0 and _INSTALLED.get(module.__name__) is entry:
            del _INSTALLED[module.__name__]
            if getattr(module, _NAME) is entry[1]:
                setattr(module, _NAME, entry[0])

    patch.on_remove(module, _NAME, release)
