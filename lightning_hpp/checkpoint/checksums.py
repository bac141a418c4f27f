"""Verification of a committed checkpoint: every file present, of its size, with its sha256.

The ranks of a job can share the work (:func:`checked_by`): each checks the shard files it wrote
under the layout that saved them; the checksums are streamed, several files at once.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from lightning_hpp.checkpoint.commit import METADATA_FILE, CheckpointInfo, read_metadata
from lightning_hpp.checkpoint.retry import RetryPolicy, lookup
from lightning_hpp.checkpoint.storage import filesystem
from lightning_hpp.errors import CorruptCheckpointError

_HASH_THREADS = 4
_HASH_BLOCK = 8 * 2**20


def sha256_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """sha256 hex digest of one file, streamed."""
    digest = hashlib.sha256()
    with fs.open(path, "rb", block_size=_HASH_BLOCK) as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def checked_by(path: str, rank: int, world: int) -> bool:
    """Whether rank ``rank`` of ``world`` checks the checkpoint file ``path`` when ranks share the work.

    torch.distributed.checkpoint's data files (``__<w>_<i>.distcp``, written by rank ``w``) go to
    rank ``w % world``, so under the layout that saved it each rank checks the files it wrote;
    every other file (the shard index) is read by every rank, so every rank checks it.
    """
    match = _SHARD_FILE.match(path.rsplit("/", 1)[-1])
    return match is None or int(match.group(1)) % world == rank


def verify(
    ckpt_url: str,
    *,
    checksums: bool = True,
    retry: RetryPolicy | None = None,
    share: tuple[int, int] | None = None,
) -> CheckpointInfo:
    """Check that the checkpoint at ``ckpt_url`` is committed and whole.

    Args:
        ckpt_url: A checkpoint directory (``<root>/step-<N>``).
        checksums: Also recompute the sha256 of the files (streamed, several files at once).
            Without it only presence and sizes are checked.
        retry: Retries of transient storage errors; default ``RetryPolicy()``.
        share: ``(rank, world)``: check only the files :func:`checked_by` gives this rank (the
            ranks of a job split the work); ``None``: every file.

    Returns:
        The checkpoint's :class:`CheckpointInfo`.

    Raises:
        CorruptCheckpointError: no ``metadata.json``, a file missing, truncated or with a
            checksum that does not match.
    """
    meta = read_metadata(ckpt_url, retry=retry)
    fs, path = filesystem(ckpt_url, retry)
    base = path.rstrip("/")
    shards = [s for s in meta["shards"] if share is None or checked_by(s["path"], *share)]

    def sizes() -> dict[str, int]:
        fs.invalidate_cache(base)
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in fs.ls(base, detail=True)}

    present = lookup(retry, sizes, f"listing the files of {ckpt_url!r}")
    for shard in shards:
        size = present.get(shard["path"])
        if size is None:
            raise CorruptCheckpointError(f"{ckpt_url!r}: shard {shard['path']!r} is missing.")
        if size != shard["size"]:
            raise CorruptCheckpointError(
                f"{ckpt_url!r}: shard {shard['path']!r} has {size} bytes, {METADATA_FILE} says "
                f"{shard['size']} (truncated or overwritten)."
            )
    if checksums and shards:

        def digest(shard: dict[str, Any]) -> str:
            target = f"{base}/{shard['path']}"
            return lookup(retry, lambda: sha256_of(fs, target), f"reading {target!r} for its checksum")

        with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(shards)), thread_name_prefix="ckpt-sha256") as pool:
            digests = list(pool.map(digest, shards))
        bad = [s["path"] for s, d in zip(shards, digests) if d != s["sha256"]]
        if bad:
            raise CorruptCheckpointError(
                f"{ckpt_url!r}: {'shard' if len(bad) == 1 else 'shards'} {', '.join(map(repr, bad))} "
                f"{'fails its' if len(bad) == 1 else 'fail their'} sha256 checksum (the bytes changed after the save)."
            )
    return CheckpointInfo(url=str(ckpt_url), step=int(meta["step"]), metadata=meta)
