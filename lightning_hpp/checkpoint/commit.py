"""A checkpoint's commit: ``metadata.json``, written last, read back and checked, removed first.

Layout under a root URL (a local path, ``file://``, ``s3://``, ``gs://``...)::

    <root>/step-<N>/            one checkpoint, N = optimizer steps completed
        __<rank>_0.distcp       torch.distributed.checkpoint shards, one file per writing rank
        .metadata               torch.distributed.checkpoint's index of the shards
        metadata.json           written LAST; its presence is the commit

``metadata.json`` holds the step, the stage plan, the environment fingerprint, metrics, the
creation time, the format version and every file of the checkpoint with its size and sha256.
A directory without it is an unfinished save and is never loaded; a directory whose files do not
match it is corrupt and is skipped (with a warning) in favour of the newest valid one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import fsspec

from lightning_hpp.checkpoint.retry import RetryPolicy, lookup
from lightning_hpp.checkpoint.storage import filesystem
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from lightning_hpp.redaction import redact

FORMAT_VERSION = 1
"""Version of the ``metadata.json`` layout written by this package."""

METADATA_FILE = "metadata.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    Attributes:
        url: The checkpoint directory (``<root>/step-<N>``).
        step: Steps completed when it was saved.
        metadata: The parsed ``metadata.json``.
    """

    url: str
    step: int
    metadata: dict[str, Any] = field(repr=False)

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.metadata.get("metrics") or {})

    @property
    def run_id(self) -> str | None:
        """The id of the training run that wrote it (``None`` for checkpoints written before run ids)."""
        return self.metadata.get("run_id")

    @property
    def created(self) -> float:
        return float(self.metadata.get("created", 0.0) or 0.0)


def build_metadata(
    *,
    step: int,
    shards: Iterable[dict[str, Any]],
    world_size: int,
    extra_metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``metadata.json`` document of a checkpoint (secrets redacted).

    Args:
        step: Steps completed.
        shards: One ``{"path", "size", "sha256"}`` per file of the checkpoint.
        world_size: Number of ranks that wrote it.
        extra_metadata: ``plan`` (dict), ``fingerprint`` (dict or None), ``run_id`` (str, the
            training run) and ``metrics`` (name -> float, used by
            :class:`~lightning_hpp.checkpoint.retention.Retention`) are stored at the top level; any
            other key is stored under ``extra``. Values must be JSON-serializable.

    Returns:
        The JSON-ready dict.

    Raises:
        CheckpointError: ``extra_metadata`` holds values JSON cannot represent.
    """
    extra = dict(extra_metadata or {})
    plan = extra.pop("plan", None)
    if plan is not None and hasattr(plan, "to_dict"):
        plan = plan.to_dict()
    metrics = {}
    for name, value in dict(extra.pop("metrics", None) or {}).items():
        try:
            metrics[str(name)] = float(value)
        except (TypeError, ValueError):
            raise CheckpointError(
                f"`extra_metadata['metrics'][{name!r}]` is {value!r}; metrics must be numbers."
            ) from None
    now = datetime.now(timezone.utc)
    doc = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "created": now.timestamp(),
        "created_iso": now.isoformat(),
        "world_size": int(world_size),
        "plan": plan,
        "fingerprint": extra.pop("fingerprint", None),
        "run_id": extra.pop("run_id", None),
        "metrics": metrics,
        "extra": extra,
        "shards": sorted(({**s} for s in shards), key=lambda s: s["path"]),
    }
    doc = redact(doc)
    try:
        json.dumps(doc, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"`extra_metadata` cannot be written as JSON ({exc}); pass plain dicts, lists, strings "
            f"and numbers (for a StagePlan use `plan.to_dict()`)."
        ) from None
    return doc


def write_metadata(ckpt_url: str, metadata: dict[str, Any], *, retry: RetryPolicy | None = None) -> None:
    """Write ``metadata.json`` atomically: the commit of the checkpoint at ``ckpt_url``.

    On local disks the file is written aside and renamed; on object stores one PUT is atomic.
    ``retry`` sets the per-request retries on S3 (:func:`filesystem`).
    """
    fs, path = filesystem(ckpt_url, retry)
    data = json.dumps(metadata, indent=2, sort_keys=True).encode()
    target = f"{path.rstrip('/')}/{METADATA_FILE}"
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        dir_fd = os.open(os.path.dirname(target), os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    else:
        fs.pipe_file(target, data)


def remove_metadata(ckpt_url: str, *, retry: RetryPolicy | None = None) -> bool:
    """Un-commit ``ckpt_url`` (delete its ``metadata.json``); returns whether one existed."""
    fs, path = filesystem(ckpt_url, retry)
    target = f"{path.rstrip('/')}/{METADATA_FILE}"
    fs.invalidate_cache(path)
    try:
        fs.rm_file(target)
    except FileNotFoundError:
        return False
    return True


def read_metadata(ckpt_url: str, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
    """Parse and check ``metadata.json`` of the checkpoint at ``ckpt_url``.

    ``retry``: transient errors are retried (see the module docstring).

    Raises:
        IncompleteCheckpointError: missing (an unfinished save).
        CorruptCheckpointError: unreadable, or not of this format.
    """
    fs, path = filesystem(ckpt_url, retry)

    def cat() -> bytes:
        fs.invalidate_cache(path)
        return fs.cat_file(f"{path.rstrip('/')}/{METADATA_FILE}")

    try:
        raw = lookup(retry, cat, f"reading {METADATA_FILE} of {ckpt_url!r}")
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{ckpt_url!r} has no {METADATA_FILE}: the save that wrote it did not finish."
        ) from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{ckpt_url!r}: its {METADATA_FILE} is a directory, not a file.") from None
    try:
        meta = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise CorruptCheckpointError(f"{METADATA_FILE} of {ckpt_url!r} is not valid JSON ({exc}).") from None
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{METADATA_FILE} of {ckpt_url!r} is not a JSON object.")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{METADATA_FILE} of {ckpt_url!r} has format_version {version!r}; this version of "
            f"lightning_hpp reads format {FORMAT_VERSION} and older. Upgrade lightning_hpp."
        )
    shards = meta.get("shards")
    if not isinstance(meta.get("step"), int) or not isinstance(shards, list) or not shards:
        raise CorruptCheckpointError(f"{METADATA_FILE} of {ckpt_url!r} lacks 'step' or 'shards'.")
    for s in shards:
        if not (
            isinstance(s, dict)
            and isinstance(s.get("path"), str)
            and isinstance(s.get("size"), int)
            and isinstance(s.get("sha256"), str)
        ):
            raise CorruptCheckpointError(f"{METADATA_FILE} of {ckpt_url!r} has a malformed shard entry {s!r}.")
    return meta


def has_file(ckpt_url: str, name: str, *, retry: RetryPolicy | None = None) -> bool:
    """Whether the checkpoint directory ``ckpt_url`` holds a file called ``name``."""
    fs, path = filesystem(ckpt_url, retry)
    target = f"{path.rstrip('/')}/{name}"

    def exists() -> bool:
        fs.invalidate_cache(path)
        return fs.exists(target)

    return lookup(retry, exists, f"looking for {target!r}")


def delete_checkpoint(ckpt_url: str, *, retry: RetryPolicy | None = None) -> None:
    """Delete a checkpoint directory: ``metadata.json`` first, so a crash leaves it uncommitted."""
    remove_metadata(ckpt_url, retry=retry)
    fs, path = filesystem(ckpt_url, retry)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)
