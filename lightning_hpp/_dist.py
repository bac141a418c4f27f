"""The few ``torch.distributed`` helpers every layer shares.

One object gather and one object broadcast (``[obj]`` / ``obj`` outside a process group), and
the device a group's collectives need: NCCL groups take CUDA tensors only, gloo groups take CPU
tensors, so a tensor handed to a collective is first moved to :func:`group_device`.

**Every group takes the job's timeout.** torch gives a group made without a ``timeout`` its backend's
default (30 minutes on gloo, 10 on NCCL), whatever the default group was given, so a rank that stops
answering holds its peers that long. :func:`set_timeout` records ``HPPStrategy(timeout=...)`` when the
default group is made, and every group this package makes passes it: :func:`new_group`, and a
``DeviceMesh``'s groups through :func:`mesh_backend_override`. :func:`group_timeout` reads a group's back.

**The first error aborts the groups** (:func:`abort_groups`): on NCCL torch's abort of every communicator, so
that peers blocked in NCCL kernels return instead of waiting for the watchdog; gloo operations cannot be
aborted from another thread (tried: an ``abort()`` leaves a blocked ``all_reduce`` waiting), they end at the
timeout or when the peer's process ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_TIMEOUT: timedelta | None = None  # HPPStrategy(timeout=...), once the default group exists


def set_timeout(timeout: timedelta | None) -> None:
    """Record the job's timeout, which every group made by :func:`new_group` and :func:`mesh_backend_override` takes."""
    global _TIMEOUT
    _TIMEOUT = timeout


def job_timeout() -> timedelta | None:
    """The job's timeout (``HPPStrategy(timeout=...)``), ``None`` before the default group exists."""
    return _TIMEOUT


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    """``torch.distributed.new_group`` with the job's timeout (collective, as torch's)."""
    if _TIMEOUT is not None:
        kwargs.setdefault("timeout", _TIMEOUT)
    return dist.new_group(ranks, **kwargs)


def mesh_backend_override(ndim: int) -> tuple[tuple[str | None, Any], ...] | None:
    """``DeviceMesh(backend_override=...)`` giving each of ``ndim`` dimensions' groups the job's timeout (the
    default group's backend); ``None`` without a timeout (torch's defaults)."""
    if _TIMEOUT is None or not initialized():
        return None
    if dist.get_backend() == dist.Backend.NCCL:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = _TIMEOUT
    return ((None, options),) * ndim


def group_timeout(group: Any) -> timedelta | None:
    """The timeout ``group``'s operations take (its backend's options), ``None`` where torch does not say."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            backend = group._get_backend(device)
        except RuntimeError:
            continue
        options = getattr(backend, "options", None)
        if options is not None:
            return options._timeout
    return None


def process_groups() -> Iterator[Any]:
    """Every process group of this process that is alive (the default group included)."""
    if initialized():
        yield from list(dist.distributed_c10d._world.pg_map)


def abort_groups() -> str:
    """Abort this process's groups after the job's first error; returns what was done (for the log).

    NCCL: torch's abort of every group (``ncclCommAbort``), so an operation blocked in a NCCL kernel returns
    with an error. gloo: nothing (its blocked operations cannot be aborted; they end at the timeout).
    """
    if not initialized():
        return "no process group"
    backend = str(dist.get_backend())
    if backend != dist.Backend.NCCL:
        return f"{backend}: not aborted (its operations end at the timeout or when the peer's process ends)"
    dist.distributed_c10d._abort_process_group()
    return "nccl: every communicator aborted"


def initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's global rank; 0 outside a process group."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """The number of ranks; 1 outside a process group."""
    return dist.get_world_size() if initialized() else 1


def group_device(group: Any = None) -> torch.device:
    """Where tensors for ``group``'s collectives must live (the current CUDA device for NCCL)."""
    if initialized() and dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` in group-rank order (collective over ``group``)."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (collective)."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=group, device=group_device(group))
    return box[0]


BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""The size of one start-up broadcast bucket (what DDP uses for its own start-up broadcast)."""


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, group: Any = None) -> None:
    """Overwrite ``tensors`` in place with global rank ``src``'s (collective; every rank passes tensors
    of the same shapes and dtypes in the same order), bucketed as DDP's start-up broadcast is."""
    if not initialized() or not tensors or dist.get_world_size(group) == 1:
        return
    broadcast_in_buckets(tensors, src, group)


def broadcast_in_buckets(tensors: list[torch.Tensor], src: int = 0, group: Any = None,
                         bucket_bytes: int | None = None) -> None:
    """:func:`broadcast_tensors` without its one-rank shortcut, one bucket at a time: consecutive tensors of one
    dtype, at most ``bucket_bytes`` (default :data:`BROADCAST_BUCKET_BYTES`; a larger tensor alone), flattened into
    one buffer on the group's device (:func:`stage`), broadcast, and copied back. A model that fits in host memory
    but not on one device so crosses an NCCL group's device a bucket at a time: one bucket is all it holds there
    (torch's ``_broadcast_coalesced`` would flatten a second copy of the staged tensors)."""
    device = group_device(group)
    limit = BROADCAST_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    for bucket in _buckets(tensors, limit):
        flat = stage(bucket, device)
        work = dist.broadcast(flat, src, group=group, async_op=True)
        work.wait()
        del work  # the work holds the bucket too: release it before the next bucket is staged
        with torch.no_grad():
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        del flat


def stage(bucket: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One buffer on ``device`` holding ``bucket``'s tensors (one dtype), flattened one after the other: what a
    broadcast bucket holds on a group's device."""
    flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=device)
    offset = 0
    with torch.no_grad():
        for t in bucket:
            flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
    return flat


def _buckets(tensors: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, at most ``limit`` bytes each group (a larger tensor alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > limit or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket
