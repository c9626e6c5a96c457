"""Stand-in attention processors: the stock diffusers processors of a DiT, attending through USP.

**Which attention to route through USP.** The stock processors of these models compute their projections,
norms and rotary, then call ``dispatch_attention_fn`` (a global of their module) with
``parallel_config=self._parallel_config``. For every attention module the entry names,
:class:`USPDispatchProcessor` replaces ``module.processor`` (per object, logged in the
:class:`~hfpatch.core.patch.Patch`) by a stand-in that keeps the stock processor and runs the stock
``__call__`` *code* from a copy of that function (one per stock class: own globals dict, own code object)
whose ``dispatch_attention_fn`` is hfpatch's router; the stand-in calls it with ``self`` = a shallow copy
of the stock processor whose ``_parallel_config`` is the stand-in, so the router knows which model's
groups and shard geometry to use. So:

* per object: no module global, class, function or processor of diffusers is modified; an unpatched model
  in the same process runs the untouched stock function, and two patched models route to their own groups;
* reversible by identity: ``patch.remove()`` puts the very stock processor object back;
* compile-safe: plain Python objects and functions, no context variable or global flag a compiled graph
  could bake in; the copy has its own code object, so ``torch.compile``'s per-code-object cache never
  serves a frame compiled under the router's globals to the stock function (or the reverse);
* exact: the stand-in counts its USP calls; a stock code path that attended without ``dispatch_attention_fn``
  (so within the local shard only) raises instead of returning a wrong result of the right shape.

Older stock processors (SD3's ``JointAttnProcessor2_0``, CogVideoX's, HunyuanDiT's, PixArt's
``AttnProcessor2_0``) call ``F.scaled_dot_product_attention`` (``[B, H, S, D]``) instead, which carries no
``parallel_config``: :class:`USPSDPAProcessor` binds the router in the copy itself, one copy per stand-in whose
``F`` is a module object with ``torch.nn.functional``'s attributes and the stand-in's ``sdpa``, with the same
guarantees (:func:`_sdpa_call`). Which route a processor takes is read from its ``__call__`` code. Only the
modules a table entry names are routed: a cross-attention with the same stock class (PixArt's ``attn2``) runs
the untouched stock code.

The USP attention reads the layout from the call: a self-attention's queries are this rank's shard
(``local_len`` tokens); a joint attention's are ``local_len`` image tokens plus ``T`` replicated text
tokens at the ``front`` or ``back`` (``T = len - local_len``), as the entry declares. Key-only masks
(``[B|1, 1, 1, S]``, bool or 0/-inf float) become the joint key mask; the image keys must be unmasked.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from typing import Any, ClassVar

import torch

from .sequence_parallel import SequenceShard, usp_attention_call

__all__ = ["USPDispatchProcessor", "USPSDPAProcessor"]

#: The global name through which the stock processors attend (``diffusers.models.attention_dispatch``).
DISPATCH = "dispatch_attention_fn"


def _key_mask(attn_mask: torch.Tensor | None, batch: int, keys: int, where: str) -> torch.Tensor | None:
    """``[B|1, S_k]`` bool (True: attend) from a key-only SDPA mask, or ``None`` when nothing is masked."""
    if attn_mask is None:
        return None
    shape = tuple(attn_mask.shape)
    key_only = (
        1 <= attn_mask.dim() <= 4
        and shape[-1] == keys
        and all(n == 1 for n in shape[-3:-1])
        and (attn_mask.dim() < 4 or shape[0] in (1, batch))
    )
    if not key_only:
        raise ValueError(
            f"{where}: sequence-parallel attention takes key-only masks [B or 1, 1, 1, {keys}] (padded text); "
            f"got an attention mask of shape {shape}"
        )
    mask = attn_mask.reshape(-1, keys)
    if mask.dtype == torch.bool:
        return mask
    keep = mask == 0
    if not bool((keep | torch.isneginf(mask)).all()):
        raise ValueError(
            f"{where}: sequence-parallel attention takes boolean or 0/-inf additive masks; this one has other "
            "values (a bias is not a mask of keys)"
        )
    return keep


def _token_masks(
    attn_mask: torch.Tensor | None, batch: int, queries: int, keys: int, where: str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(key mask, query mask)``, each ``[B|1, S]`` bool or ``None``, from a key-only or a *token* mask.

    A token mask is a self-attention's query x key mask ``[B|1, 1, S, S]`` that is the outer AND of one token
    mask ``m`` with itself (HunyuanVideo 1.5: ``m[i] & m[j]``, padded text masked as keys *and* as queries).
    That is exactly a key mask ``m`` plus fully masked query rows where ``m`` is False, whose output SDPA gives
    as zeros (torch's safe softmax): the caller zeroes those rows (no gradient flows through them either).
    Anything else is a key-only mask (:func:`_key_mask`) or refused.
    """
    if attn_mask is None or attn_mask.dim() != 4 or attn_mask.shape[-2] == 1:
        return _key_mask(attn_mask, batch, keys, where), None
    shape = tuple(attn_mask.shape)
    if not (queries == keys and shape[-2:] == (queries, keys) and shape[1] == 1 and shape[0] in (1, batch)):
        raise ValueError(
            f"{where}: sequence-parallel attention takes key-only masks [B or 1, 1, 1, {keys}] or a token mask "
            f"[B or 1, 1, {queries}, {keys}] (outer AND of one mask of tokens); got an attention mask of shape {shape}"
        )
    keep = _key_mask(attn_mask.reshape(-1, 1, 1, keys), shape[0] * queries, keys, where)
    keep = keep.reshape(shape[0], queries, keys)
    tokens = keep.diagonal(dim1=-2, dim2=-1)
    if not torch.equal(keep, tokens[:, :, None] & tokens[:, None, :]):
        raise ValueError(
            f"{where}: sequence-parallel attention takes a query x key mask only when it is the outer AND of one "
            "mask of tokens (masked tokens neither attend nor are attended to); this one is not"
        )
    return tokens, None if bool(tokens.all()) else tokens


