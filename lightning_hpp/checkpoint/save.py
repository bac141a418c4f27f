"""Sharded save of a training state: :func:`save_sharded`, synchronous or in the background.

Every rank passes the part of the state it holds (see :mod:`~lightning_hpp.checkpoint.entries` for
what may be in it and how it is stored); ranks that hold the same key must hold the same value, and
torch.distributed.checkpoint writes it once. DTensors are written as their local shards. The commit
protocol runs inside torch.distributed.checkpoint's own steps
(:class:`~lightning_hpp.checkpoint.writer.CommitWriter`).

Retries: every file is read and written through
:func:`~lightning_hpp.checkpoint.storage.filesystem`, so on ``s3://`` botocore retries each request;
elsewhere each step of a save (the target directory, this rank's files, the index, the commit) is
retried on its own by the rank that does it, and a load that fails transiently is re-run whole by
:meth:`~lightning_hpp.checkpoint.retry.RetryPolicy.call` (see the retry module's docstring).
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lightning_hpp._dist import all_gather_object, initialized
from lightning_hpp.checkpoint.collective import agree, async_group, group_size
from lightning_hpp.checkpoint.commit import CheckpointInfo
from lightning_hpp.checkpoint.dcp_index import quiet_single_process
from lightning_hpp.checkpoint.entries import JSON_LEAF, flatten_state
from lightning_hpp.checkpoint.retention import Retention
from lightning_hpp.checkpoint.retry import RetryPolicy
from lightning_hpp.checkpoint.warning import warn_checkpoint
from lightning_hpp.checkpoint.writer import CommitWriter, save_error
from lightning_hpp.errors import CheckpointError, CheckpointSaveError
from lightning_hpp.validation import check_choice, check_int, check_path


class PendingSave:
    """A save running in the background (``save_sharded(..., async_save=True)``).

    Attributes:
        url: Checkpoint being written.
        step: Its step.
    """

    def __init__(self, future: Future, writer: CommitWriter, on_error: str, world: int) -> None:
        self._future = future
        self._world = world
        self._writer = writer
        self.url = writer.url
        self.step = writer.step
        self._on_error = on_error
        self._warned = False
        self._info: CheckpointInfo | None = None
        self.reported = False  # result() has handed the outcome to the caller

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save to end, without raising what it failed with."""
        self._future.exception(timeout)

    def result(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save.

        Returns:
            The committed checkpoint, or ``None`` if it failed and ``on_error="warn"``.

        Raises:
            CheckpointSaveError: the save failed and ``on_error="raise"``.
        """
        try:
            self._future.result(timeout)
            if self._info is None:
                self._info = self._writer.info()
        except (CheckpointException, CheckpointSaveError) as exc:
            self.reported = True
            error = save_error(exc, self.url, self.step, self._world) if isinstance(exc, CheckpointException) else exc
            if self._on_error == "raise":
                raise error from None
            if not self._warned:
                self._warned = True
                warn_checkpoint(str(error))
            return None
        self.reported = True
        return self._info


_PENDING: PendingSave | None = None
_PENDING_LOCK = threading.Lock()


def wait_for_pending_save(timeout: float | None = None) -> CheckpointInfo | None:
    """Block until the save in flight (if any) finishes; see :meth:`PendingSave.result`.

    A failure that :meth:`PendingSave.result` already reported to its caller is not raised again.
    """
    global _PENDING
    with _PENDING_LOCK:
        pending, _PENDING = _PENDING, None
    if pending is None:
        return None
    if pending.reported:
        pending.wait(timeout)  # without raising twice
        return None
    return pending.result(timeout)


def _stager() -> DefaultStager:
    # the staging step of an asynchronous save: a private CPU copy of every tensor (DTensors: of
    # their local shards), taken before `async_save` returns, so that training may change the
    # originals while the copy is written; pinned where it is copied from a GPU
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def save_sharded(
    state: dict[str, Any],
    url: str,
    *,
    step: int,
    extra_metadata: dict[str, Any] | None = None,
    process_group: Any = None,
    async_save: bool = False,
    retry: RetryPolicy | None = None,
    on_error: Literal["raise", "warn"] = "raise",
    retention: Retention | None = None,
    protect: Iterable[str] = (),
) -> CheckpointInfo | PendingSave | None:
    """Save this rank's part of the training state as one checkpoint; collective over the group.

    Every rank of ``process_group`` calls it with the same ``url`` and ``step``. The checkpoint
    counts only once ``metadata.json`` is written, after every shard is complete. DTensors (the
    parameters and optimizer state of FSDP2 or tensor-parallel stages) are written as their local
    shards: no rank gathers a whole tensor.

    Args:
        state: This rank's state: a dict with str keys nesting dicts/lists/tuples of tensors
            and JSON values (see the module docstring). Keys present on several ranks must hold
            equal values (or be DTensors: each rank's shards).
        url: Checkpoint directory, normally ``checkpoint_url(root, step)``.
        step: Steps completed (stored in ``metadata.json``).
        extra_metadata: ``plan``, ``fingerprint``, ``metrics`` and any other JSON facts for
            ``metadata.json`` (only rank 0's copy is used; secrets are redacted).
        process_group: Group of ranks writing this checkpoint; default: the whole world.
        async_save: Stage the tensors (a CPU copy), return at once and write them with
            :func:`torch.distributed.checkpoint.async_save` in a background thread. At most one
            save is in flight: a new save first waits for the previous one.
        retry: Retries of transient storage errors (per request on S3, of each step of the save
            elsewhere); default ``RetryPolicy()``.
        on_error: ``"raise"``: a save that fails after its retries raises
            :class:`CheckpointSaveError`; ``"warn"``: it emits a :class:`CheckpointWarning` and
            returns ``None`` (training goes on).
        retention: Applied by rank 0 to ``url``'s parent after the commit.
        protect: Checkpoint URLs retention must never delete (the one the run resumed from).

    Returns:
        The :class:`CheckpointInfo` (every rank); a :class:`PendingSave` when ``async_save``;
        ``None`` if the save failed with ``on_error="warn"``.

    Raises:
        CheckpointError: a value that cannot be saved without pickle, or ranks holding different
            values under one key.
        CheckpointSaveError: storage failed after the retries (``on_error="raise"``).
    """
    global _PENDING
    check_choice(on_error, "save_sharded(on_error=...)", ("raise", "warn"), error=CheckpointError)
    url = check_path(url, "save_sharded(url=...)", error=CheckpointError, kind="a path or fsspec URL",
                     hint="For example 's3://bucket/run/step-10'.")
    check_int(step, "save_sharded(step=...)", minimum=0, error=CheckpointError,
              hint="Pass the number of optimizer steps completed.")
    group = process_group

    wait_for_pending_save()  # at most one save in flight, also against a synchronous save

    error: BaseException | None = None
    tensors: dict[str, torch.Tensor] = {}
    docs: dict[str, bytes] = {}
    try:
        tensors, docs = flatten_state(state)
    except CheckpointError as exc:
        error = exc
    agree(error, group, "to prepare its state for saving")
    _check_replicas(tensors, docs, group)

    flat = dict(tensors)
    for fqn, data in docs.items():
        flat[fqn] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    writer = CommitWriter(url, step, copy.deepcopy(dict(extra_metadata or {})), retry or RetryPolicy(), retention,
                     tuple(str(p) for p in protect))
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    quiet_single_process()
    if async_save:
        stager = _stager()
        future = dcp.async_save(flat, storage_writer=writer, planner=planner, process_group=async_group(group),
                                async_stager=stager, no_dist=not initialized())
        future.add_done_callback(lambda _: stager.close())
        pending = PendingSave(future, writer, on_error, group_size(group))
        with _PENDING_LOCK:
            _PENDING = pending
        return pending
    try:
        dcp.save(flat, storage_writer=writer, planner=planner, process_group=group, no_dist=not initialized())
        return writer.info()
    except CheckpointException as exc:
        failure = save_error(exc, url, step, group_size(group))
        if on_error == "raise":
            raise failure from None
        warn_checkpoint(str(failure))
        return None


def _check_replicas(tensors: dict[str, torch.Tensor], docs: dict[str, bytes], group: Any) -> None:
    """Refuse keys that several ranks hold with different shapes, dtypes or JSON values."""
    if group_size(group) == 1:
        return
    mine = {k: (tuple(t.shape), str(t.dtype)) for k, t in tensors.items()}
    mine.update({k: hashlib.sha1(d).hexdigest() for k, d in docs.items()})
    seen: dict[str, tuple[int, Any]] = {}
    for rank, sigs in enumerate(all_gather_object(mine, group)):
        for key, sig in sigs.items():
            if key in seen and seen[key][1] != sig:
                raise CheckpointError(
                    f"ranks {seen[key][0]} and {rank} both save {key!r} but with different "
                    f"{'values' if key.endswith(JSON_LEAF) else 'shapes or dtypes'} ({seen[key][1]} vs {sig}). "
                    f"Only replicas may share a key; key per-rank values by rank "
                    f"(for example state['rng'][f'rank{{rank}}'])."
                )
            seen.setdefault(key, (rank, sig))
