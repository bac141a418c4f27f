"""The few ``torch.distributed`` helpers every layer shares.

One object gather and one object broadcast (``[obj]`` / ``obj`` outside a process group), and
the device a group's collectives need: NCCL groups take CUDA tensors only, gloo groups take CPU
tensors, so a tensor handed to a collective is first moved to :func:`group_device`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


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


_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # what DDP uses for its start-up broadcast


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, group: Any = None) -> None:
    """Overwrite ``tensors`` in place with global rank ``src``'s (collective; every rank passes tensors
    of the same shapes and dtypes in the same order), bucketed as DDP's start-up broadcast is."""
    if not initialized() or not tensors or dist.get_world_size(group) == 1:
        return
    device = group_device(group)
    moved = [t.detach() if t.device == device else t.detach().to(device) for t in tensors]  # detached: same storage
    dist._broadcast_coalesced(group or dist.group.WORLD, moved, _BROADCAST_BUCKET_BYTES, src)
    with torch.no_grad():
        for t, m in zip(tensors, moved):
            if m.data_ptr() != t.data_ptr():
                t.copy_(m)