#: diffusers' own ``dispatch_attention_fn`` (the one every stock module imports), set by :func:`_routed_call`.
_stock_dispatch: Any = None


def _routed_dispatch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None,
    *,
    backend: Any = None,
    parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn`` as the routed copies of the stock ``__call__`` see it.

    The stock code passes ``parallel_config=self._parallel_config``, which the stand-in's view sets to the
    stand-in: the call goes to its :meth:`USPDispatchProcessor.attend`. A call with ``parallel_config=None``
    is one the stock code itself keeps local (Wan's image keys in I2V: replicated keys, local queries), so it
    goes to diffusers' own function, exact on the shard; any other value is refused. (A plain module-level
    function, not a closure: ``torch.compile`` must be able to guard on it from the routed copy.)
    """
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs)
    if parallel_config is None:
        return _stock_dispatch(*args, backend=backend)
    if not isinstance(parallel_config, USPDispatchProcessor):
        raise RuntimeError(
            f"hfpatch's routed {DISPATCH} got parallel_config={parallel_config!r}, not its stand-in processor"
        )
    return parallel_config.attend(*args, backend=backend)


@functools.cache
def _routed_call(stock_call: types.FunctionType) -> types.FunctionType:
    """A copy of a stock ``__call__`` whose ``dispatch_attention_fn`` is :func:`_routed_dispatch`.

    One copy per stock class, shared by every stand-in (routing is per object, through the ``self`` the copy
    is given). The copy has its own globals dict (the diffusers module is left as it is) and its own code
    object: ``torch.compile`` caches compiled frames per code object and installs the compiled functions in
    the globals of the frame, so a copy sharing the stock code object would share cache entries with frames
    that run under other globals (the stock function of an unpatched model).
    """
    global _stock_dispatch
    _stock_dispatch = stock_call.__globals__[DISPATCH]
    return _function_copy(stock_call, {DISPATCH: _routed_dispatch}, "hfpatch USP")


def _function_copy(
    stock_call: types.FunctionType, overrides: dict[str, Any], label: str
) -> types.FunctionType:
    """A copy of ``stock_call`` with its own code object (``label`` in its qualified name) and its own globals:
    the stock module's, with ``overrides``.

    The copied globals have no ``__name__``: ``torch.compile`` names the globals of an inlined function by
    their module (``sys.modules[__name__]``) when they have one, so with the stock module's name its guards
    would read the stock module's ``F``/``dispatch_attention_fn`` instead of the overrides (a guard that fails
    to build, or recompiles every call). Without a name it guards on this dict itself. (Relative imports
    inside the function still resolve through ``__package__``/``__spec__``.)
    """
    scope = {**stock_call.__globals__, **overrides}
    scope.pop("__name__", None)
    code = stock_call.__code__.replace(co_qualname=f"{stock_call.__code__.co_qualname} ({label})")
    routed = types.FunctionType(
        code, scope, stock_call.__name__, stock_call.__defaults__, stock_call.__closure__
    )
    routed.__kwdefaults__ = stock_call.__kwdefaults__
    return routed


#: The module global through which the SDPA-route stock processors attend (``F.scaled_dot_product_attention``).
SDPA = "scaled_dot_product_attention"


def _functional_names(call: types.FunctionType) -> list[str]:
    """Global names of ``call`` bound to ``torch.nn.functional`` that it reads ``scaled_dot_product_attention`` from."""
    if SDPA not in call.__code__.co_names:
        return []
    return [name for name in call.__code__.co_names if call.__globals__.get(name) is torch.nn.functional]


def _sdpa_call(stock_call: types.FunctionType, stand_in: USPSDPAProcessor) -> types.FunctionType:
    """A copy of a stock ``__call__`` whose ``F.scaled_dot_product_attention`` is ``stand_in.sdpa``.

    SDPA has no argument to carry the stand-in (unlike ``parallel_config``), so the binding is in the copy
    itself: one copy *per stand-in*, with its own globals dict, in which ``F`` is a module object with the
    attributes of ``torch.nn.functional`` and ``scaled_dot_product_attention`` = the bound ``stand_in.sdpa``,
    and its own code object. Compile-safety: ``torch.compile`` keys compiled frames by code object and runs
    them with the globals they were compiled under (the compiled functions are installed there); a code
    object per stand-in means no compiled frame is ever served to another stand-in, another model or the
    stock function, and a traced call resolves ``F.scaled_dot_product_attention`` to this stand-in's bound
    method (a plain Python attribute, no global flag or context variable a graph could bake in).
    """
    functional = types.ModuleType(f"{torch.nn.functional.__name__} (hfpatch USP)")
    functional.__dict__.update({k: v for k, v in vars(torch.nn.functional).items() if not k.startswith("__")})
    setattr(functional, SDPA, stand_in.sdpa)
    overrides = dict.fromkeys(_functional_names(stock_call), functional)
    return _function_copy(stock_call, overrides, f"hfpatch USP {stand_in.where}")


class USPDispatchProcessor:
    """Per-object stand-in for a stock processor: the stock ``__call__`` code, attending through USP.

    The stand-in runs :func:`_routed_call` of the stock class's ``__call__`` with ``self`` = a shallow copy of
    the stock processor (the *view*) whose ``_parallel_config`` is this stand-in: the stock code hands it to
    ``dispatch_attention_fn`` (:func:`_routed_dispatch` in the copy), which calls :meth:`attend`. The stock
    processor itself is not modified.

    Args:
        stock: The stock processor (kept, put back by ``patch.remove()``).
        state: The model's :class:`~hfpatch.patches.dit.sequence_parallel.SequenceShard`.
        joint: ``None``, ``"front"`` or ``"back"``: where the processor puts the replicated text tokens.
        where: Module path, for messages.

    Instances are made by :func:`usp_dispatch_processor`, which gives them the stock ``__call__`` signature
    (diffusers' ``Attention`` filters keyword arguments by it).
    """

    #: The function the routed stock code attends through (for messages).
    routed: ClassVar[str] = DISPATCH
    #: Whether the stock code picks its kernel through diffusers' attention backends (honoured here).
    uses_dispatch: ClassVar[bool] = True

    def __init__(self, stock: Any, state: SequenceShard, joint: str | None, where: str) -> None:
        self.stock = stock
        self.state = state
        self.joint = joint
        self.where = where
        self.calls = 0
        self._bind()

    def _bind(self) -> None:
        """Set ``_view`` (the ``self`` of the routed call) and ``_call`` (the routed copy)."""
        self._view = copy.copy(self.stock)
        self._view._parallel_config = self
        self._call = _routed_call(type(self.stock).__call__)

    def _run(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls = 0
        out = self._call(self._view, attn, *args, **kwargs)
        if self.calls == 0:
            raise RuntimeError(
                f"{self.where}: the stock {type(self.stock).__name__} attended without {self.routed} on this "
                "call (within this rank's shard only); hfpatch cannot parallelise that path"
            )
        return out

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        backend: Any = None,
    ) -> torch.Tensor:
        """``dispatch_attention_fn`` over the whole sequence: ``[B, S, H, D]`` in and out, as the stock call.

        ``backend`` (the processor's diffusers attention backend; ``None``: diffusers' active one) is honoured:
        at a ring degree of 1 the call is diffusers' own ``dispatch_attention_fn`` with it, under Ring its
        log-sum-exp form (:mod:`hfpatch.patches.dit.attention_backends`; refused by name where there is none).
        """
        self.calls += 1
        if dropout_p or is_causal or enable_gqa or attention_kwargs:
            raise ValueError(
                f"{self.where}: sequence-parallel attention computes plain softmax attention; got dropout_p="
                f"{dropout_p}, is_causal={is_causal}, enable_gqa={enable_gqa}, attention_kwargs={attention_kwargs}"
            )
        if self.joint == "queries":
            return self._attend_sharded_keys(query, key, value, attn_mask, scale)
        if self.joint == "keys":
            return self._attend_text_keys(query, key, value, attn_mask, scale, backend)
        local = self.state.local_len if self.state.local_len is not None else query.shape[1]
        text = query.shape[1] - local
        if text < 0 or (text and self.joint is None):
            text = 0  # usp_attention_call says what is wrong with the length
        elif self.joint is not None:
            # The text length is inferred from this call's shard; model.forward(...) (no split hooks) after a
            # call would mistake image tokens for text and return a wrong result of the right shape.
            # Keyed by the call's index within the module (Mochi attends once per sample, each with its own text).
            seen = self.state.text_len.setdefault((self.where, self.calls), text)
            if seen != text:
                raise RuntimeError(
                    f"sequence-parallel attention got {query.shape[1]} query tokens at {self.where}: with this "
                    f"call's shard of {local} tokens that leaves {text} text tokens, where this forward had {seen}; "
                    "the model ran without its sequence split. Call model(...), not model.forward(...)."
                )
        attn_mask = self._unmask_padding(attn_mask, local, text)
        mask, query_mask = _token_masks(attn_mask, query.shape[0], query.shape[1], key.shape[1], self.where)
        sizes = [text, local] if self.joint != "back" else [local, text]
        (q0, q1), (k0, k1), (v0, v1) = (t.split(sizes, dim=1) for t in (query, key, value))
        if self.joint == "back":
            (q_img, k_img, v_img), (q_txt, k_txt, v_txt) = (q0, k0, v0), (q1, k1, v1)
            mask_img, mask_txt = (None, None) if mask is None else mask.split(sizes, dim=1)
        else:
            (q_txt, k_txt, v_txt), (q_img, k_img, v_img) = (q0, k0, v0), (q1, k1, v1)
            mask_txt, mask_img = (None, None) if mask is None else mask.split(sizes, dim=1)
        if mask_img is not None:  # the shard's padding keys (end of the last shards) are masked by USP itself
            real = max(0, min(local, (self.state.valid_len or 0) - self.state.rank * local))
            mask_img = mask_img[:, :real]
        if mask_img is not None and not bool(mask_img.all()):
            raise ValueError(
                f"{self.where}: the attention mask masks image/video tokens, which are sharded over the ranks; "
                "sequence-parallel attention masks only the replicated text tokens"
            )
        joint = (q_txt, k_txt, v_txt) if text else None
        kernel, dense = self._kernels(backend)
        # Joined where the stock model has the text: under Ulysses the exchange writes it so (no concatenation).
        joined = usp_attention_call(
            self.state, q_img, k_img, v_img, joint=joint, joint_position=self.joint or "front",
            joint_key_mask=mask_txt if text else None, scale=scale, backend=kernel, dense=dense, joined=True,
        )  # fmt: skip
        if (
            text and query_mask is not None
        ):  # a token mask: its masked (text) queries attend to nothing: zeros
            keep = torch.ones(joined.shape[:2], dtype=torch.bool, device=joined.device)
            keep[:, slice(0, text) if self.joint != "back" else slice(local, local + text)] = mask_txt
            joined = joined.masked_fill(~keep[:, :, None, None], 0.0)
        return joined

    def _kernels(self, backend: Any) -> tuple[str, Any]:
        """``(Ring's local kernel, the ring-degree-1 attention)`` for the processor's diffusers ``backend``."""
        if not self.uses_dispatch:
            return "auto", None
        from .attention_backends import attention_kernels

        ring = 1 if self.state.ring_group is None else torch.distributed.get_world_size(self.state.ring_group)
        return attention_kernels(backend, _stock_dispatch, ring, self.where)

    def _unmask_padding(self, attn_mask: torch.Tensor | None, local: int, text: int) -> torch.Tensor | None:
        """A query x key token mask whose entries for this shard's padding tokens are those of a valid token.

        The padding at the end of the last shards (:mod:`hfpatch.attention.layout`) is masked as keys by USP itself
        and its query rows are dropped at the gather; a mask the stock code built from a cut per-token input
        (Ideogram 4's segment ids, padded with zeros) may disagree there, which must not make it unreadable: the
        padding tokens' rows and columns become those of a token every other token attends to.
        """
        real = max(0, min(local, (self.state.valid_len or 0) - self.state.rank * local))
        if (
            attn_mask is None
            or attn_mask.dim() != 4
            or real == local
            or attn_mask.shape[-1] != attn_mask.shape[-2]
        ):
            return attn_mask
        start = text if self.joint != "back" else 0
        pad = slice(start + real, start + local)
        keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        keep = keep.expand(*keep.shape[:2], *keep.shape[-2:]).clone()
        keep[..., pad, pad] = True
        tokens = keep.diagonal(dim1=-2, dim2=-1).clone()  # [B, 1|H, S]: each token's own entry
        tokens[..., pad] = True
        keep[..., pad, :] = tokens[..., None, :]
        keep[..., :, pad] = tokens[..., :, None]
        if attn_mask.dtype == torch.bool:
            return keep
        return torch.zeros_like(keep, dtype=attn_mask.dtype).masked_fill(~keep, float("-inf"))

    def _attend_text_keys(self, query, key, value, attn_mask, scale, backend) -> torch.Tensor:
        """The shard's queries over ``[replicated text, sharded image]`` keys/values (``joint="keys"``)."""
        local = self.state.local_len
        text = key.shape[1] - (local or 0)
        if local is None or query.shape[1] != local or text < 0:
            raise RuntimeError(
                f"sequence-parallel attention got {query.shape[1]} queries and {key.shape[1]} keys at {self.where} "
                f"but this call's shard holds {local}: the model ran without its sequence split. Call model(...), "
                "not model.forward(...)."
            )
        mask, _ = _token_masks(attn_mask, query.shape[0], query.shape[1], key.shape[1], self.where)
        mask_txt, mask_img = (None, None) if mask is None else mask.split([text, local], dim=1)
        if mask_img is not None:
            real = max(0, min(local, (self.state.valid_len or 0) - self.state.rank * local))
            if not bool(mask_img[:, :real].all()):
                raise ValueError(
                    f"{self.where}: the attention mask masks image/video tokens, which are sharded over the ranks; "
                    "sequence-parallel attention masks only the replicated text tokens"
                )
        (k_txt, k_img), (v_txt, v_img) = key.split([text, local], dim=1), value.split([text, local], dim=1)
        # usp_attention's joint part comes with queries: zero rows, whose output is dropped (exact for the shard's
        # queries, which attend over [text, image] keys as in the stock call; no gradient flows through them).
        joint = (torch.zeros_like(k_txt), k_txt, v_txt) if text else None
        kernel, dense = self._kernels(backend)
        out, _ = usp_attention_call(
            self.state, query, k_img, v_img, joint=joint, joint_position="front",
            joint_key_mask=mask_txt if text else None, scale=scale, backend=kernel, dense=dense,
        )  # fmt: skip
        return out

    def _attend_sharded_keys(self, query, key, value, attn_mask, scale) -> torch.Tensor:
        """Replicated queries over the sharded tokens' keys/values (``joint="queries"``)."""
        from ...attention.sharded_keys import sharded_keys_attention

        if attn_mask is not None:
            raise ValueError(
                f"{self.where}: an attention mask over the sharded keys of a replicated-query attention is not "
                "supported under sequence parallelism"
            )
        if self.state.local_len is None or key.shape[1] != self.state.local_len:
            raise RuntimeError(
                f"{self.where}: sequence-parallel attention got {key.shape[1]} keys but this call's shard holds "
                f"{self.state.local_len}: the model ran without its sequence split. Call model(...), not "
                "model.forward(...)."
            )
        # The queries are replicated: the full gradient reaches their backward (.streams); the output is too.
        (query,) = self.state.streams.average(query)
        out = sharded_keys_attention(
            query, key, value, group=self.state.group, valid_len=self.state.valid_len, scale=scale
        )
        self.state.streams.replicated(out)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where}, joint={self.joint}, {self.state!r})"


class USPSDPAProcessor(USPDispatchProcessor):
    """Stand-in for a stock processor that attends by ``F.scaled_dot_product_attention`` (``[B, H, S, D]``).

    The same guarantees as :class:`USPDispatchProcessor` (per object, reversible by identity, counted calls),
    routed by a per-stand-in copy of the stock ``__call__`` (:func:`_sdpa_call`). The stock code runs with
    ``self`` = the stock processor itself: it has no ``_parallel_config`` to redirect. SD3's
    ``JointAttnProcessor2_0`` (``[image, text]``: ``joint="back"``), CogVideoX's (``[text, video]``, projected
    together, rotary on the video part: ``joint="front"``), HunyuanDiT's and PixArt's self-attention.
    """

    routed: ClassVar[str] = f"F.{SDPA}"
    uses_dispatch: ClassVar[bool] = False

    def _bind(self) -> None:
        self._view = self.stock
        self._call = _sdpa_call(type(self.stock).__call__, self)

    def sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` over the whole sequence: ``[B, H, S, D]`` in and out."""
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = self.attend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return out.transpose(1, 2)


class USPBoundDispatchProcessor(USPDispatchProcessor):
    """Stand-in for a stock processor that calls ``dispatch_attention_fn`` without ``parallel_config`` (Cosmos').

    Routed like :class:`USPSDPAProcessor`: a copy of the stock ``__call__`` per stand-in whose
    ``dispatch_attention_fn`` is this stand-in's :meth:`dispatch` (own globals, own code object), run with
    ``self`` = the stock processor.
    """

    def _bind(self) -> None:
        self._view = self.stock
        self._call = _bound_call(type(self.stock).__call__, self)

    def dispatch(self, *args: Any, parallel_config: Any = None, **kwargs: Any) -> torch.Tensor:
        """``dispatch_attention_fn`` as the stock code calls it: :meth:`attend` (``parallel_config`` ignored)."""
        return self.attend(*args, **kwargs)


def _bound_call(stock_call: types.FunctionType, stand_in: USPBoundDispatchProcessor) -> types.FunctionType:
    """A copy of a stock ``__call__`` whose ``dispatch_attention_fn`` is ``stand_in.dispatch`` (see :func:`_sdpa_call`)."""
    global _stock_dispatch
    _stock_dispatch = stock_call.__globals__[DISPATCH]  # diffusers' own, for the ring-degree-1 attention
    return _function_copy(stock_call, {DISPATCH: stand_in.dispatch}, f"hfpatch USP {stand_in.where}")


@functools.cache
def _processor_class(stock_cls: type, base: type[USPDispatchProcessor]) -> type[USPDispatchProcessor]:
    """A ``base`` subclass whose ``__call__`` has ``stock_cls.__call__``'s signature."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    __call__.__signature__ = inspect.signature(stock_cls.__call__)  # type: ignore[attr-defined]
    name = f"USP{stock_cls.__name__}"
    return type(name, (base,), {"__call__": __call__, "__module__": __name__, "__qualname__": name})


def route_kind(processor_cls: type) -> type[USPDispatchProcessor] | None:
    """The stand-in class that can route ``processor_cls``'s attention, or ``None``.

    ``dispatch_attention_fn`` (with ``parallel_config``) where the ``__call__`` reads it, bound per stand-in where it
    calls ``dispatch_attention_fn`` without ``parallel_config``; otherwise ``F.scaled_dot_product_attention`` read
    from ``torch.nn.functional`` as a module global.
    """
    call = processor_cls.__call__
    if not isinstance(call, types.FunctionType):
        return None
    if DISPATCH in call.__code__.co_names and DISPATCH in call.__globals__:
        # A processor that never reads self._parallel_config (Cosmos') cannot carry the stand-in to the router.
        return (
            USPDispatchProcessor
            if "_parallel_config" in call.__code__.co_names
            else USPBoundDispatchProcessor
        )
    if _functional_names(call):
        return USPSDPAProcessor
    return None


def usp_dispatch_processor(
    stock: Any, state: SequenceShard, joint: str | None, where: str
) -> USPDispatchProcessor:
    """The stand-in of ``stock`` (:class:`USPDispatchProcessor` or :class:`USPSDPAProcessor`, by its code).

    >>> from diffusers.models.attention_processor import AttnProcessor2_0
    >>> route_kind(AttnProcessor2_0).__name__
    'USPSDPAProcessor'
    """
    base = route_kind(type(stock))
    if base is None:
        raise ValueError(f"{where}: {type(stock).__name__} attends through neither {DISPATCH} nor F.{SDPA}")
    return _processor_class(type(stock), base)(stock, state, joint, where)
