"""Finding checkpoints under a root: committed, unfinished and damaged ones, and the damaged set aside.

Damaged checkpoints are never deleted: :func:`quarantine` moves them to ``<root>/corrupt/``, where
they are out of the way of discovery, retention and the next save of the same step.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import fsspec

from lightning_hpp.checkpoint.checksums import verify
from lightning_hpp.checkpoint.commit import CheckpointInfo, delete_checkpoint, read_metadata
from lightning_hpp.checkpoint.retry import RetryPolicy, lookup
from lightning_hpp.checkpoint.storage import filesystem, join_url
from lightning_hpp.checkpoint.warning import warn_checkpoint
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from lightning_hpp.redaction import redact

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)(?:-v\d+)?$")  # ModelCheckpoint adds -v<k> when the name exists
CORRUPT_DIR = "corrupt"
"""Sub-directory of a checkpoint root that damaged checkpoints are moved to (never deleted)."""


def dir_name(url: str) -> str:
    """The last component of a URL: a checkpoint directory's name."""
    return str(url).rstrip("/").rsplit("/", 1)[-1]


def _ls_dirs(root: str, retry: RetryPolicy | None) -> list[str] | None:
    """Names of the sub-directories of ``root``; ``None`` when ``root`` does not exist."""
    fs, path = filesystem(root, retry)

    def ls() -> list[dict[str, Any]]:
        fs.invalidate_cache(path)
        return fs.ls(path, detail=True)

    try:
        entries = lookup(retry, ls, f"listing {root!r}")
    except FileNotFoundError:
        if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
            bucket = path.strip("/").split("/", 1)[0]
            if not lookup(retry, lambda: fs.exists(bucket), f"looking for bucket {bucket!r}"):
                raise CheckpointError(
                    f"checkpoint root {root!r}: bucket {bucket!r} does not exist or is not visible "
                    f"with the credentials in the environment. Create it, or fix the URL (and "
                    f"AWS_ENDPOINT_URL for a non-AWS server)."
                ) from None
        return None
    except NotADirectoryError:
        raise CheckpointError(
            f"checkpoint root {root!r} is a file, not a directory. Point it at a directory "
            f"(it is created on the first save)."
        ) from None
    return [dir_name(e["name"]) for e in entries if e.get("type") == "directory"]


def step_dirs(root: str, *, retry: RetryPolicy | None = None) -> list[tuple[int, str]]:
    """All ``step-<N>`` directories under ``root`` (committed or not), by increasing N.

    Raises:
        CheckpointError: ``root`` is a file, or is in an object-store bucket that does not exist
            (a typo there must not look like "no checkpoints yet").
    """
    names = _ls_dirs(root, retry)
    if names is None:
        log.info("checkpoint root %r does not exist yet: no checkpoints", redact(str(root)))
        return []
    found = []
    for name in names:
        match = _STEP_DIR.match(name)
        if match:
            found.append((int(match.group(1)), join_url(root, name)))
    return sorted(found)


@dataclass
class Scan:
    """What the checkpoint directories under some roots hold (see :func:`scan`).

    Attributes:
        committed: Checkpoints whose ``metadata.json`` parses, best candidate first: the run that
            saved last first, then by step and creation time, newest first. Files are not checked.
        unfinished: Directories without ``metadata.json`` (a save that did not finish).
        unreadable: ``(url, reason)`` of directories whose ``metadata.json`` is damaged.
    """

    committed: list[CheckpointInfo] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)


