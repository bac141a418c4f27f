"""Which sample indices the data-parallel ranks drew, and how much they overlap: :class:`BiasMonitor`'s epoch metrics.

:class:`IndexRecorder` records the indices a train dataloader's sampler hands out (a recording subclass of the
sampler's class for the duration of ``fit``); :func:`epoch_metrics` reduces them over the data-parallel group
(three reductions and one gather of fixed-size tensors) into ``bias/overlap_jaccard``, ``bias/overlap_expected``,
``bias/coverage`` and ``bias/sequence_agreement``; :func:`index_overlap_metrics` computes the same from index lists
already in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_hpp._dist import group_device, initialized


def epoch_metrics(recorder: IndexRecorder, group: Any, positions: int) -> dict[str, float] | None:
    """The epoch metrics over the dp group: three reductions and one gather of fixed-size tensors."""
    idx = torch.tensor(recorder.indices if recorder.valid else [], dtype=torch.int64)
    device = group_device(group)
    size = recorder.dataset_len if recorder.dataset_len is not None else (int(idx.max()) + 1 if len(idx) else 0)
    head = torch.tensor([size], dtype=torch.int64, device=device)
    if initialized():
        dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
    n = int(head[0])
    if n == 0:
        return None
    draws = torch.bincount(idx.clamp(0, n - 1), minlength=n).to(device)
    member = (draws > 0).to(torch.int64)
    repeats = torch.tensor([int(draws.max()) if len(idx) else 0], device=device)
    tail = torch.full((positions,), -1, dtype=torch.int64, device=device)
    k = min(positions, len(idx))
    tail[:k] = idx[:k].to(device)
    rows = [tail]
    if initialized():
        dist.all_reduce(member, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(draws, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(repeats, op=dist.ReduceOp.MAX, group=group)
        rows = [torch.empty_like(tail) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, tail, group=group)
    return _metrics_from(member.cpu(), draws.cpu(), int(repeats) > 1, torch.stack(rows).cpu(), n)


def index_overlap_metrics(
    per_rank: Sequence[Sequence[int]], dataset_len: int, positions: int = 1024
) -> dict[str, float]:
    """The epoch metrics for index lists already in one place (no communication).

    Args:
        per_rank: The indices each data-parallel rank drew, in order.
        dataset_len: Size of the dataset (the denominator of the coverage).
        positions: Positions compared for the sequence agreement.

    Returns:
        ``bias/overlap_jaccard``, ``bias/overlap_expected``, ``bias/coverage`` and (with two or
        more ranks) ``bias/sequence_agreement``, as :class:`BiasMonitor` logs them.
    """
    member = torch.zeros(dataset_len, dtype=torch.int64)
    draws = torch.zeros(dataset_len, dtype=torch.int64)
    rows = torch.full((len(per_rank), positions), -1, dtype=torch.int64)
    repeats = False
    for r, indices in enumerate(per_rank):
        idx = torch.as_tensor(list(indices), dtype=torch.int64)
        mine = torch.bincount(idx, minlength=dataset_len)
        repeats = repeats or bool((mine > 1).any())
        draws += mine
        member += (mine > 0).to(torch.int64)
        k = min(positions, len(idx))
        rows[r, :k] = idx[:k]
    return _metrics_from(member, draws, repeats, rows, dataset_len)


def _metrics_from(
    member: torch.Tensor, draws: torch.Tensor, repeats: bool, rows: torch.Tensor, n: int
) -> dict[str, float]:
    """Metrics from how many ranks drew each index, how often it was drawn, and each rank's head."""
    replicas = rows.shape[0]
    total = int(member.sum())
    inter = int((member * (member - 1) // 2).sum())
    denom = (replicas - 1) * total - inter
    out = {
        "bias/overlap_jaccard": inter / denom if denom > 0 else 0.0,
        "bias/overlap_expected": _expected_overlap(draws, replicas) if repeats else 0.0,
        "bias/coverage": int((member > 0).sum()) / n,
    }
    agreement = _agreement(rows, n)
    if agreement is not None:
        out["bias/sequence_agreement"] = agreement
    return out


def _expected_overlap(draws: torch.Tensor, replicas: int) -> float:
    """Pooled Jaccard of ranks drawing independently (with replacement) from the observed frequencies."""
    m = float(draws.sum())
    if replicas < 2 or m == 0:
        return 0.0
    p = draws.double() / m
    q = 1.0 - (1.0 - p) ** (m / replicas)  # P(a rank drawing m/R times draws index i at least once)
    sq, s1 = float((q * q).sum()), float(q.sum())
    return sq / (2 * s1 - sq) if 2 * s1 - sq > 0 else 0.0


def _agreement(rows: torch.Tensor, n: int) -> float | None:
    """Fraction of rank pairs that drew the same index at the same position."""
    valid = rows >= 0
    per_pos = valid.sum(0)
    pairs = int((per_pos * (per_pos - 1) // 2).sum())
    if pairs == 0:
        return None
    pos = torch.arange(rows.shape[1]).expand_as(rows)
    keys = (pos * (n + 1) + rows)[valid]
    _, counts = torch.unique(keys, return_counts=True)
    return int((counts * (counts - 1) // 2).sum()) / pairs


# ---------------------------------------------------------------------- index recording
def first_dataloader(obj: Any) -> DataLoader | None:
    if isinstance(obj, DataLoader):
        return obj
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, Sequence) and not isinstance(obj, str):
        for item in obj:
            found = first_dataloader(item)
            if found is not None:
                return found
    return None


class IndexRecorder:
    """Records the indices a dataloader's sampler hands out, by giving it a recording subclass."""

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.valid = True
        self.dataset_len: int | None = None
        self._sampler: Any = None
        self._original_cls: type | None = None

    def attach(self, loader: DataLoader | None) -> None:
        if loader is None:
            return
        batch_sampler = getattr(loader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else loader.sampler
        if sampler is None or sampler is self._sampler:
            return
        self.detach()
        dataset = getattr(loader, "dataset", None)
        try:
            self.dataset_len = len(dataset)
        except TypeError:
            self.dataset_len = None
        cls = type(sampler)
        recorder = self

        def __iter__(obj):  # noqa: N807, ANN001, ANN202
            for index in cls.__iter__(obj):
                recorder.add(index)
                yield index

        recording = type(
            cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
        try:
            sampler.__class__ = recording
        except TypeError:
            self.valid = False  # a class whose layout forbids it: no epoch metrics
            return
        self._sampler, self._original_cls = sampler, cls

    def add(self, index: Any) -> None:
        try:
            self.indices.append(int(index))
        except (TypeError, ValueError):
            self.valid = False

    def clear(self) -> None:
        self.indices = []

    def detach(self) -> None:
        if self._sampler is not None and self._original_cls is not None:
            self._sampler.__class__ = self._original_cls
        self._sampler = self._original_cls = None
