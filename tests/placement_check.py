"""A check, for CPU runs, that every tensor handed to a collective lives on its group's device.

On a GPU job NCCL groups take CUDA tensors only; a tensor made on the host (a factory called
without ``device=``, a Python number turned into a tensor, a ``.cpu()`` copy) and handed to a
collective fails there, and nowhere on a CPU machine, where every device is the host. So this
check tracks the host as a place of its own:

* tensors made by a factory without a ``device`` argument, and ``.cpu()`` copies, are *host-born*;
  what is computed from a host-born tensor is host-born too;
* ``.to(device)`` / ``.cuda()`` places a tensor (a host-born one becomes placed), as do factories
  given a device, ``*_like`` factories of a placed tensor, and whatever autograd produces;
* :func:`lightning_hpp._dist.group_device` is patched to hand out fresh device objects, and an
  object collective (``broadcast_object_list`` and friends) given a ``device`` must be given one
  of those (or none: torch then picks the group's device itself).

Every tensor collective (and point-to-point op) raises :class:`DevicePlacementError` when a tensor
handed to it is host-born, and an object collective when its ``device`` did not come from
``group_device``. Explicit ``.to("cpu")`` moves are not tracked (on a GPU job they may be meant).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.tensor,
    torch.as_tensor,
    torch.arange,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.eye,
    torch.scalar_tensor,
    torch.randperm,
}
_TENSOR_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "all_to_all_single",
)
_OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


class DevicePlacementError(RuntimeError):
    """A collective got a tensor that, on a GPU job, would sit on the wrong device."""


class _HostTracker(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self._host: dict[int, weakref.ref] = {}  # by id: tensors compare elementwise, so no WeakSet

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, t: torch.Tensor, host: bool) -> None:
        if host:
            self._host[id(t)] = weakref.ref(t)
        else:
            self._host.pop(id(t), None)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            born_on_host = kwargs.get("device") is None
        elif func is torch.Tensor.cpu:
            born_on_host = True
        elif func in (torch.Tensor.to, torch.Tensor.cuda):
            born_on_host = not (func is torch.Tensor.cuda or _device_in(args[1:], kwargs)) and self._any_host(args)
        else:
            born_on_host = self._any_host((args, kwargs))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (born_on_host or func in (torch.Tensor.to, torch.Tensor.cuda)):
                self._mark(t, born_on_host)
        return out

    def _any_host(self, tree: Any) -> bool:
        return any(isinstance(t, torch.Tensor) and self.is_host(t) for t in tree_flatten(tree)[0])


def _device_in(args: tuple, kwargs: dict) -> bool:
    if "device" in kwargs:
        return kwargs["device"] is not None
    return any(isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) for a in args)


@contextlib.contextmanager
def device_placement_check() -> Iterator[dict[str, int]]:
    """Check every collective while the block runs; yields counters ``{"tensors": n, "objects": n}``."""
    from lightning_hpp import _dist

    tracker = _HostTracker()
    handed_out: list[torch.device] = []
    counts = {"tensors": 0, "objects": 0}
    real_group_device = _dist.group_device

    def group_device(group: Any = None) -> torch.device:
        device = torch.device(str(real_group_device(group)))  # a fresh object: its identity marks where it came from
        handed_out.append(device)
        del handed_out[:-64]
        return device

    def check_tensors(name: str, real: Any) -> Any:
        @functools.wraps(real)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    counts["tensors"] += 1
                    if tracker.is_host(t):
                        raise DevicePlacementError(
                            f"`torch.distributed.{name}` got a tensor made on the host (shape {tuple(t.shape)}, "
                            f"{t.dtype}) without being moved to `group_device(group)`: on GPUs the group is NCCL."
                        )
            return real(*args, **kwargs)

        return wrapper

    def check_device_arg(name: str, real: Any) -> Any:
        @functools.wraps(real)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts["objects"] += 1
            device = kwargs.get("device")
            if device is not None and not any(device is d for d in handed_out):
                raise DevicePlacementError(
                    f"`torch.distributed.{name}(device={device!r})`: the device of an object "
                    f"collective must come from `group_device(group)` (or be left to torch)."
                )
            return real(*args, **kwargs)

        return wrapper

    class CheckedP2POp(dist.distributed_c10d.P2POp):  # torch pipelining's sends and receives
        def __init__(self, op: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            counts["tensors"] += 1
            if tracker.is_host(tensor):
                raise DevicePlacementError(f"`P2POp` got a host-made tensor {tuple(tensor.shape)}, {tensor.dtype}.")
            super().__init__(op, tensor, *args, **kwargs)

    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    c10d = dist.distributed_c10d
    for name in _TENSOR_COLLECTIVES:
        wrapped = check_tensors(name, getattr(c10d, name))
        patch(dist, name, wrapped)
    for name in _OBJECT_COLLECTIVES:
        patch(dist, name, check_device_arg(name, getattr(c10d, name)))
    patch(dist, "P2POp", CheckedP2POp)
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("lightning_hpp") and m is not None]:
        if getattr(mod, "group_device", None) is real_group_device:
            patch(mod, "group_device", group_device)
    tracker.__enter__()
    try:
        yield counts
    finally:
        tracker.__exit__(None, None, None)
        for owner, name, value in reversed(patched):
            setattr(owner, name, value)