def scan(roots: Iterable[str], *, prefer: str | None = None, retry: RetryPolicy | None = None) -> Scan:
    """Every checkpoint directory under ``roots``, whatever its name, sorted into a :class:`Scan`.

    This also finds checkpoints that Lightning's ``ModelCheckpoint`` names (``epoch=0-step=8.ckpt``,
    ``last.ckpt``). ``<root>/corrupt/`` (quarantined checkpoints) is never looked into.

    Args:
        roots: Directories (any fsspec URL) that hold checkpoint directories.
        prefer: A name prefix (``"last"``): if any committed checkpoint's name starts with it, only
            those are candidates.
        retry: Retries of transient storage errors.
    """
    out = Scan()
    for root in roots:
        names = _ls_dirs(root, retry)
        for name in names or []:
            if name == CORRUPT_DIR:
                continue
            url = join_url(root, name)
            try:
                meta = read_metadata(url, retry=retry)
            except IncompleteCheckpointError:
                out.unfinished.append(url)
                continue
            except CorruptCheckpointError as exc:
                out.unreadable.append((url, str(exc)))
                continue
            out.committed.append(CheckpointInfo(url=url, step=int(meta["step"]), metadata=meta))
    if prefer and any(dir_name(c.url).startswith(prefer) for c in out.committed):
        out.committed = [c for c in out.committed if dir_name(c.url).startswith(prefer)]
    last_save: dict[Any, float] = {}
    for c in out.committed:
        last_save[c.run_id] = max(last_save.get(c.run_id, 0.0), c.created)
    out.committed.sort(key=lambda c: (last_save[c.run_id], c.step, c.created), reverse=True)
    return out


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root`` (``metadata.json`` present and readable), oldest first.

    Files are not checked; use :func:`~lightning_hpp.checkpoint.checksums.verify` or
    :func:`latest_valid` for that. A root that does not exist has no checkpoints.
    """
    infos = []
    for _, url in step_dirs(root):
        try:
            meta = read_metadata(url)
        except CorruptCheckpointError as exc:
            log.debug("not a committed checkpoint: %s", exc)
            continue
        infos.append(CheckpointInfo(url=url, step=int(meta["step"]), metadata=meta))
    return sorted(infos, key=lambda i: i.step)


def latest_valid(root: str, *, checksums: bool = True) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` that passes :func:`~lightning_hpp.checkpoint.checksums.verify`.

    Newer directories that are unfinished or corrupt are skipped with a :class:`CheckpointWarning`
    naming the reason.

    Args:
        root: Directory holding ``step-<N>`` checkpoints (any fsspec URL).
        checksums: Recompute sha256 of every file of the candidate (see
            :func:`~lightning_hpp.checkpoint.checksums.verify`).

    Returns:
        The checkpoint, or ``None`` when ``root`` holds no valid one (or does not exist).
    """
    for _, url in reversed(step_dirs(root)):
        try:
            return verify(url, checksums=checksums)
        except CorruptCheckpointError as exc:
            warn_checkpoint(f"Skipping checkpoint: {exc} Falling back to an older checkpoint.")
    return None


def quarantine(ckpt_url: str, *, retry: RetryPolicy | None = None) -> str:
    """Move a damaged checkpoint to ``<root>/corrupt/<name>`` (``<name>.2``... if taken); returns its new URL.

    The evidence is kept, out of the way of discovery, retention and the next save of that step.
    """
    url = str(ckpt_url).rstrip("/")
    name = dir_name(url)
    root = url[: -len(name)].rstrip("/") or "/"
    fs, path = filesystem(url, retry)
    _, root_path = filesystem(root, retry)
    target_dir = f"{root_path.rstrip('/')}/{CORRUPT_DIR}"
    target, k = f"{target_dir}/{name}", 1
    while lookup(retry, lambda t=target: fs.exists(t), f"looking for {target!r}"):
        k += 1
        target = f"{target_dir}/{name}.{k}"
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        os.makedirs(target_dir, exist_ok=True)
        os.rename(path, target)  # one atomic step
    else:  # object stores: copy every object, then un-commit the original and delete it
        base = path.rstrip("/")
        files = lookup(retry, lambda: fs.find(base), f"listing {url!r}")
        for src in files:
            dst = f"{target}/{src[len(base) + 1 :]}"
            lookup(retry, lambda s=src, d=dst: fs.copy(s, d), f"copying {src!r} to {dst!r}")
        delete_checkpoint(url, retry=retry)
    fs.invalidate_cache(root_path)
    return join_url(root, CORRUPT_DIR, dir_name(target))
