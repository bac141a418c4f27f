"""The storage writer of a save: torch.distributed.checkpoint's fsspec writer with this package's commit.

Saving follows this package's commit protocol inside torch.distributed.checkpoint's own steps
(:class:`CommitWriter`): the coordinator un-commits an older save of the step before any rank writes,
every rank hashes the files it writes, and the coordinator writes ``metadata.json`` (every file's
size and sha256: the commit) once the index is written. ``async_save=True`` is
:func:`torch.distributed.checkpoint.async_save` with a staging step (a CPU copy taken before it
returns) and the same writer, on a gloo group of its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, TypeVar

import fsspec
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from lightning_hpp.checkpoint.commit import (
    METADATA_FILE,
    CheckpointInfo,
    build_metadata,
    read_metadata,
    remove_metadata,
    write_metadata,
)
from lightning_hpp.checkpoint.dcp_index import DCP_INDEX
from lightning_hpp.checkpoint.retention import Retention
from lightning_hpp.checkpoint.retry import RetryPolicy
from lightning_hpp.checkpoint.storage import filesystem, storage_options
from lightning_hpp.checkpoint.warning import warn_checkpoint
from lightning_hpp.errors import CheckpointSaveError
from lightning_hpp.redaction import redact

log = logging.getLogger(__name__)

T = TypeVar("T")


class _HashingStream:
    """Write-through wrapper that counts bytes and computes sha256 of what passes."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        self._raw.write(data)
        return view.nbytes

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        # callers fsync this descriptor: push Python-level buffers to the OS first
        self._raw.flush()
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()


