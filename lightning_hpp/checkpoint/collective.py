"""What the ranks of one save or load agree on: one error for all, and the group of background saves.

A save or a load is collective: a rank that fails while preparing must make every rank fail
(:func:`agree`), never leave its peers waiting in the next collective; a failure inside
torch.distributed.checkpoint comes back as one :class:`~lightning_hpp.checkpoint.retry.StorageFailure`
naming each rank's error (:func:`storage_failure`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_hpp._dist import all_gather_object, initialized, new_group
from lightning_hpp.checkpoint.retry import StorageFailure
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError
from lightning_hpp.redaction import redact


def group_size(group: Any) -> int:
    """The number of ranks in ``group``; 1 outside a process group."""
    return dist.get_world_size(group) if initialized() else 1


def agree(error: BaseException | None, group: Any, what: str, exc_type: type = CheckpointError) -> None:
    """Raise on every rank if any rank failed ``what`` (so no rank waits in a collective)."""
    report = None
    if error is not None:
        report = (f"{type(error).__name__}: {redact(str(error))}", isinstance(error, CorruptCheckpointError))
    reports = all_gather_object(report, group)
    if error is not None:
        raise error
    for rank, entry in enumerate(reports):
        if entry is not None:
            message, corrupt = entry
            # damage stays damage on every rank, so that callers can fall back to another checkpoint
            raise (CorruptCheckpointError if corrupt and exc_type is CheckpointError else exc_type)(
                f"rank {rank} failed {what}: {message}"
            )


_ASYNC_GROUPS: dict[tuple[int, ...], Any] = {}


def async_group(group: Any) -> Any:
    """A gloo group of the same ranks, for collectives of saves running in the background.

    Created on first use; ``dist.new_group`` is collective over the whole world, so every rank
    must make its first asynchronous save at the same point.
    """
    if not initialized():
        return None
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if ranks not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[ranks] = new_group(list(ranks), backend="gloo")  # with the job's timeout
    return _ASYNC_GROUPS[ranks]


def storage_failure(exc: CheckpointException) -> StorageFailure:
    """torch.distributed.checkpoint's failure as one :class:`StorageFailure`, each rank's error named."""
    errors = [pair[0] for pair in exc.failures.values()]
    lines = [f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in exc.failures.items()]
    return StorageFailure(redact("; ".join(lines)), errors)
