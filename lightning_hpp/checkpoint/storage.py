"""Where checkpoints live: the one place an fsspec filesystem is made, and checkpoint URLs.

:func:`filesystem` makes every filesystem this package reads and writes through (discovery,
verification, ``metadata.json``, torch.distributed.checkpoint's shard reader and writer), with the
per-request retries of :class:`~lightning_hpp.checkpoint.retry.RetryPolicy` on S3.

Lightning's own storage calls (``ModelCheckpoint``'s ``file_exists`` / ``ls`` on an ``s3://`` dirpath,
its ``last`` lookup, a logger writing to S3) use filesystems Lightning makes itself, with no options.
:func:`route_storage`, set by the strategy for the length of a run, gives every s3fs filesystem made in
the process the same botocore retry configuration as ours, as fsspec's per-protocol defaults.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from lightning_hpp.checkpoint.retry import RetryPolicy, is_s3
from lightning_hpp.checkpoint.s3 import s3_storage_options
from lightning_hpp.errors import CheckpointError
from lightning_hpp.validation import check_int

STEP_PREFIX = "step-"
"""A checkpoint directory's name is ``step-<N>`` (:func:`checkpoint_url`)."""


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


def same_location(a: str, b: str) -> bool:
    """Whether two URLs name the same place (same filesystem, same path)."""
    fa, pa = filesystem(a)
    fb, pb = filesystem(b)
    return type(fa) is type(fb) and pa.rstrip("/") == pb.rstrip("/")