class _HashingFileSystem(_FsspecFileSystem):
    """torch.distributed.checkpoint's fsspec adapter, recording size and sha256 of each file."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        super().__init__()
        self.fs = fs
        self.files: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: Any, mode: str):  # type: ignore[override]
        if not any(ch in mode for ch in "wa+"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            hashing = _HashingStream(raw)
            yield hashing
        # the with-block closed the file: for object stores the upload is complete here
        with self._lock:
            self.files[_basename(path)] = (hashing.size, hashing.sha256.hexdigest())

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        with self._lock:
            if _basename(path) in self.files:
                self.files[_basename(new_path)] = self.files.pop(_basename(path))


def _basename(path: Any) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


FILE_RECORD = "@file"  # index name of the write results that carry one written file's size and sha256


class CommitWriter(FsspecWriter):
    """torch.distributed.checkpoint's fsspec writer, carrying this package's commit protocol.

    torch.distributed.checkpoint calls it in this order, so the protocol needs no collective of
    its own, and runs the same in :func:`torch.distributed.checkpoint.save` and in ``async_save``'s
    background thread:

    * ``prepare_local_plan``: the target directory is made; on the coordinator (rank 0 of the
      group), whose plan is gathered before any rank may write, an older save of this step is
      un-committed first (its ``metadata.json`` and ``.metadata`` removed), so that it never stays
      committed while its files are replaced;
    * ``write_data``, on every rank: its own files, hashed while written and retried whole (they
      are this rank's alone); their names, sizes and sha256 travel to the coordinator beside the
      write results (as records under :data:`FILE_RECORD`, taken out again before the index is
      written);
    * ``finish``, on the coordinator, once every rank has written: ``.metadata`` (the shard index),
      then ``metadata.json`` with every file's checksum (the commit), then ``retention``.

    Each step retries transient errors with ``retry.for_url(url)`` (on ``s3://`` botocore
    retries each request instead) and fails with :class:`CheckpointSaveError` naming the step.
    """

    def __init__(self, url: str, step: int, extra_metadata: dict[str, Any], retry: RetryPolicy,
                 retention: Retention | None, protect: tuple[str, ...]) -> None:
        fs, _ = filesystem(url, retry)
        local = isinstance(fs, fsspec.implementations.local.LocalFileSystem)
        # fsync is meaningless for object stores (and falls back to a host-wide sync())
        super().__init__(url, sync_files=local, overwrite=True, **storage_options(url, retry))
        self.fs = _HashingFileSystem(fs)  # the configured filesystem, retries included
        self.url, self.step, self.extra_metadata, self.retry = url, step, extra_metadata, retry
        self.retention, self.protect = retention, protect
        self.coordinator = False
        self.committed: dict[str, Any] | None = None  # metadata.json as written (coordinator)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.coordinator = is_coordinator

    def _metadata_exists(self) -> bool:
        return False  # an older save of this step is un-committed below, never "overwritten" with a warning

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.coordinator:
            self._step(self._uncommit, "clearing the target directory")
        return self._step(lambda: FsspecWriter.prepare_local_plan(self, plan), "preparing the target directory")

    def _uncommit(self) -> None:
        remove_metadata(self.url, retry=self.retry)
        fs, path = filesystem(self.url, self.retry)
        try:
            fs.rm_file(f"{path.rstrip('/')}/{DCP_INDEX}")
        except FileNotFoundError:
            pass

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        def attempt() -> list[WriteResult]:
            self.fs.files.clear()
            return FsspecWriter.write_data(self, plan, planner).value()

        results = self._step(attempt, "writing the shards")
        records = [WriteResult(index=MetadataIndex(FILE_RECORD), size_in_bytes=size, storage_data=(name, sha))
                   for name, (size, sha) in self.fs.files.items()]
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results + records)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = [(wr.storage_data, wr.size_in_bytes) for rank in results for wr in rank if wr.index.fqn == FILE_RECORD]
        writes = [[wr for wr in rank if wr.index.fqn != FILE_RECORD] for rank in results]
        self.fs.files.clear()
        self._step(lambda: FsspecWriter.finish(self, metadata, writes), f"writing {DCP_INDEX}")
        shards = [{"path": name, "size": size, "sha256": sha} for (name, sha), size in files]
        shards += [{"path": name, "size": size, "sha256": sha} for name, (size, sha) in self.fs.files.items()]
        meta = build_metadata(step=self.step, shards=shards, world_size=len(results),
                              extra_metadata=self.extra_metadata)
        self._step(lambda: write_metadata(self.url, meta, retry=self.retry), f"writing {METADATA_FILE}")
        self.committed = meta
        if self.retention is not None:
            url = self.url.rstrip("/")
            root = url.rsplit("/", 1)[0] if "://" in url else os.path.dirname(url)
            try:
                deleted = self.retention.apply(root, protect=(*self.protect, self.url))
                if deleted:
                    log.info("retention deleted %s", deleted)
            except Exception as exc:  # retention must never fail a save that committed
                warn_checkpoint(f"Retention on {root!r} failed ({type(exc).__name__}: {exc}); nothing else changed.")

    def _step(self, fn: Callable[[], T], what: str) -> T:
        tries = 0

        def attempt() -> T:
            nonlocal tries
            tries += 1
            return fn()

        try:
            return self.retry.for_url(self.url).call(attempt, what=f"{what} of {self.url!r}")
        except Exception as exc:
            raise CheckpointSaveError(redact(
                f"Saving checkpoint {self.url!r} (step {self.step}) failed while {what} "
                f"{self.retry.describe(self.url, tries)}: {type(exc).__name__}: {exc}. {UNTOUCHED}"
            )) from exc

    def info(self) -> CheckpointInfo:
        """The committed checkpoint; ranks other than the coordinator read its ``metadata.json``."""
        meta = self.committed if self.committed is not None else read_metadata(self.url, retry=self.retry)
        return CheckpointInfo(url=self.url, step=self.step, metadata=meta)


UNTOUCHED = ("Earlier checkpoints are untouched and this one is not committed. Check the storage (endpoint, "
              "credentials, free space), or pass on_error='warn' to keep training without this checkpoint.")


def save_error(exc: CheckpointException, url: str, step: int, world: int) -> CheckpointSaveError:
    """One error for every rank of a failed save: the failing step's own message where a step of
    :class:`CommitWriter` failed (naming its rank), else what torch.distributed.checkpoint raised."""
    failures = sorted(exc.failures.items())
    for rank, (err, _) in failures:
        if isinstance(err, CheckpointSaveError):
            return CheckpointSaveError(f"rank {rank}: {err}" if world > 1 else str(err))
    lines = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in failures)
    return CheckpointSaveError(redact(f"Saving checkpoint {url!r} (step {step}) failed: {lines}. {UNTOUCHED}"))
