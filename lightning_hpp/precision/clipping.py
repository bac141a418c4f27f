"""Gradient clipping per stage: the stage's view of the optimizer, and the clipping rule itself.

A LightningModule that overrides ``configure_gradient_clipping`` owns clipping, as under any other
strategy. :class:`~lightning_hpp.HPPPrecision` calls the hook once per stage this rank holds, with a
:class:`StageOptimizer`: the optimizer restricted to that stage's parameters. Inside the hook,
``self.clip_gradients(optimizer, ...)`` clips that stage (with its ``clip_norm`` when the plan sets one,
else the value passed), and torch's own ``clip_grad_norm_`` over ``optimizer.param_groups`` sees the
same parameters. The gradients are those after the data-parallel all-reduce, so every replica takes
the same decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hpp.pipeline.fsdp import local


class StageOptimizer:
    """The optimizer as one pipeline stage sees it in ``configure_gradient_clipping``.

    ``param_groups`` are copies of the optimizer's groups holding only this stage's parameters (the
    hyper-parameters are those of the optimizer; changing them here does not change the optimizer).
    Every other attribute is the optimizer's.

    Attributes:
        optimizer: The optimizer Lightning steps.
        stage: The stage index.
        clip_norm: The stage's own ``clip_norm`` from the plan (``None`` when unset).
    """

    def __init__(self, optimizer: Any, stage: int, params: Iterable[Tensor], clip_norm: float | None) -> None:
        ids = {id(p) for p in params}
        self.optimizer = optimizer
        self.stage = stage
        self.clip_norm = clip_norm
        self.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in ids]} for g in optimizer.param_groups]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        n = sum(len(g["params"]) for g in self.param_groups)
        return f"StageOptimizer(stage={self.stage}, {n} parameters of {type(self.optimizer).__name__})"


def stage_grads(params: Iterable[Tensor]) -> list[Tensor]:
    """The gradients of ``params`` this rank holds: a sharded (FSDP2) parameter's local shard of its gradient
    (a view: clipping it in place clips the ``DTensor``)."""
    return [local(p.grad) for p in params if p.grad is not None]


def stage_norm(grads: list[Tensor], shard_group: Any = None) -> Tensor:
    """The 2-norm of a stage's gradients (float64 accumulation, on their device), 0 without gradients.

    With ``shard_group`` (a sharded stage: ``grads`` are this rank's shards) the squared norms of every
    shard of the group are summed first (collective over the group)."""
    if shard_group is not None:
        return sharded_sq_norms([grads], shard_group)[0].sqrt()
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double())


def sharded_sq_norms(groups_of_grads: list[list[Tensor]], shard_group: Any, device: Any = None) -> Tensor:
    """For each list of gradient shards, the squared 2-norm of the whole (float64): each rank's local squares,
    summed over ``shard_group`` in one all-reduce (collective: every rank of the group passes as many lists)."""
    held = next((gs[0].device for gs in groups_of_grads if gs), torch.device("cpu"))
    device = device or held
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sq = torch.stack([torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)).double()).pow(2).to(device)
                      if gs else zero for gs in groups_of_grads]) if groups_of_grads else zero.reshape(0)
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        dist.all_reduce(sq, group=shard_group)
    return sq


def clip_stages(
    per_stage: Mapping[int, list[Tensor]],
    norms: Mapping[int, Tensor] | Tensor,
    stage_limits: Mapping[int, float | None],
    algorithm: str,
    mode: str,
    clip_val: float | None,
    repeated_sq: Tensor | None = None,
) -> None:
    """Clip the given stages' gradients in place, without reading a norm on the host.

    The rule is torch's ``clip_grad_norm_``: multiply by ``min(1, limit / (norm + 1e-6))``. A stage
    with its own limit (the plan's ``clip_norm``) always clips its own norm at it. ``clip_val`` (the
    Trainer's ``gradient_clip_val``, or the value handed to ``clip_gradients``) is, with
    ``mode="global"``, a limit on the one norm over every stage of the pipeline after that
    (Lightning's meaning: the norm over all the model's parameters), and with ``mode="per-stage"``
    the limit of every stage without a limit of its own.

    Args:
        per_stage: Gradients by stage (the stages to clip).
        norms: Each stage's norm by stage index: for ``mode="global"`` every stage's (a tensor of all
            the pipeline's stage norms, after the data-parallel reduction).
        stage_limits: Each stage's own limit (``None``: none); for ``mode="global"`` every stage's.
        algorithm: ``"norm"`` or ``"value"`` (element-wise: each stage's limit, else ``clip_val``).
        mode: ``"global"`` or ``"per-stage"``.
        clip_val: The requested value.
        repeated_sq: For ``mode="global"``: each stage's squared norm of its copies of tied weights an earlier
            stage holds too, taken out of the pipeline's norm (one process counts such a weight once).
    """
    if algorithm == "value":
        for k, grads in per_stage.items():
            limit = stage_limits.get(k) or clip_val
            if limit and grads:
                torch._foreach_clamp_min_(grads, -limit)
                torch._foreach_clamp_max_(grads, limit)
    elif mode == "global":
        stacked = torch.as_tensor(norms).double()
        limits = torch.tensor([stage_limits.get(k) or float("inf") for k in range(stacked.numel())],
                              dtype=torch.float64, device=stacked.device)
        own = (limits / (stacked + 1e-6)).clamp(max=1.0)  # each stage at its own limit first
        coef = own
        if clip_val:
            sq = (stacked * own).pow(2).sum()
            if repeated_sq is not None:
                sq = (sq - (torch.as_tensor(repeated_sq).double() * own.pow(2)).sum()).clamp(min=0)
            total = sq.sqrt()
            coef = own * (clip_val / (total + 1e-6)).clamp(max=1.0)
        for k, grads in per_stage.items():
            if grads and (clip_val or stage_limits.get(k)):
                torch._foreach_mul_(grads, coef[k].to(grads[0].device))
    else:
        for k, grads in per_stage.items():
            limit = stage_limits.get(k) or clip_val
            if limit and grads:
                torch._foreach_mul_(grads, (limit / (norms[k] + 1e-6)).clamp(max=1.0).to(grads[0].device))


def algorithm_name(algorithm: Any) -> str:
    """``GradClipAlgorithmType.NORM`` / ``"norm"`` / ``None`` → ``"norm"``."""
    value = getattr(algorithm, "value", algorithm)
    return str(value or "norm").lower()


def overrides_clipping(model: Any) -> bool:
    """Whether the LightningModule defines its own ``configure_gradient_clipping``."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return isinstance(model, LightningModule) and is_overridden("configure_gradient_clipping", model, LightningModule)
