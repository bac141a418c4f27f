"""Timing work on a device: CUDA events on CUDA, the host clock elsewhere, chosen by the device's type.

CUDA kernels run asynchronously: a host clock read around a call that launches them measures the launch,
not the work, so a throttled GPU looks as fast as the others, and a send on NCCL returns once enqueued (a
link looks faster than it is). An event recorded on the device's current stream before and after measures
what the device did in between, in the order the work was queued, without a host synchronisation per call:
the events are read when the result is wanted (:meth:`DeviceClock.elapsed_ns`).

::

    clock = device_clock(device)            # HostClock on CPU, CudaEventClock on CUDA
    t0 = clock.mark(); run(); t1 = clock.mark()
    ns = clock.elapsed_ns([(t0, t1)])       # on CUDA: waits for t1, then the events' difference
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch


class DeviceClock(Protocol):
    """Marks points in a device's work and adds up the time between pairs of them."""

    kind: str

    def mark(self) -> Any:
        """A point in this device's work, now."""

    def elapsed_ns(self, spans: Sequence[tuple[Any, Any]]) -> int:
        """The total of ``(start, end)`` marks' durations, in nanoseconds."""


class HostClock:
    """``time.perf_counter_ns``: what a CPU device does runs while the host waits for it."""

    kind = "host"

    def mark(self) -> int:
        return time.perf_counter_ns()

    def elapsed_ns(self, spans: Sequence[tuple[Any, Any]]) -> int:
        return int(sum(b - a for a, b in spans))


class CudaEventClock:
    """CUDA events recorded on ``device``'s current stream (``enable_timing=True``)."""

    kind = "cuda-events"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ns(self, spans: Sequence[tuple[Any, Any]]) -> int:
        if not spans:
            return 0
        spans[-1][1].synchronize()
        return int(sum(a.elapsed_time(b) for a, b in spans) * 1e6)


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a CUDA device); nothing to wait for elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device | str) -> HostClock | CudaEventClock:
    """The clock that times work on ``device``: CUDA events on a CUDA device, else the host clock."""
    device = torch.device(device)
    return CudaEventClock(device) if device.type == "cuda" else HostClock()


def time_ms(fn: Callable[[], Any], device: torch.device | str, repeats: int) -> float:
    """Milliseconds per call of ``fn`` over ``repeats`` calls, on ``device``'s clock."""
    clock = device_clock(device)
    t0 = clock.mark()
    for _ in range(repeats):
        fn()
    return clock.elapsed_ns([(t0, clock.mark())]) / 1e6 / repeats
