"""Gradient clipping per stage: the stage's view of the optimizer, and the clipping rule itself.

A LightningModule that overrides ``configure_gradient_clipping`` owns clipping, as under any other
strategy. :class:`~lightning_hpp.HPPPrecision` calls the hook once per stage this rank holds, with a
:class:`StageOptimizer`: the optimizer restricted to that stage's parameters. Inside the hook,
``self.clip_gradients(optimizer, ...)`` clips that stage (with its ``clip_norm`` when the plan sets one,
else the value passed), and torch's own ``clip_grad_norm_`` over ``optimizer.param_groups`` sees the
same parameters. The gradients are those after the data-parallel all-reduce, so every replica takes
the same decision. A parameter split over ranks (FSDP2's shards, tensor parallel's ``DTensor`` shards, both)
counts with its whole gradient: each rank's squares are summed over the mesh dimensions it is split over
(:func:`sq_norms`), then over the pipeline. With tensor-parallel or sharded stages, a
``configure_gradient_clipping`` hook clips with ``self.clip_gradients(optimizer, ...)``, which takes those
norms; torch's ``clip_grad_norm_`` refuses a stage whose parameters live on different meshes.
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
    """The gradients of ``params`` this rank holds: a ``DTensor`` parameter's (FSDP2, tensor parallel) local
    shard of its gradient (a view: clipping it in place clips the ``DTensor``)."""
    return [local(p.grad) for p in params if p.grad is not None]


def split_dims(t: Tensor) -> tuple[str, ...]:
    """The names of the mesh dimensions a ``DTensor`` is split over (its ``Shard`` placements: FSDP2's
    ``dp_shard``, tensor parallel's ``tp``); ``()`` for a plain tensor or a replicated ``DTensor``."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return ()
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    # a shard of any kind (FSDP2 over a tensor-parallel shard places a strided one): neither replicated nor partial
    return tuple(sorted(names[i] for i, pl in enumerate(t.placements) if not (pl.is_replicate() or pl.is_partial())))


def sq_norms(groups_of_params: list[list[Tensor]], device: Any = None) -> Tensor:
    """For each list of parameters, the squared 2-norm of their whole gradients (float64), on every rank.

    Each rank takes the squares of what it holds; a ``DTensor``'s are summed over the mesh dimensions it is split
    over (a sharded parameter's over its ``dp_shard`` ranks, a tensor-parallel one's over its ``tp`` ranks, a
    2-D one's over both), a replicated or plain tensor's are its own (every rank holds the whole). One
    all-reduce per mesh dimension any of them is split over, collective over that dimension's group: every rank
    of a group passes the same lists (ranks of one pipeline position hold the same stages). A parameter without
    a gradient counts 0.
    """
    rows: dict[tuple[str, ...], Tensor] = {}
    groups: dict[str, Any] = {}
    held = next((p.grad.device for ps in groups_of_params for p in ps if p.grad is not None), torch.device("cpu"))
    n = len(groups_of_params)
    for i, params in enumerate(groups_of_params):
        parts: dict[tuple[str, ...], list[Tensor]] = {}
        for p in params:
            dims = split_dims(p)
            for d in dims:
                if d not in groups:
                    groups[d] = p.device_mesh.get_group(list(p.device_mesh.mesh_dim_names).index(d))
            row = rows.setdefault(dims, torch.zeros(n, dtype=torch.float64, device=held))
            if p.grad is not None:
                parts.setdefault(dims, []).append(local(p.grad))
        for dims, grads in parts.items():
            rows[dims][i] = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double()).pow(2)
    for d in sorted(groups):
        keys = [k for k in sorted(rows) if d in k]
        if dist.get_world_size(groups[d]) > 1:
            stacked = torch.stack([rows[k] for k in keys])
            dist.all_reduce(stacked, group=groups[d])
            for k, row in zip(keys, stacked):
                rows[k] = row
    total = torch.stack(list(rows.values())).sum(0) if rows else torch.zeros(n, dtype=torch.float64, device=held)
    return total.to(device or held)


def stage_norm(params: Iterable[Tensor]) -> Tensor:
    """The 2-norm of one stage's gradients over all their shards (:func:`sq_norms`; collective where they are
    split), 0 without gradients."""
    return sq_norms([list(params)])[0].sqrt()


def pipeline_sq_norms(stage_params: Mapping[int, list[Tensor]], repeated: Mapping[int, list[Tensor]], num: int,
                      pp_group: Any, device: Any) -> tuple[Tensor, Tensor]:
    """``[norm of stage k's gradients]`` for every stage of the pipeline, and ``[squared norm of stage k's copies of
    tied weights an earlier stage holds]``, on every rank: this rank's stages by :func:`sq_norms` (over their
    shards), then one all-reduce over the pipeline group (each stage's entries come from one rank of it)."""
    ks = sorted(stage_params)
    sq = sq_norms([stage_params[k] for k in ks] + [list(repeated.get(k, [])) for k in ks], device=device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    local_norms = {k: sq[i].sqrt() for i, k in enumerate(ks)}
    local_rep = {k: sq[len(ks) + i] for i, k in enumerate(ks)}
    both = torch.stack([torch.stack([local_norms.get(k, zero) for k in range(num)]),
                        torch.stack([local_rep.get(k, zero) for k in range(num)])])
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(both, group=pp_group)
    return both[0], both[1]


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
    # a tensor several stages of this rank hold (a tied weight on a V schedule's rank, unsharded) is scaled once,
    # by the first of them
    seen: set[int] = set()
    per_stage = {k: [g for g in per_stage[k] if not (g.data_ptr() in seen or seen.add(g.data_ptr()))]
                 for k in sorted(per_stage)}
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
