"""Where a run resumes from, and how it picks up in the middle of an epoch.

* :func:`resolve_ckpt_path`: ``resume="auto"``, ``resume=<path>`` and ``ckpt_path="last"``
  resolved through fsspec, so an ``s3://`` directory resumes like a local one (Lightning's own
  ``"last"`` lookup normalises URLs as local paths and cannot see S3);
* :func:`committed_checkpoint`: the committed checkpoint a ``ckpt_path`` names (itself, or the
  newest valid one inside the directory it names);
* :func:`consumed_batches` / :func:`skip_consumed_batches`: a checkpoint written mid-epoch knows
  how many batches of that epoch were trained on; the resumed run's train loaders skip them, so it
  ends bitwise equal to an uninterrupted run;
* :func:`step_checkpoint_callback`: the ``ModelCheckpoint`` that writes the strategy's own
  ``step-<N>`` checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_hpp.checkpoint.store import filesystem, newest_valid_anywhere, verify
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError


def resolve_ckpt_path(
    ckpt_path: Any, *, resume: str | None, checkpoint_dir: str | None, callback_dirs: Sequence[str] = ()
) -> Any:
    """The checkpoint a fit starts from.

    Args:
        ckpt_path: What the user passed to ``Trainer.fit`` (``None``, a path or ``"last"``).
        resume: ``CheckpointOptions.resume``: ``None``, ``"auto"`` or a path.
        checkpoint_dir: ``CheckpointOptions.dir``.
        callback_dirs: The ``dirpath`` of every ``ModelCheckpoint`` (searched for ``"last"``).

    Returns:
        A URL, ``None`` (start from scratch), or ``ckpt_path`` unchanged.
    """
    if ckpt_path is None and resume == "auto":
        found = newest_valid_anywhere([checkpoint_dir])
        if found is None:
            rank_zero_info(f"HPPStrategy: no valid checkpoint in {checkpoint_dir!r}; starting from scratch.")
            return None
        rank_zero_info(f"HPPStrategy: resuming from {found.url!r} (step {found.step}).")
        return found.url
    if ckpt_path is None and resume is not None:
        return resume
    if ckpt_path == "last":
        roots = [d for d in callback_dirs if d] + ([checkpoint_dir] if checkpoint_dir else [])
        found = newest_valid_anywhere(roots, prefer="last")
        if found is None:
            rank_zero_info(f"HPPStrategy: ckpt_path='last' but no valid checkpoint in {roots}; starting from scratch.")
            return None
        return found.url
    return ckpt_path


def committed_checkpoint(url: str) -> str:
    """``url`` if it is a committed checkpoint, else the newest valid one inside it.

    Raises:
        CheckpointError: neither.
    """
    try:
        verify(url, checksums=False)
        return url
    except CorruptCheckpointError:
        found = newest_valid_anywhere([url])
    if found is None:
        raise CheckpointError(
            f"{url!r} is neither a committed checkpoint (a directory with metadata.json) nor a directory "
            f"holding one. Pass a checkpoint written by HPPStrategy, its parent directory, or 'last'."
        )
    return found.url


def consumed_batches(checkpoint: dict[str, Any]) -> int:
    """Batches of the current epoch already trained on when ``checkpoint`` was written.

    A checkpoint saved in ``on_train_batch_end`` has processed the batch before Lightning counts it
    completed, so ``processed`` is the count.
    """
    progress = (checkpoint.get("loops") or {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})
    return int((progress.get("current") or {}).get("processed", 0) or 0)


class SkipFirst:
    """A sampler that skips its first ``n`` indices once (a mid-epoch resume), then is itself."""

    def __init__(self, sampler: Any, n: int) -> None:
        self.sampler = sampler
        self.n = n

    def __iter__(self):
        it = iter(self.sampler)
        n, self.n = self.n, 0
        for _ in range(n):
            next(it, None)
        return it

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


def skip_consumed_batches(loaders: Sequence[Any], done: int) -> None:
    """Make each train loader skip the ``done`` batches its epoch already used (in place)."""
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        if batch_sampler is not None and hasattr(batch_sampler, "sampler") and batch_sampler.batch_size:
            batch_sampler.sampler = SkipFirst(batch_sampler.sampler, done * batch_sampler.batch_size)


def step_checkpoint_callback(checkpoint_dir: str, every_n_steps: int | None) -> ModelCheckpoint:
    """The callback that saves ``step-<N>`` checkpoints into ``checkpoint_dir`` (every epoch when
    ``every_n_steps`` is ``None``), keeping all of them (retention is the strategy's ``keep_last``)."""
    cb = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="step-{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=every_n_steps,
        save_top_k=-1,
        save_on_train_epoch_end=every_n_steps is None,
    )
    cb.FILE_EXTENSION = ""
    return cb


def same_location(a: str, b: str) -> bool:
    """Whether two checkpoint URLs or paths name the same place (local paths resolved, links followed,
    as ``ModelCheckpoint`` resolves its ``dirpath``)."""
    from fsspec.implementations.local import LocalFileSystem

    (fa, pa), (fb, pb) = filesystem(a), filesystem(b)
    if type(fa) is not type(fb):
        return False
    if isinstance(fa, LocalFileSystem):
        return os.path.realpath(pa) == os.path.realpath(pb)
    return pa.rstrip("/") == pb.rstrip("/")
