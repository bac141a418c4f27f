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
  operation, ``tenacity``'s retry loop with exponential backoff on the errors :func:`is_transient`
  recognises. It is kept because nothing below it retries there: a torch.distributed.checkpoint
  save or load that fails halfway (``EAGAIN``/``EBUSY`` on NFS, a reset under gcsfs) can only be
  re-run whole, and it is collective, so every rank re-runs it together.

:meth:`RetryPolicy.for_url` gives the whole-operation policy for a URL (one try on ``s3://``).

Lightning's own storage calls (``ModelCheckpoint``'s ``file_exists`` / ``ls`` on an ``s3://`` dirpath,
its ``last`` lookup, a logger writing to S3) use filesystems Lightning makes itself, with no options.
:func:`route_storage`, set by the strategy for the length of a run, gives every s3fs filesystem made in
the process the same botocore retry configuration as ours, as fsspec's per-protocol defaults.

Lookups and small reads (listing a root, ``metadata.json``, the shard index, file sizes, the
checksum streams) are retried whole by :meth:`RetryPolicy.call` on every store, S3 included: they
are cheap to repeat, and a resume that dies on one 503 while listing checkpoints is a crash loop
under an elastic launcher. ``RetryPolicy(s3_per_request=False)`` turns botocore's and s3fs's
per-request retries off, so that on S3 too every read, lookup and write is retried by the
whole-operation layer alone (for S3-compatible servers whose retry answers botocore misreads).

Damaged checkpoints are never deleted: :func:`quarantine` moves them to ``<root>/corrupt/``, where
they are out of the way of discovery, retention and the next save of the same step.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal, TypeVar

import fsspec
import tenacity
from fsspec.core import url_to_fs

from lightning_hpp import liveness
from lightning_hpp.checkpoint.s3 import DEFAULT_MAX_ATTEMPTS, RETRY_MODES, s3_storage_options
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from lightning_hpp.redaction import redact
from lightning_hpp.validation import check_bool, check_choice, check_int, check_number

log = logging.getLogger(__name__)

T = TypeVar("T")

FORMAT_VERSION = 1
"""Version of the ``metadata.json`` layout written by this package."""

METADATA_FILE = "metadata.json"
STEP_PREFIX = "step-"
_STEP_DIR = re.compile(r"^step-(\d+)(?:-v\d+)?$")  # ModelCheckpoint adds -v<k> when the name exists
CORRUPT_DIR = "corrupt"
"""Sub-directory of a checkpoint root that damaged checkpoints are moved to (never deleted)."""
_HASH_THREADS = 4
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


def is_s3(url: str) -> bool:
    """Whether ``url`` is on S3 (``s3://``, ``s3a://``)."""
    return fsspec.utils.get_protocol(str(url)) in _S3_PROTOCOLS


def per_request_retries(url: str, retry: RetryPolicy | None = None) -> bool:
    """Whether botocore retries each request to ``url`` (``s3://`` unless ``retry.s3_per_request``
    is off), so no whole-operation retry is added to big reads and writes."""
    return is_s3(url) and (retry is None or retry.s3_per_request)


def storage_options(url: str, retry: RetryPolicy | None = None) -> dict[str, Any]:
    """fsspec options for ``url``: for S3 the endpoint and region from the environment and
    botocore's retry configuration from ``retry`` (default ``RetryPolicy()``); else none."""
    if is_s3(url):
        policy = retry or RetryPolicy()
        attempts = policy.attempts if policy.s3_per_request else 1
        return s3_storage_options(max_attempts=attempts, retry_mode=policy.s3_mode)
    return {}


