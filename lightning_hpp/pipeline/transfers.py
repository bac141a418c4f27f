"""The one place that observes torch's pipeline transfers.

Every schedule of ``torch.distributed.pipelining`` posts its sends and receives through
``schedules._batch_p2p`` and waits on them through ``schedules._wait_batch_p2p``. Telemetry (the
per-transfer spans) and the straggler watch (which peer a rank waits on) both need to see them. Each
used to replace the two functions itself; the replacements stacked, so what each saw depended on the
order they were installed and removed, and removing them out of order chained one back into the other.

Here the two functions are replaced once, while at least one :class:`TransferListener` is registered,
and restored when the last one is removed; listeners are added and removed independently, in any order.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed.pipelining.schedules as _schedules

__all__ = ["TransferListener", "add_listener", "remove_listener", "listeners"]


class TransferListener:
    """What a listener is told of each transfer; every method is optional (the defaults do nothing).

    ``posted`` runs after a batch of point-to-point ops was posted, with its ops, the works torch returned
    (one per op, or one for a coalesced batch) and the monotonic nanoseconds around the post. ``waiting``
    runs before one work is waited on and returns a token; ``waited`` runs after, with that token and the
    error the wait raised (``None`` when it completed); the error is raised again after every listener saw it.
    """

    def posted(self, ops: list, works: list, t0_ns: int, t1_ns: int) -> None:
        return None

    def waiting(self, work: Any) -> Any:
        return None

    def waited(self, work: Any, token: Any, error: BaseException | None) -> None:
        return None


_LISTENERS: list[TransferListener] = []
_TORCH: dict[str, Any] = {}


def _batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
    t0 = time.perf_counter_ns()
    works = _TORCH["_batch_p2p"](p2p_ops, desc)
    t1 = time.perf_counter_ns()
    for listener in tuple(_LISTENERS):
        listener.posted(p2p_ops, works, t0, t1)
    return works


def _wait_batch_p2p(work: list) -> None:
    active = tuple(_LISTENERS)
    for w in work:
        tokens = [listener.waiting(w) for listener in active]
        try:
            _TORCH["_wait_batch_p2p"]([w])
        except BaseException as error:
            for listener, token in zip(active, tokens):
                listener.waited(w, token, error)
            raise
        for listener, token in zip(active, tokens):
            listener.waited(w, token, None)


def add_listener(listener: TransferListener) -> None:
    """Register ``listener`` (once); the first one replaces torch's two functions."""
    if any(existing is listener for existing in _LISTENERS):
        return
    if not _TORCH:
        _TORCH["_batch_p2p"], _TORCH["_wait_batch_p2p"] = _schedules._batch_p2p, _schedules._wait_batch_p2p
        _schedules._batch_p2p, _schedules._wait_batch_p2p = _batch_p2p, _wait_batch_p2p
    _LISTENERS.append(listener)


def remove_listener(listener: TransferListener) -> None:
    """Unregister ``listener`` (a listener not registered is ignored); the last one restores torch's functions."""
    _LISTENERS[:] = [existing for existing in _LISTENERS if existing is not listener]
    if not _LISTENERS and _TORCH:
        _schedules._batch_p2p, _schedules._wait_batch_p2p = _TORCH.pop("_batch_p2p"), _TORCH.pop("_wait_batch_p2p")


def listeners() -> tuple[TransferListener, ...]:
    """The listeners registered now, in the order they were added."""
    return tuple(_LISTENERS)
