"""The Ulysses exchange with the fewest copies, overlapped with computation, optionally in FP8.

Ulysses reshards ``[B, S_local, H, D]`` (this rank's tokens, all heads) into ``[B, S, H_r, D]`` (the group's
tokens, this rank's heads) and back. Heads sit inside each token's row, so one side of every exchange is
strided: the rows this rank sends to rank ``j`` (its heads ``H_j`` of every local token) are not contiguous in
``q``, and what it receives from rank ``i`` for the output lands strided among the heads of the final
``[B, S_local, H, D]``. Moving every element once across that stride is the least any exchange can do; this
package does exactly that, and nothing more:

* **q, k, v** (sequence -> heads, :mod:`~hfpatch.attention.exchange.to_heads`): each element is copied once,
  into a send buffer or, for this rank's own heads, straight into the kernel's buffer; what rank ``i`` sends
  lands, with no copy, in the rows of shard ``i`` of the buffer the attention kernel reads: ``[B, T + S, H_r, D]``
  in ``[B, S, H, D]`` memory, the replicated text tokens (``T``) in front or at the back where the stock model
  has them, so the kernel sees the stock call for its heads with no concatenation.
* **the output** (heads -> sequence, :mod:`~hfpatch.attention.exchange.to_sequence`): the kernel's output rows
  of shard ``i`` are sent as they are; what arrives is copied once into its heads of the final
  ``[B, T + S_local, H, D]``, text heads (all-gathered) included, so the caller gets the joined output with no
  concatenation either.
* **padding** (tokens padded to a multiple of the ranks, :mod:`hfpatch.attention.layout`) is never sent: each
  shard sends its real rows; the receiver of a padded shard writes zeros there (or, at a ring degree of 1, has
  no rows for them at all: the kernel reads the real tokens only).

The bytes copied are the analytic minimum (:func:`copy_minimum`, :mod:`~hfpatch.attention.exchange.cost`);
the bytes sent are unchanged, ``(u - 1) / u`` of each local tensor.

Transport: point-to-point sends and receives in one batch (:func:`hfpatch.distributed.collectives.start_p2p`;
NCCL groups them into one launch, as its ``all_to_all_single`` does internally), because only messages of their
own let the receives land in the kernel's layout and the own piece skip the wire. Each exchange has two halves,
*start* (pack, post the messages) and *finish* (wait, place the text heads or unpack), so a caller can compute
between them:

* :func:`start_sequence_to_heads` (:mod:`~hfpatch.attention.exchange.overlap`) returns a
  :class:`PendingExchange` whose ``wait()`` gives the resharded tensor: the exchange of ``q`` runs while ``k``
  is projected (:class:`ExchangeConfig` ``overlap``);
* with ``overlap`` :func:`hfpatch.attention.usp.usp_attention` pipelines its heads in ``chunks``
  (:mod:`~hfpatch.attention.exchange.plans`): the exchange of chunk ``c + 1`` and the output exchange of chunk
  ``c - 1`` run while chunk ``c`` attends;
* :func:`project_heads_to_sequence` (:mod:`~hfpatch.attention.exchange.overlap`) returns the output exchange
  already multiplied by an output projection, chunk by chunk over the heads.

On NCCL the messages run on the communication stream and ``wait()`` makes the compute stream wait for them;
on gloo they run on gloo's threads while Python computes. Overlapped results equal the blocking ones (the same
elements computed by the same kernels per head; :func:`project_heads_to_sequence` sums the projection over
head chunks, a reassociation).

**FP8** (:class:`ExchangeConfig` ``dtype=torch.float8_e4m3fn``, opt-in): q, k, v and the output travel as e4m3
bytes with float32 scales; the wire format and its error are :mod:`~hfpatch.attention.exchange.wire`. Refused
under training (autograd recording with inputs that require grad) unless ``training=True``; then the backward
exchanges the gradients exactly.

One concept a module: :mod:`~hfpatch.attention.exchange.config` (how it runs),
:mod:`~hfpatch.attention.exchange.geometry` (which rows and heads each rank holds),
:mod:`~hfpatch.attention.exchange.plans` (per chunk of heads, which rows each message carries),
:mod:`~hfpatch.attention.exchange.wire` (how a message is packed, exact or FP8), the two exchanges
(:mod:`~hfpatch.attention.exchange.to_heads`, :mod:`~hfpatch.attention.exchange.to_sequence`: start, finish
and their autograd adjoint), the exchanges overlapped with the caller's projections
(:mod:`~hfpatch.attention.exchange.overlap`) and the copy budget (:mod:`~hfpatch.attention.exchange.cost`).

>>> import torch
>>> from hfpatch.attention.exchange import ExchangeConfig, copy_minimum
>>> ExchangeConfig.parse("fp8")
ExchangeConfig(overlap=False, chunks=2, dtype=torch.float8_e4m3fn, scale='head', exact_keys=False, training=False)
>>> copy_minimum(batch=1, local=4, heads=4, local_heads=2, dim=8, text=0, element_size=4)  # 4 x one local q
2048
"""

from .config import ExchangeConfig
from .cost import copy_minimum
from .overlap import project_heads_to_sequence, start_sequence_to_heads
from .to_heads import PendingExchange

__all__ = [
    "ExchangeConfig",
    "PendingExchange",
    "copy_minimum",
    "project_heads_to_sequence",
    "start_sequence_to_heads",
]
