"""The files :func:`hfpatch.loading.from_pretrained` reads, and their agreement over the ranks.

Ranks that read different bytes (another revision, a copy that differs on one node: a partial rsync, a re-saved
shard, another fine-tune with the same file sizes) would generate from mixed weights without a word, so the load
compares what every rank reads before any weight is read into a model, in two steps:

1. **Revision digest** (:func:`revision_digest`, every rank, in the load's handshake): ``model_index.json``, every
   config and tokenizer file whole, and of each safetensors file read in part its size, its header and three
   4 KiB windows of its data (its first, middle and last :data:`SAMPLE` bytes). It costs a few reads per file and
   catches another revision at once, but not a difference outside the windows.
2. **Full contents** (:func:`agree_contents`: :func:`hash_share` then :func:`disagreement`, the default ``check_files="full"``): the
   sha256 of every byte of every safetensors file read in part, computed once per node. Each rank lists its files
   by their identity on its node (the kernel's boot id, the file's device and inode: the same file whoever opens
   it, whatever the path); each distinct file is hashed by one of the ranks of its node that read it, the largest
   files first to the rank with the fewest bytes so far, so a node reads the checkpoint once more, split over its
   ranks; the hashes are exchanged and every rank compares them file by file (the path relative to the pipeline
   folder). A file whose content differs on any rank is refused on every rank, naming the file and the ranks.
   A file resolved into a hub cache blob named by a sha256 (the hub names large files' blobs by their sha256)
   is checked against its name as well: a blob modified in place is refused even where every rank shares it.

``check_files="sampled"`` (an explicit opt-out) stops at step 1: a copy that differs outside the three windows of
a file loads silently and generates from mixed weights.

>>> import os, tempfile
>>> folder = tempfile.mkdtemp()
>>> with open(os.path.join(folder, "w.safetensors"), "wb") as f:
...     _ = f.write(b"weights")
>>> sha256_file(os.path.join(folder, "w.safetensors"))[:16]
'9a129038d9a00aed'
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from typing import Any

SAMPLE = 4096  #: bytes of each of the three windows of a file's data in the revision digest
_CHUNK = 1 << 20  # bytes hashed per read: the check holds one such buffer, nothing else
#: Files of a pipeline folder the revision digest reads whole (configs, tokenizers, schedulers).
_SMALL = (".json", ".txt", ".model", ".vocab", ".tiktoken", ".jinja")
_BLOB = re.compile(r"[0-9a-f]{64}")


def sampled_windows(size: int, data: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the three windows of a safetensors file of ``size`` bytes whose data starts at
    ``data`` that the revision digest reads (the first, middle and last :data:`SAMPLE` bytes of its data).

    >>> sampled_windows(100_000, 1_000)
    [(1000, 4096), (48452, 4096), (95904, 4096)]
    """
    starts = (data, data + max(size - data - SAMPLE, 0) // 2, max(size - SAMPLE, data))
    return [(start, min(SAMPLE, max(size - start, 0))) for start in starts]


def revision_digest(folder: str, parts: Sequence[str]) -> str:
    """Step 1 (see the module docstring): a digest of ``model_index.json``, every config and tokenizer file of
    ``folder`` whole, and of each safetensors file of ``parts`` its size, header and three windows."""
    hasher = hashlib.sha256()
    small = [os.path.join(folder, "model_index.json")] + sorted(
        os.path.join(root, f)
        for root, _, names in os.walk(folder)
        for f in names
        if f.endswith(_SMALL) and root != folder
    )
    for path in small + sorted(parts):
        hasher.update(os.path.relpath(path, folder).encode())
        with open(path, "rb") as f:
            if not path.endswith(".safetensors"):
                hasher.update(f.read())
                continue
            size = os.fstat(f.fileno()).st_size
            header = int.from_bytes(f.read(8), "little")
            hasher.update(size.to_bytes(8, "little") + f.read(header))
            for offset, length in sampled_windows(size, 8 + header):
                f.seek(offset)
                hasher.update(f.read(length))
    return hasher.hexdigest()[:16]


def _boot_id() -> str:
    """This kernel's boot id: the same for every process of one machine (containers included), another on the
    next machine; the host name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def file_identities(folder: str, files: Sequence[str]) -> list[dict[str, Any]]:
    """Each of ``files`` as the full check names it: its path relative to ``folder``, the file it resolves to,
    its size and its identity on this node (``boot id:device:inode``, the same for every rank that reads it)."""
    boot = _boot_id()
    out = []
    for path in sorted(files):
        real = os.path.realpath(path)
        stat = os.stat(real)
        out.append(
            {
                "path": os.path.relpath(path, folder),
                "real": real,
                "size": stat.st_size,
                "id": f"{boot}:{stat.st_dev}:{stat.st_ino}",
            }
        )
    return out


def sha256_file(path: str) -> str:
    """The sha256 of every byte of ``path`` (plain reads of 1 MiB into one buffer: nothing is mapped)."""
    hasher = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buffer)
            if not got:
                break
            hasher.update(view[:got])
    return hasher.hexdigest()


def _assignment(every: Sequence[Sequence[dict[str, Any]]]) -> dict[str, int]:
    """File identity -> the rank that hashes it: among the ranks that read it, the largest files first to the one
    with the fewest bytes so far (ties: the lowest rank). The same on every rank (it reads only ``every``)."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, files in enumerate(every):
        for f in files:
            holders.setdefault(f["id"], []).append(rank)
            sizes[f["id"]] = f["size"]
    load = [0] * len(every)
    owner: dict[str, int] = {}
    for ident in sorted(sizes, key=lambda i: (-sizes[i], i)):
        rank = min(holders[ident], key=lambda r: (load[r], r))
        owner[ident] = rank
        load[rank] += sizes[ident]
    return owner


def hash_share(every: Sequence[Sequence[dict[str, Any]]], rank: int) -> dict[str, str]:
    """Step 2 on ``rank``: identity -> sha256 of the files :func:`_assignment` gives it (``every``: each rank's
    :func:`file_identities`)."""
    owner = _assignment(every)
    mine = {f["id"]: f["real"] for f in every[rank] if owner[f["id"]] == rank}
    return {ident: sha256_file(real) for ident, real in sorted(mine.items())}


def disagreement(every: Sequence[Sequence[dict[str, Any]]], hashes: dict[str, str]) -> str | None:
    """The files whose content differs over the ranks (or from their hub blob's name), as the lines of an error
    message; ``None`` when every rank reads the same bytes. ``hashes``: every rank's :func:`hash_share`, merged."""
    by_path: dict[str, dict[str, list[int]]] = {}
    where: dict[tuple[str, int], str] = {}
    corrupt: dict[str, list[int]] = {}
    for rank, files in enumerate(every):
        for f in files:
            digest = hashes[f["id"]]
            by_path.setdefault(f["path"], {}).setdefault(digest, []).append(rank)
            where[f["path"], rank] = f["real"]
            blob = os.path.basename(f["real"])
            if (
                os.path.basename(os.path.dirname(f["real"])) == "blobs"
                and _BLOB.fullmatch(blob)
                and blob != digest
            ):
                corrupt.setdefault(f"{f['real']} (sha256 {digest[:16]}...)", []).append(rank)
    lines = []
    for path, digests in sorted(by_path.items()):
        if len(digests) > 1:
            parts = [
                f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: sha256 {d[:16]}... ({where[path, r[0]]})"
                for d, r in digests.items()
            ]
            lines.append(f"  {path} differs: {'; '.join(parts)}")
    for blob, ranks in sorted(corrupt.items()):
        lines.append(
            f"  {blob} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} does not match its "
            "hub blob name (modified in place, or a corrupted copy)"
        )
    return "\n".join(lines) or None


def agree_contents(every: Sequence[Sequence[dict[str, Any]]]) -> str | None:
    """Step 2 over the ranks (a bounded exchange over the default group's store): this rank hashes its share of
    its node's files (``every``: each rank's :func:`file_identities`, the same list on every rank), the hashes are
    exchanged, and the same message comes back on every rank when a rank could not hash its share or a file
    differs (``None`` when every rank reads the same bytes). The caller raises it."""
    import torch.distributed as dist

    from ..distributed import runtime

    hashes, error = {}, None
    try:
        hashes = hash_share(every, dist.get_rank())
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    posted = runtime.exchange(
        "from_pretrained/contents",
        {"hashes": hashes, "error": error},
        what="hfpatch.from_pretrained",
        hint="; every rank hashes its share of its node's checkpoint files",
    )
    failed = [f"  rank {r}: {p['error']}" for r, p in enumerate(posted) if p["error"]]
    if failed:
        return (
            "hfpatch.from_pretrained: the checkpoint files could not be read to compare them over the ranks; "
            "nothing was loaded on any rank:\n" + "\n".join(failed)
        )
    problem = disagreement(every, {k: v for p in posted for k, v in p["hashes"].items()})
    if problem is None:
        return None
    return (
        "hfpatch.from_pretrained: the ranks read different checkpoints: the content of these files differs (sha256 "
        "of every byte; their sizes, headers and sampled windows agree); nothing was loaded on any rank:\n"
        f"{problem}\nPoint every rank at the same revision (pass revision=, or sync the copies)"
    )
