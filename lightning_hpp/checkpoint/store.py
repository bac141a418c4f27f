"""Checkpoint directories on any fsspec URL: commit marker, discovery, verification, retention.

Layout under a root URL (a local path, ``file://``, ``s3://``, ``gs://``...)::

    <root>/step-<N>/            one checkpoint, N = optimizer steps completed
        __<rank>_0.distcp       torch.distributed.checkpoint shards, one file per writing rank
        .metadata               torch.distributed.checkpoint's index of the shards
        metadata.json           written LAST; its presence is the commit

``metadata.json`` holds the step, the stage plan, the environment fingerprint, metrics, the
creation time, the format version and every file of the checkpoint with its size and sha256.
A directory without it is an unfinished save and is never loaded; a directory whose files do not
match it is corrupt and is skipped (with a warning) in favour of the newest valid one.

Retries of transient storage errors (connection resets, 5xx, throttling, timeouts), one
:class:`RetryPolicy` configuring two layers, each covering what the other cannot:

* ``s3://``: botocore, per request. :func:`filesystem` (the one place an fsspec filesystem is made:
  discovery, :func:`verify`, ``metadata.json``, and torch.distributed.checkpoint's shard reader and
  writer all use it) hands botocore's retry configuration to s3fs (``config_kwargs={"retries":
  {"total_max_attempts": attempts, "mode": "standard"|"adaptive"}}``), so every PUT, GET, HEAD and
  LIST, and every part of a multipart upload, is retried with botocore's exponential backoff and
  retry quota. s3fs's own wrapper around each call (``S3FileSystem.retries``, set to the same
  count) re-tries what botocore cannot see, because botocore's retries end once the response
  headers are parsed: a response body cut off while it is read (``IncompleteRead``, payload
  errors, read timeouts mid-body). That wrapper also re-runs a call whose connection errors
  botocore gave up on, so an endpoint that stays unreachable costs up to ``attempts**2`` requests
  before the error is raised. No whole-operation retry is added on top: it would only multiply
  botocore's tries.
* Every other store (local or network disks, ``gs://``, ...): :meth:`RetryPolicy.call`, whole
  operation, hand-written exponential backoff on the errors :func:`is_transient` recognises. It is
  kept because nothing below it retries there: a torch.distributed.checkpoint save or load that
  fails halfway (``EAGAIN``/``EBUSY`` on NFS, a reset under gcsfs) can only be re-run whole, and it
  is collective, so every rank re-runs it together.

:meth:`RetryPolicy.for_url` gives the whole-operation policy for a URL (one try on ``s3://``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal, TypeVar

import fsspec
from fsspec.core import url_to_fs

from lightning_hpp.checkpoint.s3 import DEFAULT_MAX_ATTEMPTS, RETRY_MODES, redact, s3_storage_options
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError

log = logging.getLogger(__name__)

T = TypeVar("T")

FORMAT_VERSION = 1
"""Version of the ``metadata.json`` layout written by this package."""

METADATA_FILE = "metadata.json"
STEP_PREFIX = "step-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_HASH_BLOCK = 8 * 2**20

_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EAGAIN,
    errno.EBUSY,  # s3fs: 503 ServiceUnavailable / SlowDown
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    getattr(errno, "EREMOTEIO", 121),  # s3fs: 500 InternalError
}
# Exception class names (anywhere in the MRO) of the HTTP stacks under s3fs/gcsfs that mean
# "the request did not get a proper answer"; matched by name so that no HTTP stack is imported.
_TRANSIENT_CLASS_NAMES = {
    "HTTPClientError",  # botocore: ConnectionClosedError, ReadTimeoutError, ...
    "ConnectionError",  # botocore's own (not the builtin): EndpointConnectionError, ConnectTimeoutError
    "ClientConnectionError",  # aiohttp
    "ClientPayloadError",
    "ServerDisconnectedError",
    "IncompleteRead",
    "ResponseParserError",
    "FSTimeoutError",
}
_TRANSIENT_S3_CODES = {
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "ServiceUnavailable",
    "InternalError",
}


class CheckpointWarning(UserWarning):
    """Skipped checkpoints, retried or abandoned saves."""


class StorageFailure(Exception):
    """Errors raised by storage on one or more ranks during one collective operation.

    Attributes:
        errors: The underlying exceptions (one per failing rank).
    """

    def __init__(self, message: str, errors: list[BaseException]) -> None:
        super().__init__(message)
        self.errors = errors


def _warn(message: str) -> None:
    message = redact(message)
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=3)


# ----------------------------------------------------------------------------- URLs


_S3_PROTOCOLS = ("s3", "s3a")


def per_request_retries(url: str) -> bool:
    """Whether botocore retries each request to ``url`` (``s3://``), so no whole-operation retry is added."""
    return fsspec.utils.get_protocol(str(url)) in _S3_PROTOCOLS


def storage_options(url: str, retry: RetryPolicy | None = None) -> dict[str, Any]:
    """fsspec options for ``url``: for S3 the endpoint and region from the environment and
    botocore's retry configuration from ``retry`` (default ``RetryPolicy()``); else none."""
    if per_request_retries(url):
        policy = retry or RetryPolicy()
        return s3_storage_options(max_attempts=policy.attempts, retry_mode=policy.s3_mode)
    return {}


def filesystem(url: str, retry: RetryPolicy | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the protocol-less path of ``url``, with ``retry``'s per-request
    retries configured for S3 (see the module docstring)."""
    fs, path = url_to_fs(str(url), **storage_options(url, retry))
    if per_request_retries(url):
        # s3fs's wrapper around each call: re-tries response bodies cut off mid-read. Not a
        # constructor argument of s3fs; the instance is cached per options, so per attempt count.
        fs.retries = (retry or RetryPolicy()).attempts
    return fs, path


def join_url(base: str, *parts: str) -> str:
    """``base/part/...`` for URLs and local paths alike."""
    base = str(base)
    if "://" in base:
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def checkpoint_url(root: str, step: int) -> str:
    """The URL of the checkpoint for ``step`` completed steps under ``root``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step is {step!r}; it must be an int >= 0 (steps completed).")
    return join_url(root, f"{STEP_PREFIX}{step}")


def _same_location(a: str, b: str) -> bool:
    fa, pa = filesystem(a)
    fb, pb = filesystem(b)
    return type(fa) is type(fb) and pa.rstrip("/") == pb.rstrip("/")


# ----------------------------------------------------------------------------- retries


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or the error it was raised from) is worth retrying.

    Transient: connection resets and refusals, timeouts, HTTP 5xx and S3 throttling answers.
    Not transient: missing files, permission errors, 4xx answers, programming errors.
    """
    if isinstance(exc, StorageFailure):
        return bool(exc.errors) and all(is_transient(e) for e in exc.errors)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_transient_one(current):
            return True
        current = current.__cause__
    return False


def _is_transient_one(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(exc).__mro__):
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = response.get("Error", {}).get("Code")
        if (isinstance(status, int) and status >= 500) or code in _TRANSIENT_S3_CODES:
            return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of transient storage errors (see the module docstring for which layer does what).

    On ``s3://`` botocore retries each request: ``attempts`` tries in total, in ``s3_mode``, with
    botocore's own exponential backoff (the delay fields do not apply there). Elsewhere
    :meth:`call` re-runs the whole operation: attempt ``i`` (0-based) that fails transiently waits
    ``min(max_delay, base_delay * multiplier**i)`` seconds, spread by +/- ``jitter``, then retries.

    Attributes:
        attempts: Tries in total (1 = no retry): of each S3 request, or of each operation elsewhere.
        base_delay: Wait after the first failure, in seconds (not S3).
        max_delay: Longest wait between two tries, in seconds (not S3).
        multiplier: Growth of the wait from one retry to the next (not S3).
        jitter: Relative random spread of each wait (0.1 = +/-10%) (not S3).
        s3_mode: botocore's retry mode for S3: ``"standard"``, or ``"adaptive"`` (standard plus
            client-side rate limiting while the server throttles).
    """

    attempts: int = DEFAULT_MAX_ATTEMPTS
    base_delay: float = 1.0
    max_delay: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.1
    s3_mode: Literal["standard", "adaptive"] = "standard"

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise CheckpointError(f"`RetryPolicy.attempts` is {self.attempts!r}; use an int >= 1 (1 = no retry).")
        if self.s3_mode not in RETRY_MODES:
            raise CheckpointError(f"`RetryPolicy.s3_mode` is {self.s3_mode!r}; use one of {list(RETRY_MODES)}.")
        for name in ("base_delay", "max_delay", "jitter"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise CheckpointError(f"`RetryPolicy.{name}` is {value!r}; use a number >= 0.")
        if not isinstance(self.multiplier, (int, float)) or self.multiplier < 1:
            raise CheckpointError(f"`RetryPolicy.multiplier` is {self.multiplier!r}; use a number >= 1.")

    def for_url(self, url: str) -> RetryPolicy:
        """The whole-operation policy for ``url``: one try where botocore retries each request
        (``s3://``; retrying the operation too would only multiply its tries), else ``self``."""
        return replace(self, attempts=1) if per_request_retries(url) else self

    def describe(self, url: str, tries: int) -> str:
        """``"after N tries"`` for an error message about an operation on ``url``."""
        if per_request_retries(url):
            return f"after up to {self.attempts} tries of each request (botocore, {self.s3_mode} mode)"
        return f"after {tries} {'try' if tries == 1 else 'tries'}"

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures (>= 1), before jitter."""
        return min(self.max_delay, self.base_delay * self.multiplier ** (failures - 1))

    def sleep(self, failures: int) -> float:
        """Wait before the next try; returns the seconds waited."""
        seconds = self.delay(failures) * (1 + random.uniform(-self.jitter, self.jitter))
        time.sleep(max(0.0, seconds))
        return seconds

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn`` until it succeeds, retrying transient errors.

        Args:
            fn: The operation; it must be safe to repeat.
            what: Short description for log lines ("writing metadata.json of ...").

        Returns:
            ``fn()``'s result.

        Raises:
            Exception: the last error, when it is not transient or the tries are used up.
        """
        for failures in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:
                if failures >= self.attempts or not is_transient(exc):
                    raise
                log.warning(
                    redact(
                        f"Transient storage error while {what} (try {failures}/{self.attempts}): "
                        f"{type(exc).__name__}: {exc}; retrying in ~{self.delay(failures):.2f}s."
                    )
                )
                self.sleep(failures)
        raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- metadata.json


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
        extra_metadata: ``plan`` (dict), ``fingerprint`` (dict or None) and ``metrics``
            (name -> float, used by :class:`Retention`) are stored at the top level; any other
            key is stored under ``extra``. Values must be JSON-serializable.

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

    ``retry`` sets the per-request retries on S3 (:func:`filesystem`).

    Raises:
        CorruptCheckpointError: missing (an unfinished save), unreadable, or not of this format.
    """
    fs, path = filesystem(ckpt_url, retry)
    fs.invalidate_cache(path)
    try:
        raw = fs.cat_file(f"{path.rstrip('/')}/{METADATA_FILE}")
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{ckpt_url!r} has no {METADATA_FILE}: the save that wrote it did not finish."
        ) from None
    try:
        meta = json.loads(raw)
    except ValueError as exc:
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
        if not (isinstance(s, dict) and {"path", "size", "sha256"} <= s.keys()):
            raise CorruptCheckpointError(f"{METADATA_FILE} of {ckpt_url!r} has a malformed shard entry {s!r}.")
    return meta


def sha256_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """sha256 hex digest of one file, streamed."""
    digest = hashlib.sha256()
    with fs.open(path, "rb", block_size=_HASH_BLOCK) as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def verify(ckpt_url: str, *, checksums: bool = True, retry: RetryPolicy | None = None) -> CheckpointInfo:
    """Check that the checkpoint at ``ckpt_url`` is committed and whole.

    Args:
        ckpt_url: A checkpoint directory (``<root>/step-<N>``).
        checksums: Also recompute every file's sha256 (reads the whole checkpoint). Without it
            only presence and sizes are checked.
        retry: Per-request retries on S3 (:func:`filesystem`); default ``RetryPolicy()``.

    Returns:
        The checkpoint's :class:`CheckpointInfo`.

    Raises:
        CorruptCheckpointError: no ``metadata.json``, a shard missing, truncated or with a
            checksum that does not match.
    """
    meta = read_metadata(ckpt_url, retry=retry)
    fs, path = filesystem(ckpt_url, retry)
    for shard in meta["shards"]:
        shard_path = f"{path.rstrip('/')}/{shard['path']}"
        try:
            size = fs.info(shard_path)["size"]
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{ckpt_url!r}: shard {shard['path']!r} is missing.") from None
        if size != shard["size"]:
            raise CorruptCheckpointError(
                f"{ckpt_url!r}: shard {shard['path']!r} has {size} bytes, {METADATA_FILE} says "
                f"{shard['size']} (truncated or overwritten)."
            )
        if checksums and sha256_of(fs, shard_path) != shard["sha256"]:
            raise CorruptCheckpointError(f"{ckpt_url!r}: shard {shard['path']!r} fails its sha256 checksum.")
    return CheckpointInfo(url=str(ckpt_url), step=int(meta["step"]), metadata=meta)


# ----------------------------------------------------------------------------- discovery


def step_dirs(root: str) -> list[tuple[int, str]]:
    """All ``step-<N>`` directories under ``root`` (committed or not), by increasing N.

    Raises:
        CheckpointError: ``root`` is in an object-store bucket that does not exist (a typo there
            must not look like "no checkpoints yet").
    """
    fs, path = filesystem(root)
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
            bucket = path.strip("/").split("/", 1)[0]
            if not fs.exists(bucket):
                raise CheckpointError(
                    f"checkpoint root {root!r}: bucket {bucket!r} does not exist or is not visible "
                    f"with the credentials in the environment. Create it, or fix the URL (and "
                    f"AWS_ENDPOINT_URL for a non-AWS server)."
                ) from None
        log.info("checkpoint root %r does not exist yet: no checkpoints", redact(str(root)))
        return []
    found = []
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        match = _STEP_DIR.match(name)
        if match and entry.get("type") == "directory":
            found.append((int(match.group(1)), join_url(root, name)))
    return sorted(found)


def newest_valid_anywhere(roots: Iterable[str], *, prefer: str | None = None, checksums: bool = False) -> CheckpointInfo | None:
    """The newest valid checkpoint in any directory under ``roots``, whatever its name.

    Unlike :func:`latest_valid` this also finds checkpoints that Lightning's ``ModelCheckpoint``
    names (``epoch=0-step=8.ckpt``, ``last.ckpt``). Candidates are ordered by the step recorded
    in their ``metadata.json``, then by its creation time; unfinished or corrupt ones are skipped
    with a warning.

    Args:
        roots: Directories (any fsspec URL) that hold checkpoint directories.
        prefer: A name prefix (``"last"``): if any valid checkpoint's name starts with it, only
            those are considered.
        checksums: Recompute sha256 of the chosen checkpoint's files.
    """
    candidates: list[tuple[int, float, str]] = []
    for root in roots:
        fs, path = filesystem(root)
        fs.invalidate_cache(path)
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.get("type") != "directory":
                continue
            url = join_url(root, entry["name"].rstrip("/").rsplit("/", 1)[-1])
            try:
                meta = read_metadata(url)
            except CorruptCheckpointError:
                continue
            candidates.append((int(meta["step"]), float(meta.get("created", 0.0) or 0.0), url))
    if prefer and any(u.rstrip("/").rsplit("/", 1)[-1].startswith(prefer) for _, _, u in candidates):
        candidates = [c for c in candidates if c[2].rstrip("/").rsplit("/", 1)[-1].startswith(prefer)]
    for _, _, url in sorted(candidates, reverse=True):
        try:
            return verify(url, checksums=checksums)
        except CorruptCheckpointError as exc:
            _warn(f"Skipping checkpoint: {exc} Falling back to an older checkpoint.")
    return None


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root`` (``metadata.json`` present and readable), oldest first.

    Files are not checked; use :func:`verify` or :func:`latest_valid` for that. A root that does
    not exist has no checkpoints.
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
    """The newest checkpoint under ``root`` that passes :func:`verify`.

    Newer directories that are unfinished or corrupt are skipped with a :class:`CheckpointWarning`
    naming the reason.

    Args:
        root: Directory holding ``step-<N>`` checkpoints (any fsspec URL).
        checksums: Recompute sha256 of every file of the candidate (see :func:`verify`).

    Returns:
        The checkpoint, or ``None`` when ``root`` holds no valid one (or does not exist).
    """
    for _, url in reversed(step_dirs(root)):
        try:
            return verify(url, checksums=checksums)
        except CorruptCheckpointError as exc:
            _warn(f"Skipping checkpoint: {exc} Falling back to an older checkpoint.")
    return None


# ----------------------------------------------------------------------------- retention


@dataclass
class Retention:
    """Which checkpoints to keep: the last ``keep_last`` and the best ``keep_best`` by a metric.

    A checkpoint survives if any rule keeps it. :meth:`apply` never deletes a checkpoint named in
    ``protect`` (the one a run resumed from) nor the newest valid one. ``None`` for both rules
    keeps everything.

    Attributes:
        keep_last: Number of most recent committed checkpoints to keep.
        keep_best: Number of best checkpoints by ``monitor`` to keep.
        monitor: Metric name looked up in ``metadata.json``'s ``metrics``.
        mode: ``"min"`` or ``"max"``: which values are best.
        clean_incomplete: Also delete unfinished saves (no ``metadata.json``) older than the newest
            valid checkpoint.
    """

    keep_last: int | None = None
    keep_best: int | None = None
    monitor: str | None = None
    mode: Literal["min", "max"] = "min"
    clean_incomplete: bool = True

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CheckpointError(
                    f"`Retention.{name}` is {value!r}; use an int >= 1, or None to not apply this rule."
                )
        if self.mode not in ("min", "max"):
            raise CheckpointError(f"`Retention.mode` is {self.mode!r}; use 'min' or 'max'.")
        if self.keep_best is not None and not self.monitor:
            raise CheckpointError(
                f"`Retention(keep_best={self.keep_best!r})` needs `monitor=` (a metric name passed in "
                f"`extra_metadata['metrics']` when saving), for example monitor='val/loss'."
            )

    def select(
        self, checkpoints: list[CheckpointInfo], *, protect: Iterable[str] = (), newest_valid: str | None = None
    ) -> tuple[list[CheckpointInfo], list[CheckpointInfo]]:
        """Split ``checkpoints`` into (kept, to delete); pure, touches no storage."""
        if self.keep_last is None and self.keep_best is None:
            return list(checkpoints), []
        ordered = sorted(checkpoints, key=lambda c: c.step)
        keep: set[str] = set()
        if self.keep_last is not None:
            keep.update(c.url for c in ordered[-self.keep_last :])
        if self.keep_best is not None:
            scored = [c for c in ordered if self.monitor in c.metrics]
            sign = 1.0 if self.mode == "min" else -1.0
            # ties: the newer checkpoint wins
            scored.sort(key=lambda c: (sign * c.metrics[self.monitor], -c.step))
            keep.update(c.url for c in scored[: self.keep_best])
        guarded = [u for u in [*protect, newest_valid] if u]
        kept, dropped = [], []
        for c in ordered:
            if c.url in keep or any(_same_location(c.url, g) for g in guarded):
                kept.append(c)
            else:
                dropped.append(c)
        return kept, dropped

    def apply(self, root: str, protect: Iterable[str] = (), *, checksums: bool = False) -> list[str]:
        """Delete the checkpoints under ``root`` that no rule keeps.

        Args:
            root: Directory holding ``step-<N>`` checkpoints.
            protect: Checkpoint URLs never to delete (the one this run resumed from).
            checksums: Use full checksums to find the newest valid checkpoint (else sizes).

        Returns:
            URLs deleted, oldest first.
        """
        protect = [str(p) for p in protect]
        newest = latest_valid(root, checksums=checksums)
        _, dropped = self.select(
            list_checkpoints(root), protect=protect, newest_valid=newest.url if newest else None
        )
        doomed = [c.url for c in dropped]
        if self.clean_incomplete and newest is not None:
            committed = {c.url for c in list_checkpoints(root)}
            doomed += [
                url
                for step, url in step_dirs(root)
                if step < newest.step and url not in committed and not any(_same_location(url, p) for p in protect)
            ]
        for url in doomed:
            delete_checkpoint(url)
        return doomed


def delete_checkpoint(ckpt_url: str) -> None:
    """Delete a checkpoint directory: ``metadata.json`` first, so a crash leaves it uncommitted."""
    remove_metadata(ckpt_url)
    fs, path = filesystem(ckpt_url)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)
