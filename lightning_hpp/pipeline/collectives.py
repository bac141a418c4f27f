"""Lightning's collectives as DDP means them, on a pipeline's rank grid.

Under DDP every process is one replica: ``strategy.reduce`` and ``all_gather`` (a hook's
``self.log(..., sync_dist=True)``, ``self.all_gather(...)``) span the replicas. Under a pipeline every rank of
one replica holds that replica's value (the steps are replayed where they change state, the hooks run on every
rank), so the same calls span the data-parallel group of this rank's position: over the world each value would
count once per pipeline rank. A decision (``reduce_boolean_decision``: stop, save, skip) is taken by the whole
job, as every rank acts on it. :class:`OutputBroadcast` hands the last stage's outputs to the pipeline's other ranks
(a step replayed there).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available

from lightning_hpp._dist import group_device, initialized
from lightning_hpp.pipeline.mesh import Mesh


def reduce_over_replicas(tensor: torch.Tensor, mesh: Mesh | None, group: Any, reduce_op: Any) -> torch.Tensor:
    """``tensor`` reduced over ``group``, or, where that is ``None``, over the replicas of this rank's stages."""
    if group is None and mesh is not None:
        if mesh.dp == 1:
            return tensor
        group = mesh.dp_group
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def gather_over_replicas(tensor: torch.Tensor, mesh: Mesh | None, group: Any, sync_grads: bool) -> torch.Tensor:
    """``tensor`` gathered over ``group``, or, where that is ``None`` or the world (what ``LightningModule.all_gather``
    passes when given none), over the replicas (one entry per replica; none added with one replica, as in one
    process)."""
    if (group is None or group is dist.group.WORLD) and mesh is not None:
        if mesh.dp == 1:
            return tensor
        group = mesh.dp_group
    return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)


def decide_together(decision: bool, every: bool, device: torch.device, world_size: int) -> bool:
    """One decision for the job: ``all`` (``every``) or ``any`` of the ranks' decisions."""
    flag = torch.tensor(int(decision), device=device)
    if initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return bool(flag == world_size) if every else bool(flag)


class OutputBroadcast:
    """The last stage's pipeline outputs of a step, on every rank of the pipeline (a replayed step's input).

    The tensors travel as tensors, one collective per dtype (their data flattened together), on the group's device;
    their structure — the pytree spec, each tensor's shape and dtype, the leaves that are not tensors — travels as
    an object only when it differs from the last step's, which a one-element flag broadcast first says.

    Args:
        group: The pipeline group.
        src: The last stage's rank in ``group``.
        device: This rank's device (where the received tensors go).
    """

    def __init__(self, group: Any, src: int, device: torch.device) -> None:
        self.group, self.src, self.device = group, src, device
        self._header: Any = None

    def __call__(self, outputs: Any) -> Any:
        """``outputs`` on the source rank (``None`` elsewhere) → the same structure on every rank, on its device."""
        wire = group_device(self.group)
        mine = outputs is not None
        if mine:
            leaves, spec = pytree.tree_flatten(outputs)
            header = (
                spec,
                [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("value", t) for t in leaves],
            )
            changed = torch.tensor([int(header != self._header)], device=wire)
        else:
            changed = torch.zeros(1, dtype=torch.int64, device=wire)
        dist.broadcast(changed, group_src=self.src, group=self.group)
        if int(changed.item()):
            box = [header if mine else None]
            dist.broadcast_object_list(box, group_src=self.src, group=self.group, device=wire)
            self._header = box[0]
        spec, described = self._header
        tensors = [leaves[i] for i, d in enumerate(described) if d[0] != "value"] if mine else None
        received = self._tensors(described, tensors, wire)
        it = iter(received)
        out = [next(it) if d[0] != "value" else d[1] for d in described]
        return pytree.tree_unflatten(out, spec)

    def _tensors(self, described: list, tensors: list[torch.Tensor] | None, wire: torch.device) -> list[torch.Tensor]:
        shapes = [(shape, dtype) for shape, dtype in described if shape != "value"]
        out: list[torch.Tensor | None] = [None] * len(shapes)
        for dtype in dict.fromkeys(dtype for _, dtype in shapes):
            idx = [i for i, (_, d) in enumerate(shapes) if d == dtype]
            numels = [math.prod(shapes[i][0]) for i in idx]
            if tensors is not None:
                flat = torch.cat([tensors[i].detach().reshape(-1).to(wire) for i in idx])
            else:
                flat = torch.empty(sum(numels), dtype=dtype, device=wire)
            dist.broadcast(flat, group_src=self.src, group=self.group)
            for i, part in zip(idx, flat.split(numels)):
                out[i] = part.view(shapes[i][0]).to(self.device)
        return out