def filesystem(url: str, retry: RetryPolicy | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the protocol-less path of ``url``, with ``retry``'s per-request
    retries configured for S3 (see the module docstring)."""
    fs, path = url_to_fs(str(url), **storage_options(url, retry))
    if is_s3(url):
        # s3fs's wrapper around each call: re-tries response bodies cut off mid-read. Not a
        # constructor argument of s3fs; the instance is cached per options, so per attempt count.
        policy = retry or RetryPolicy()
        fs.retries = policy.attempts if policy.s3_per_request else 1
    return fs, path


def route_storage(retry: RetryPolicy | None = None) -> Callable[[], None]:
    """Give every s3fs filesystem this process makes from now on ``retry``'s per-request retries
    (default ``RetryPolicy()``): Lightning's ``ModelCheckpoint``, loggers, user code alike.

    They go into fsspec's defaults for the ``s3`` protocol (``fsspec.config.conf``), merged with any
    ``config_kwargs`` already there; a filesystem made with explicit options (ours) keeps its own.
    Off S3 nothing changes: Lightning's lookups there are not retried.

    Returns:
        The function that puts the earlier defaults back (the strategy calls it at teardown).
    """
    before = fsspec.config.conf.get("s3")
    conf = dict(before or {})
    conf["config_kwargs"] = {**conf.get("config_kwargs", {}), **storage_options("s3://", retry)["config_kwargs"]}
    fsspec.config.conf["s3"] = conf

    def restore() -> None:
        if fsspec.config.conf.get("s3") is not conf:
            return  # restored already, or replaced since: leave it
        if before is None:
            del fsspec.config.conf["s3"]
        else:
            fsspec.config.conf["s3"] = before

    return restore


def join_url(base: str, *parts: str) -> str:
    """``base/part/...`` for URLs and local paths alike."""
    base = str(base)
    if "://" in base:
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def checkpoint_url(root: str, step: int) -> str:
    """The URL of the checkpoint for ``step`` completed steps under ``root``."""
    check_int(step, "checkpoint_url(step=...)", minimum=0, error=CheckpointError, hint="It counts the steps completed.")
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
        s3_per_request: Let botocore (and s3fs) retry each S3 request. ``False``: one try per
            request, and every operation on S3 is retried whole as on other stores.
    """

    attempts: int = DEFAULT_MAX_ATTEMPTS
    base_delay: float = 1.0
    max_delay: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.1
    s3_mode: Literal["standard", "adaptive"] = "standard"
    s3_per_request: bool = True

    def __post_init__(self) -> None:
        check_int(self.attempts, "RetryPolicy(attempts=...)", error=CheckpointError, hint="1 means no retry.")
        check_choice(self.s3_mode, "RetryPolicy(s3_mode=...)", RETRY_MODES, error=CheckpointError)
        for name in ("base_delay", "max_delay", "jitter"):
            check_number(getattr(self, name), f"RetryPolicy({name}=...)", strict=False, error=CheckpointError)
        check_number(self.multiplier, "RetryPolicy(multiplier=...)", minimum=1, strict=False, error=CheckpointError)
        check_bool(self.s3_per_request, "RetryPolicy(s3_per_request=...)", error=CheckpointError)

    def for_url(self, url: str) -> RetryPolicy:
        """The whole-operation policy for ``url``: one try where botocore retries each request
        (``s3://``; retrying the operation too would only multiply its tries), else ``self``."""
        return replace(self, attempts=1) if per_request_retries(url, self) else self

    def describe(self, url: str, tries: int) -> str:
        """``"after N tries"`` for an error message about an operation on ``url``."""
        if per_request_retries(url, self):
            return f"after up to {self.attempts} tries of each request (botocore, {self.s3_mode} mode)"
        return f"after {tries} {'try' if tries == 1 else 'tries'}"

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures (>= 1), before jitter."""
        return min(self.max_delay, self.base_delay * self.multiplier ** (failures - 1))

    def call(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn`` until it succeeds, retrying transient errors (``tenacity``).

        Args:
            fn: The operation; it must be safe to repeat.
            what: Short description for log lines ("writing metadata.json of ...").

        Returns:
            ``fn()``'s result.

        Raises:
            Exception: the last error, when it is not transient or the tries are used up.
        """

        def wait(state: tenacity.RetryCallState) -> float:
            return max(0.0, self.delay(state.attempt_number) * (1 + random.uniform(-self.jitter, self.jitter)))

        def say(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception()
            log.warning(redact(f"Transient storage error while {what} (try {state.attempt_number}/{self.attempts}): "
                               f"{type(exc).__name__}: {exc}; retrying in ~{state.upcoming_sleep:.2f}s."))

        retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(self.attempts), wait=wait, before_sleep=say,
                                     retry=tenacity.retry_if_exception(is_transient), reraise=True)
        return retrying(fn)


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
            training run) and ``metrics`` (name -> float, used by :class:`Retention`) are stored at
            the top level; any other key is stored under ``extra``. Values must be JSON-serializable.

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


