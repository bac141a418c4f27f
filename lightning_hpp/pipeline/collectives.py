"""Lightning's collectives as DDP means them, on a pipeline's rank grid.

Under DDP every process is one replica: ``strategy.reduce`` and ``all_gather`` (a hook's
``self.log(..., sync_dist=True)``, ``self.all_gather(...)``) span the replicas. Under a pipeline every rank of
one replica holds that replica's value (the steps are replayed where they change state, the hooks run on every
rank), so the same calls span the data-parallel group of this rank's position: over the world each value would
count once per pipeline rank. A decision (``reduce_boolean_decision``: stop, save, skip) is taken by the whole
job, as every rank acts on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available

from lightning_hpp._dist import initialized
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
