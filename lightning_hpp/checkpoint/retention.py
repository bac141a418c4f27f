"""Which checkpoints to keep: the last k and the best k by a metric, never a damaged one deleted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from lightning_hpp.checkpoint.checksums import verify
from lightning_hpp.checkpoint.commit import CheckpointInfo, delete_checkpoint, read_metadata
from lightning_hpp.checkpoint.discovery import latest_valid, list_checkpoints, quarantine, step_dirs
from lightning_hpp.checkpoint.storage import same_location
from lightning_hpp.checkpoint.warning import warn_checkpoint
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from lightning_hpp.validation import check_choice, check_int


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
            if c.url in keep or any(same_location(c.url, g) for g in guarded):
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
                if step >= newest.step or url in names or any(same_location(url, p) for p in protect):
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
        warn_checkpoint(f"Retention kept a damaged checkpoint: {reason} Moved it to {moved!r} instead of deleting it.")