def _lookup(retry: RetryPolicy | None, fn: Callable[[], T], what: str) -> T:
    """A lookup or small read, retried whole on transient errors on every store (module docstring); named in this
    rank's heartbeat while it runs, so that a store that does not answer is named by the ranks waiting for it."""
    with liveness.activity(redact(what)):
        return (retry or RetryPolicy()).call(fn, what=what)


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
        raw = _lookup(retry, cat, f"reading {METADATA_FILE} of {ckpt_url!r}")
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

    present = _lookup(retry, sizes, f"listing the files of {ckpt_url!r}")
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
            return _lookup(retry, lambda: sha256_of(fs, target), f"reading {target!r} for its checksum")

        with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(shards)), thread_name_prefix="ckpt-sha256") as pool:
            digests = list(pool.map(digest, shards))
        bad = [s["path"] for s, d in zip(shards, digests) if d != s["sha256"]]
        if bad:
            raise CorruptCheckpointError(
                f"{ckpt_url!r}: {'shard' if len(bad) == 1 else 'shards'} {', '.join(map(repr, bad))} "
                f"{'fails its' if len(bad) == 1 else 'fail their'} sha256 checksum (the bytes changed after the save)."
            )
    return CheckpointInfo(url=str(ckpt_url), step=int(meta["step"]), metadata=meta)


def has_file(ckpt_url: str, name: str, *, retry: RetryPolicy | None = None) -> bool:
    """Whether the checkpoint directory ``ckpt_url`` holds a file called ``name``."""
    fs, path = filesystem(ckpt_url, retry)
    target = f"{path.rstrip('/')}/{name}"

    def exists() -> bool:
        fs.invalidate_cache(path)
        return fs.exists(target)

    return _lookup(retry, exists, f"looking for {target!r}")


# ----------------------------------------------------------------------------- discovery


def _name(url: str) -> str:
    return str(url).rstrip("/").rsplit("/", 1)[-1]


def _ls_dirs(root: str, retry: RetryPolicy | None) -> list[str] | None:
    """Names of the sub-directories of ``root``; ``None`` when ``root`` does not exist."""
    fs, path = filesystem(root, retry)

    def ls() -> list[dict[str, Any]]:
        fs.invalidate_cache(path)
        return fs.ls(path, detail=True)

    try:
        entries = _lookup(retry, ls, f"listing {root!r}")
    except FileNotFoundError:
        if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
            bucket = path.strip("/").split("/", 1)[0]
            if not _lookup(retry, lambda: fs.exists(bucket), f"looking for bucket {bucket!r}"):
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
    return [_name(e["name"]) for e in entries if e.get("type") == "directory"]


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
    if prefer and any(_name(c.url).startswith(prefer) for c in out.committed):
        out.committed = [c for c in out.committed if _name(c.url).startswith(prefer)]
    last_save: dict[Any, float] = {}
    for c in out.committed:
        last_save[c.run_id] = max(last_save.get(c.run_id, 0.0), c.created)
    out.committed.sort(key=lambda c: (last_save[c.run_id], c.step, c.created), reverse=True)
    return out


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


