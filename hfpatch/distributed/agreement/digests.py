"""The content digests of :mod:`hfpatch.distributed.agreement`: two 64-bit sums ``sum_i w_i * word_i`` in wrapping
int64 arithmetic over a tensor's raw bytes read as integer words, with odd pseudo-random weights per position
(exact and associative, so independent of the reduction order; the design notes are in
:mod:`hfpatch.distributed.agreement`, which re-exports :func:`content_digest` and :func:`bulk_digest`), and the
64-bit hash of a text (:func:`hash_text`) the tables' rows are keyed by. Plain torch, no collective.
"""

from __future__ import annotations

import functools
import hashlib

import torch

__all__ = ["bulk_digest", "content_digest", "hash_text", "to_int64"]

#: Words digested per chunk: bounds the temporary int64 buffers to ~2 MiB whatever the tensor size.
_CHUNK = 1 << 16
_SEED_A, _SEED_B = 0x243F6A8885A308D3, 0x13198A2E03707344  # digits of pi: two independent weight streams


# ----------------------------------------------------------------------------------------------- hashing
def to_int64(value: int) -> int:
    """``value`` mod 2^64 as a signed int64.

    >>> to_int64(2**64 - 1), to_int64(2**63)
    (-1, -9223372036854775808)
    """
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def hash_text(text: str) -> int:
    """A 64-bit hash of ``text`` (BLAKE2b) as a signed int64: the same on every rank and in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64-style finaliser on int64 (wrapping): well-spread weights from consecutive positions."""
    z = torch.bitwise_xor(z, torch.bitwise_right_shift(z, 31)) * to_int64(0xBF58476D1CE4E5B9)
    z = torch.bitwise_xor(z, torch.bitwise_right_shift(z, 29)) * to_int64(0x94D049BB133111EB)
    return torch.bitwise_xor(z, torch.bitwise_right_shift(z, 32))


def _words(x: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``x`` as a flat tensor of the widest integer words that tile them."""
    flat = x.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # expanded or strided (a size-1 dim counts as contiguous)
        flat = flat.new_empty(flat.shape).copy_(flat)
    raw = flat.view(torch.uint8)
    for word, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.numel() % size == 0:
            return raw.view(word)
    return raw.view(torch.int8)


def _chunk_weights(start: int, length: int, device: torch.device) -> torch.Tensor:
    """``(2, length)`` odd int64 weights of positions ``start ...`` (odd: invertible mod 2^64, so no single
    change can vanish). Made per chunk and dropped: the check leaves no memory behind."""
    position = torch.arange(start, start + length, dtype=torch.int64, device=device)
    return torch.stack([torch.bitwise_or(_mix(position + to_int64(s)), 1) for s in (_SEED_A, _SEED_B)])


def content_digest(x: torch.Tensor, *, on_device: bool | None = None) -> tuple[int, int]:
    """Two 64-bit digests of the exact bits of ``x`` (its values in order).

    CPU tensors are hashed with BLAKE2b over their bytes (no tensor temporaries, ~1 GB/s); tensors on an
    accelerator with the weighted word sum on the device (no copy to the host). ``on_device=True`` forces
    the device path (tests run it on CPU).

    >>> import torch
    >>> a = torch.arange(6.0)
    >>> content_digest(a) == content_digest(a.clone()), content_digest(a) == content_digest(a.flip(0))
    (True, False)
    """
    words = _words(x)
    if not (words.device.type != "cpu" if on_device is None else on_device):
        raw = hashlib.blake2b(words.numpy().tobytes() if words.numel() else b"", digest_size=16).digest()
        return (
            int.from_bytes(raw[:8], "little", signed=True),
            int.from_bytes(raw[8:], "little", signed=True),
        )
    digest = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        digest += (chunk * _chunk_weights(start, chunk.numel(), chunk.device)).sum(dim=1)
    a, b = digest.tolist()
    return a, b


#: Words per row of :func:`bulk_digest`'s layout.
_ROW = 4096


@functools.lru_cache(maxsize=128)
def _odd(length: int, seed: int, device: torch.device) -> torch.Tensor:
    """``length`` odd pseudo-random int64 weights (odd: invertible mod 2^64); cached, as a model's tensors
    share a few lengths (at most 128 small vectors are kept)."""
    position = torch.arange(length, dtype=torch.int64, device=device)
    return torch.bitwise_or(_mix(position + to_int64(seed)), 1)


def bulk_digest(x: torch.Tensor) -> torch.Tensor:
    """Two 64-bit digests of the exact bits of ``x``, as an int64 tensor of shape ``(2,)`` on ``x``'s device.

    For large tensors that do not change often (weights): about two reads of the memory, with no temporary
    larger than one row per :data:`_ROW` words (for tensors whose bytes tile into int64 words; narrower ones
    are widened chunk by chunk). The raw words, laid out in rows of :data:`_ROW`, give ``a = sum_c u_c *
    colsum_c`` and ``b = sum_r w_r * rowsum_r`` with odd pseudo-random weights, in wrapping int64 arithmetic:
    exact and associative, so the result does not depend on the device, the kernel or the reduction order. A
    change of any single word changes both (odd weights are invertible mod 2^64); moving values between rows
    changes ``b``, within a row ``a``. It guards against scripts that are wrong, not against adversaries.

    >>> import torch
    >>> w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    >>> ulp = w.clone()
    >>> ulp[3, 5] = torch.nextafter(ulp[3, 5], torch.tensor(2.0))
    >>> torch.equal(bulk_digest(w), bulk_digest(w.clone())), torch.equal(bulk_digest(w), bulk_digest(ulp))
    (True, False)
    >>> torch.equal(bulk_digest(w), bulk_digest(w.t().contiguous()))
    False
    """
    words = _words(x)
    device = words.device
    digest = torch.zeros(2, dtype=torch.int64, device=device)
    n = words.numel()
    if n == 0:
        return digest
    rows, tail = divmod(n, _ROW)
    columns = _odd(min(n, _ROW), _SEED_A, device)
    row_weights = _odd(rows + 1, _SEED_B, device)  # the tail is row ``rows``
    if rows:
        if words.dtype == torch.int64:  # no temporary: two reductions of the words themselves
            grid = words[: rows * _ROW].view(rows, _ROW)
            digest[0] += (grid.sum(0) * columns).sum()
            digest[1] += (grid.sum(1) * row_weights[:rows]).sum()
        else:  # narrower words: widened a chunk of rows at a time (<= _CHUNK * 8 bytes each)
            step = max(1, _CHUNK // _ROW)
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                grid = words[start * _ROW : stop * _ROW].to(torch.int64).view(stop - start, _ROW)
                digest[0] += (grid.sum(0) * columns).sum()
                digest[1] += (grid.sum(1) * row_weights[start:stop]).sum()
    if tail:
        last = words[rows * _ROW :].to(torch.int64)
        digest[0] += (last * columns[:tail]).sum()
        digest[1] += last.sum() * row_weights[rows]
    return digest
