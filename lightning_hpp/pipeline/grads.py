"""Handing the schedule's gradients to Lightning's optimizer step.

Lightning's automatic optimization runs ``training_step`` → ``zero_grad`` → ``backward``. The
pipeline schedule computes forward *and* backward inside ``training_step``, so its gradients would
be zeroed before Lightning's ``backward`` call. :class:`GradHandover` keeps them apart:

* :meth:`GradHandover.during_step` swaps every parameter's ``.grad`` out while the schedule runs
  and back afterwards, keeping what the schedule produced as the step's *fresh* gradients;
* :meth:`GradHandover.hand_over` (from the strategy's ``backward``) optionally takes each stage's
  local norm (before the all-reduce: what ``BiasMonitor`` compares across replicas), averages the
  fresh gradients over the data-parallel group (large ones in place, small ones flattened), and adds them to ``.grad``
  (so gradient accumulation over several batches works as under DDP).

The parameter → stage map is built once, not per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


class GradHandover:
    """This rank's stage parameters and the fresh gradients of the last schedule step.

    Args:
        stage_modules: This rank's stages, by stage index.
        dp_group: The data-parallel group of this rank's stages (``None`` or ``dp_size == 1``: no
            all-reduce).
        dp_size: Its size.
        shared: Parameters that stages on other ranks use too (tied embeddings and heads), each list
            with the group of the ranks of this replica holding them: their gradients are summed
            over it after the dp average, so every copy takes the same step.
    """

    def __init__(self, stage_modules: dict[int, nn.Module], dp_group: Any, dp_size: int,
                 shared: list[tuple[list[nn.Parameter], Any]] = ()) -> None:
        seen: dict[int, nn.Parameter] = {}
        stage_of: dict[int, int] = {}
        for k, sm in sorted(stage_modules.items()):
            for p in sm.parameters():
                seen.setdefault(id(p), p)
                stage_of.setdefault(id(p), k)
        self.params: list[nn.Parameter] = list(seen.values())
        self._stage_of = [stage_of[id(p)] for p in self.params]
        self._stages = sorted(stage_modules)
        self._dp_group = dp_group
        self._dp_size = dp_size
        self._shared = list(shared)
        self._fresh: list[Tensor | None] | None = None

    @contextmanager
    def during_step(self, keep_held: bool = True) -> Iterator[None]:
        """Run the schedule with empty ``.grad``; keep what it produced, restore what was there.

        Args:
            keep_held: Restore the gradients that were there (inside an accumulation window); at the
                first batch of a window Lightning zeroes them right after ``training_step`` anyway,
                so they are dropped now: they would otherwise sit beside the new ones for the whole
                schedule (one more copy of the stage's gradients at the peak).
        """
        held = [p.grad if keep_held else None for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            yield
        finally:
            self._fresh = [p.grad for p in self.params]
            for p, g in zip(self.params, held):
                p.grad = g

    def hand_over(self, local_norms: bool = False) -> dict[int, Tensor] | None:
        """All-reduce the fresh gradients over dp and add them to ``.grad``.

        Args:
            local_norms: Also return each held stage's gradient norm before the all-reduce (0-dim
                float64 tensors on the device: nothing is read on the host).

        Returns:
            ``{stage: norm}`` when ``local_norms``, else ``None`` (also when no step ran).
        """
        fresh, self._fresh = self._fresh, None
        if fresh is None:
            return None
        norms = self._local_norms(fresh) if local_norms else None
        if self._dp_group is not None and self._dp_size > 1:
            _flat_all_reduce(fresh, self._dp_group, divide_by=self._dp_size)
        if self._shared:
            index = {id(p): i for i, p in enumerate(self.params)}
            for params, group in self._shared:
                for p in params:  # every holder joins the sum, with zeros where it got no gradient
                    i = index[id(p)]
                    if fresh[i] is None:
                        fresh[i] = torch.zeros_like(p)
                _flat_all_reduce([fresh[index[id(p)]] for p in params], group)
        for p, g in zip(self.params, fresh):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        return norms

    def _local_norms(self, grads: list[Tensor | None]) -> dict[int, Tensor]:
        per_stage: dict[int, list[Tensor]] = {k: [] for k in self._stages}
        for k, g in zip(self._stage_of, grads):
            if g is not None:
                per_stage[k].append(g)
        return {
            k: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)).double()) if gs else torch.zeros((), dtype=torch.float64)
            for k, gs in per_stage.items()
        }


_IN_PLACE_NUMEL = 1 << 16
"""Gradients at least this large are all-reduced where they are; smaller ones travel flattened together."""


def _flat_all_reduce(grads: list[Tensor | None], group: Any, divide_by: int = 1) -> None:
    """Sum ``grads`` over ``group`` in place (then divide).

    Large contiguous gradients are all-reduced in place, small ones in one flat tensor per dtype;
    every all-reduce is started before the first is waited for. Copying large gradients into a flat
    buffer and back costs two passes over the gradients' memory, about as much as the all-reduce itself
    on a CPU.
    """
    large: list[Tensor] = []
    small: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        if g is None:
            continue
        if g.numel() >= _IN_PLACE_NUMEL and g.is_contiguous():
            large.append(g)
        else:
            small.setdefault(g.dtype, []).append(g)  # stages may differ in dtype
    works = [dist.all_reduce(g, group=group, async_op=True) for g in large]
    flats = []
    for present in small.values():
        flat = torch._utils._flatten_dense_tensors(present)
        works.append(dist.all_reduce(flat, group=group, async_op=True))
        flats.append((flat, present))
    for work in works:
        work.wait()
    if divide_by != 1 and large:
        torch._foreach_div_(large, divide_by)
    for flat, present in flats:
        if divide_by != 1:
            flat.div_(divide_by)
        for g, synced in zip(present, torch._utils._unflatten_dense_tensors(flat, present)):
            g.copy_(synced)


def shared_gradient_groups(shared: dict[str, list[int]], params: dict[str, nn.Parameter], positions: list[list[int]],
                           mesh: Any) -> list[tuple[list[nn.Parameter], Any]]:
    """For the parameters several stages use, the groups of ranks their gradients are summed over.

    Args:
        shared: ``{parameter name: stages using it}``.
        params: This rank's parameters by name.
        positions: The stages each pipeline position holds.
        mesh: The :class:`~lightning_hpp.pipeline.mesh.Mesh` (collective: every rank creates every group).

    Returns:
        ``[(this rank's parameters of one position set, the group of this replica's ranks there)]``;
        parameters whose stages all sit on this rank need no group (autograd already sums them).
    """
    where = {n: tuple(sorted({r for r, held in enumerate(positions) for k in ks if k in held})) for n, ks in shared.items()}
    groups = mesh.groups_over_positions(sorted({ps for ps in where.values() if len(ps) > 1}))
    out: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for n, ps in where.items():
        if groups.get(ps) is not None and n in params:
            out.setdefault(ps, []).append(params[n])
    return [(ps_params, groups[ps]) for ps, ps_params in sorted(out.items())]
