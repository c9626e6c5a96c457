"""Same-input guard: the ranks that share one piece of work check that they were given the same inputs.

Sequence parallelism, CFG/data parallelism and the split VAE compute ONE result together, each rank from its
own copy of the inputs. When a user's script feeds the ranks different data (a data loader sharded per rank,
an RNG state restored on rank 0 only, accelerate's ``split_between_processes``), the result is a silent
mixture, or a collective whose shapes disagree aborts in gloo/NCCL. So before the first shape-dependent
collective of a split call, the ranks exchange one fixed-size table (:data:`SLOTS` x :data:`FIELDS` int64,
3.3 KiB per rank) describing every argument of the call, and raise the same :class:`InputMismatchError` on
every rank when the rows differ.

Each argument gets a row: a hash of its name, a hash of its kind (type, dtype, device type, whether it
takes part in autograd), its shape, the exact bits of a scalar value (so the message can print it), and two
64-bit content digests. A digest is ``sum_i w_i * word_i`` in wrapping int64 arithmetic over the tensor's
raw bytes read as integer words, with odd pseudo-random weights ``w_i`` per position. Arithmetic mod 2^64 is
exact and associative, so the digest does not depend on the reduction order or the CPU kernel; an odd weight
is invertible mod 2^64, so a change of any single word (down to one bit) always changes the digest, and a
permutation or a scale of many elements changes it unless two independent 64-bit sums cancel at once. It is
not a cryptographic hash: it guards against scripts that are wrong, not against adversaries.

Weights are checked too (:class:`WeightMismatchError`): ``hfpatch.apply`` compares a fingerprint of every
parameter and buffer over the ranks before it patches anything (:func:`weight_digests`, one row per tensor
from :func:`bulk_digest`, folded into one digest that rides in ``apply``'s handshake), and a
:class:`WeightWatch` adds one row to every later same-input table, so that an adapter or LoRA added after
``apply`` on some ranks only, or initialised per rank, is refused at the next patched call.

>>> import torch
>>> from hfpatch.distributed.agreement import describe_inputs
>>> x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
>>> same = describe_inputs({"x": x, "step": 3})
>>> bool((same == describe_inputs({"x": x.clone(), "step": 3})).all())
True
>>> flipped = x.clone()
>>> flipped.view(torch.int32)[1, 2] ^= 1          # one bit of one element
>>> bool((same == describe_inputs({"x": flipped, "step": 3})).all())
False

The modules, one concept each: :mod:`~hfpatch.distributed.agreement.inputs` (the same-input table, its check
and the call guard), :mod:`~hfpatch.distributed.agreement.weights` (the weight fingerprint and its watch),
:mod:`~hfpatch.distributed.agreement.trainable` (trainable weights changed in place, followed by the watch) and
:mod:`~hfpatch.distributed.agreement.digests` (the content digests). This package re-exports their public
names.
"""

from __future__ import annotations

from .digests import bulk_digest, content_digest
from .inputs import (
    FIELDS,
    SLOTS,
    InputMismatchError,
    bytes_per_check,
    check_same_inputs,
    describe_inputs,
    install_call_guard,
    named_arguments,
)

# Public names outside ``__all__`` (as before the split), imported by name elsewhere: ``as`` marks them
# re-exported.
from .trainable import DIVERGENCE_CAUSES as DIVERGENCE_CAUSES
from .trainable import TrainableWeights as TrainableWeights
from .trainable import count_optimizer_steps as count_optimizer_steps
from .trainable import divergence_note as divergence_note
from .weights import WEIGHTS_SLOT as WEIGHTS_SLOT
from .weights import (
    WeightMismatchError,
    WeightWatch,
    compared_as_files,
    weight_digests,
    weight_watch_of,
    weights_mismatch_message,
)
from .weights import fold_digests as fold_digests

__all__ = [
    "FIELDS",
    "SLOTS",
    "InputMismatchError",
    "WeightMismatchError",
    "WeightWatch",
    "bulk_digest",
    "bytes_per_check",
    "check_same_inputs",
    "compared_as_files",
    "content_digest",
    "describe_inputs",
    "install_call_guard",
    "named_arguments",
    "weight_digests",
    "weight_watch_of",
    "weights_mismatch_message",
]
