"""Lightning's prediction writers, once per replica.

A ``BasePredictionWriter`` writes what the predict loop hands it, per batch or per epoch, usually into a file
named by the global rank: under DDP each process writes its share of the predictions once. Under a pipeline
every rank of a replica holds that replica's predictions; :func:`write_once_per_replica` lets the writers write
on the ranks of the pipeline's first position only (global ranks ``0 .. dp - 1``), so that every prediction is
written once and the files are those DDP with one process per replica writes. The writers' other hooks run on
every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_WRITES = ("write_on_batch_end", "write_on_epoch_end")


def write_once_per_replica(callbacks: Sequence[Any], writes: bool) -> None:
    """Make the prediction writers among ``callbacks`` write (``writes``: this rank is at the first position) or
    skip their writes (any other rank)."""
    from lightning.pytorch.callbacks import BasePredictionWriter

    for cb in callbacks:
        if not isinstance(cb, BasePredictionWriter):
            continue
        for name in _WRITES:
            if writes:
                cb.__dict__.pop(name, None)
            else:
                cb.__dict__[name] = _skip


def _skip(*args: Any, **kwargs: Any) -> None:
    return None