def quarantine(ckpt_url: str, *, retry: RetryPolicy | None = None) -> str:
    """Move a damaged checkpoint to ``<root>/corrupt/<name>`` (``<name>.2``... if taken); returns its new URL.

    The evidence is kept, out of the way of discovery, retention and the next save of that step.
    """
    url = str(ckpt_url).rstrip("/")
    name = _name(url)
    root = url[: -len(name)].rstrip("/") or "/"
    fs, path = filesystem(url, retry)
    _, root_path = filesystem(root, retry)
    target_dir = f"{root_path.rstrip('/')}/{CORRUPT_DIR}"
    target, k = f"{target_dir}/{name}", 1
    while _lookup(retry, lambda t=target: fs.exists(t), f"looking for {target!r}"):
        k += 1
        target = f"{target_dir}/{name}.{k}"
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        os.makedirs(target_dir, exist_ok=True)
        os.rename(path, target)  # one atomic step
    else:  # object stores: copy every object, then un-commit the original and delete it
        base = path.rstrip("/")
        files = _lookup(retry, lambda: fs.find(base), f"listing {url!r}")
        for src in files:
            dst = f"{target}/{src[len(base) + 1 :]}"
            _lookup(retry, lambda s=src, d=dst: fs.copy(s, d), f"copying {src!r} to {dst!r}")
        delete_checkpoint(url, retry=retry)
    fs.invalidate_cache(root_path)
    return join_url(root, CORRUPT_DIR, _name(target))


# ----------------------------------------------------------------------------- retention


@dataclass
class Retention:
    """Which checkpoints to keep: the last ``keep_last`` and the best ``keep_best`` by a metric.

    A checkpoint survives if any rule keeps it. :meth:`apply` never deletes a checkpoint named in
    ``protect`` (the one a run resumed from) nor the newest valid one, and never one it cannot
    verify: each checkpoint it would delete is first checked (sizes and sha256, one read of it)
    and a damaged one is moved to ``<root>/corrupt/`` instead. ``None`` for both rules keeps
    everything.

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
            check_int(getattr(self, name), f"Retention({name}=...)", optional=True, error=CheckpointError,
                      hint="None does not apply this rule.")
        check_choice(self.mode, "Retention(mode=...)", ("min", "max"), error=CheckpointError)
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
        """Delete the checkpoints under ``root`` that no rule keeps; move damaged ones aside.

        Args:
            root: Directory holding ``step-<N>`` checkpoints.
            protect: Checkpoint URLs never to delete (the one this run resumed from).
            checksums: Use full checksums to find the newest valid checkpoint (else sizes).

        Returns:
            URLs deleted, oldest first (not those moved to ``<root>/corrupt/``).
        """
        protect = [str(p) for p in protect]
        newest = latest_valid(root, checksums=checksums)
        committed = list_checkpoints(root)
        _, dropped = self.select(committed, protect=protect, newest_valid=newest.url if newest else None)
        deleted = []
        for info in dropped:
            try:
                verify(info.url, checksums=True)
            except CorruptCheckpointError as exc:
                self._set_aside(info.url, str(exc))
                continue
            delete_checkpoint(info.url)
            deleted.append(info.url)
        if self.clean_incomplete and newest is not None:
            names = {c.url for c in committed}
            for step, url in step_dirs(root):
                if step >= newest.step or url in names or any(_same_location(url, p) for p in protect):
                    continue
                try:
                    read_metadata(url)
                except IncompleteCheckpointError:
                    delete_checkpoint(url)
                    deleted.append(url)
                except CorruptCheckpointError as exc:
                    self._set_aside(url, str(exc))
        return deleted

    @staticmethod
    def _set_aside(url: str, reason: str) -> None:
        moved = quarantine(url)
        _warn(f"Retention kept a damaged checkpoint: {reason} Moved it to {moved!r} instead of deleting it.")


def delete_checkpoint(ckpt_url: str, *, retry: RetryPolicy | None = None) -> None:
    """Delete a checkpoint directory: ``metadata.json`` first, so a crash leaves it uncommitted."""
    remove_metadata(ckpt_url, retry=retry)
    fs, path = filesystem(ckpt_url, retry)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)
