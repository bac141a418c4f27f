"""Retries of transient storage errors: which errors are transient, and one policy for both layers.

Transient errors (connection resets, 5xx, throttling, timeouts) are retried under one
:class:`RetryPolicy` configuring two layers, each covering what the other cannot:

* ``s3://``: botocore, per request. :func:`~lightning_hpp.checkpoint.storage.filesystem` (the one
  place an fsspec filesystem is made: discovery, :func:`~lightning_hpp.checkpoint.checksums.verify`,
  ``metadata.json``, and torch.distributed.checkpoint's shard reader and writer all use it) hands
  botocore's retry configuration to s3fs (``config_kwargs={"retries": {"total_max_attempts":
  attempts, "mode": "standard"|"adaptive"}}``), so every PUT, GET, HEAD and
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

Lookups and small reads (listing a root, ``metadata.json``, the shard index, file sizes, the
checksum streams) are retried whole by :meth:`RetryPolicy.call` on every store, S3 included: they
are cheap to repeat, and a resume that dies on one 503 while listing checkpoints is a crash loop
under an elastic launcher. ``RetryPolicy(s3_per_request=False)`` turns botocore's and s3fs's
per-request retries off, so that on S3 too every read, lookup and write is retried by the
whole-operation layer alone (for S3-compatible servers whose retry answers botocore misreads).
"""

from __future__ import annotations

import errno
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import fsspec
import tenacity

from lightning_hpp import liveness
from lightning_hpp.checkpoint.s3 import DEFAULT_MAX_ATTEMPTS, RETRY_MODES
from lightning_hpp.errors import CheckpointError
from lightning_hpp.redaction import redact
from lightning_hpp.validation import check_bool, check_choice, check_int, check_number

log = logging.getLogger(__name__)

T = TypeVar("T")

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


class StorageFailure(Exception):
    """Errors raised by storage on one or more ranks during one collective operation.

    Attributes:
        errors: The underlying exceptions (one per failing rank).
    """

    def __init__(self, message: str, errors: list[BaseException]) -> None:
        super().__init__(message)
        self.errors = errors


_S3_PROTOCOLS = ("s3", "s3a")


def is_s3(url: str) -> bool:
    """Whether ``url`` is on S3 (``s3://``, ``s3a://``)."""
    return fsspec.utils.get_protocol(str(url)) in _S3_PROTOCOLS


def per_request_retries(url: str, retry: RetryPolicy | None = None) -> bool:
    """Whether botocore retries each request to ``url`` (``s3://`` unless ``retry.s3_per_request``
    is off), so no whole-operation retry is added to big reads and writes."""
    return is_s3(url) and (retry is None or retry.s3_per_request)


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


def lookup(retry: RetryPolicy | None, fn: Callable[[], T], what: str) -> T:
    """A lookup or small read, retried whole on transient errors on every store (module docstring); named in this
    rank's heartbeat while it runs, so that a store that does not answer is named by the ranks waiting for it."""
    with liveness.activity(redact(what)):
        return (retry or RetryPolicy()).call(fn, what=what)
