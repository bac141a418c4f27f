"""Handing the schedule's gradients to Lightning's optimizer step.

Lightning's automatic optimization runs ``training_step`` → ``zero_grad`` → ``backward``. The
pipeline schedule computes forward *and* backward inside ``training_step``, so its gradients would
be zeroed before Lightning's ``backward`` call. :class:`GradHandover` keeps them apart:

* :meth:`GradHandover.during_step` swaps every parameter's ``.grad`` out while the schedule runs
  and back afterwards, keeping what the schedule produced as the step's *fresh* gradients;
* :meth:`GradHandover.last_backward` wraps a stage's last backward of the step (the schedule's
  ``last_backward``): as each bucket of its gradients becomes final, that bucket's data-parallel
  all-reduce starts, so the reduction overlaps the rest of the backward (what DDP's reducer does);
* :meth:`GradHandover.hand_over` (from the strategy's ``backward``) optionally takes each stage's
  local norm (before the all-reduce: what ``BiasMonitor`` compares across replicas), reduces the
  buckets the backward did not start, waits for all of them, averages, and adds the fresh
  gradients to ``.grad`` (so gradient accumulation over several batches works as under DDP).

Buckets are fixed once, in reverse parameter order (the order a backward usually finishes them):
a large gradient is a bucket of its own, all-reduced where it is; small ones of one dtype travel
flattened together. Buckets start strictly in that order on every replica, whatever order the
autograd engine finishes gradients in, so the replicas' collectives always match; a bucket whose
gradients the backward never finished (a parameter without a gradient, a zero-bubble schedule's
separate weight pass) starts in :meth:`hand_over`, and with it every later bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hpp._dist import group_device
from lightning_hpp.pipeline.fsdp import local

_IN_PLACE_NUMEL = 1 << 20
"""Gradients at least this large (4 MiB in float32) are all-reduced where they are; smaller ones travel flattened
together (a copy is cheaper than a collective's fixed cost: with 256 KiB here, a 0.9 M-parameter transformer's
step made 10 all-reduces, now 1)."""

_BUCKET_NUMEL = 1 << 20
"""Elements of small gradients per flattened bucket (4 MiB in float32, DDP's first bucket is 1 MiB and the others
25 MiB): small enough that a model of small tensors still gets several buckets to overlap, large enough to keep
the number of collectives low."""


class GradHandover:
    """This rank's stage parameters and the fresh gradients of the last schedule step.

    Args:
        stage_modules: This rank's stages, by stage index.
        dp_group: The data-parallel group of this rank's stages (``None`` or ``dp_size == 1``: no
            all-reduce; FSDP2 stages reduce their own gradients, see :mod:`lightning_hpp.pipeline.fsdp`).
        dp_size: Its size.
        shared: Parameters that stages on other ranks use too (tied embeddings and heads), each list
            with the group of the ranks of this replica holding them: their gradients are summed
            over it after the dp average, so every copy takes the same step.
        ties: Copies of one parameter on several of this rank's stages (sharded stages hold one each,
            :func:`~lightning_hpp.pipeline.fsdp.shard_stages`), the one the optimizer steps first: their gradients
            are summed into each (before ``shared``), and at the start of every step the others take its values.
        bucket_numel: Elements per bucket of small gradients.

    A ``DTensor`` parameter (tensor parallel) is reduced by its local shard: the replicas of one tensor-parallel
    rank hold the same part of it.
    """

    def __init__(self, stage_modules: dict[int, nn.Module], dp_group: Any, dp_size: int,
                 shared: list[tuple[list[nn.Parameter], Any]] = (), bucket_numel: int = _BUCKET_NUMEL,
                 ties: list[list[nn.Parameter]] = ()) -> None:
        seen: dict[int, nn.Parameter] = {}
        stages_of: dict[int, set[int]] = {}
        for k, sm in sorted(stage_modules.items()):
            for p in sm.parameters():
                seen.setdefault(id(p), p)
                stages_of.setdefault(id(p), set()).add(k)
        self.params: list[nn.Parameter] = list(seen.values())
        self._stage_of = [min(stages_of[id(p)]) for p in self.params]
        self._stages = sorted(stage_modules)
        self._dp_group = dp_group
        self._dp_size = dp_size
        self._reducing = dp_group is not None and dp_size > 1
        self._shared = list(shared)
        self._ties = [list(t) for t in ties]
        self._fresh: list[Tensor | None] | None = None
        # buckets of the last handed-over step whose all-reduce started inside the backward
        self.started_in_backward = 0
        self._bucket_numel = bucket_numel
        # a parameter of several of this rank's stages is final only after the last of their backwards: it is
        # reduced in hand_over, its buckets after every other one
        self._plan([len(stages_of[id(p)]) == 1 for p in self.params])
        # the first step only watches: a parameter whose gradient accumulates more than once in one backward (a
        # weight used inside and outside a reentrant checkpoint) is not final at its first accumulation
        self._observing = True
        self._fires = [0] * len(self.params)
        self._reset()

    def _plan(self, hookable: list[bool]) -> None:
        order = [i for i in reversed(range(len(self.params))) if hookable[i]]
        order += [i for i in reversed(range(len(self.params))) if not hookable[i]]
        self._buckets = _plan_buckets(self.params, order, self._bucket_numel)
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        self._hooked = {
            k: [i for i in range(len(self.params)) if hookable[i] and self._stage_of[i] == k] for k in self._stages
        }
        self._hookable = list(hookable)

    # ----------------------------------------------------------------- one step
    def _reset(self) -> None:
        self._in_step = False
        self._ready = [0] * len(self._buckets)
        self._next = 0  # the next bucket to start (buckets start in order); at hand_over, those the backward started
        self._works: list[Any] = []
        self._flats: list[tuple[Tensor, list[Tensor]]] = []
        self._large: list[Tensor] = []
        self._want_norms = False
        self._norms: dict[int, list[Tensor]] = {}

    def _drain(self) -> None:
        """Wait for what a step that failed half-way left in flight (the next step's collectives follow it)."""
        for work in self._works:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the failed step already raised its own error
                pass
        self._reset()

    @contextmanager
    def during_step(self, keep_held: bool = True, local_norms: bool = False) -> Iterator[None]:
        """Run the schedule with empty ``.grad``; keep what it produced, restore what was there.

        Args:
            keep_held: Restore the gradients that were there (inside an accumulation window); at the
                first batch of a window Lightning zeroes them right after ``training_step`` anyway,
                so they are dropped now: they would otherwise sit beside the new ones for the whole
                schedule (one more copy of the stage's gradients at the peak).
            local_norms: :meth:`hand_over` will be asked for local norms: take them from each bucket
                before its all-reduce starts.
        """
        self._drain()
        self._follow_ties()
        self._in_step, self._want_norms = True, local_norms
        held = [p.grad if keep_held else None for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            yield
        finally:
            self._in_step = False
            self._fresh = [p.grad for p in self.params]
            for p, g in zip(self.params, held):
                p.grad = g

    @contextmanager
    def last_backward(self, stage: int) -> Iterator[None]:
        """Around ``stage``'s last backward of the step: start each bucket's all-reduce once its gradients are final."""
        # a frozen parameter gets no gradient (and takes no hook): its bucket starts in hand_over with the others'
        indices = (
            [i for i in self._hooked.get(stage, []) if self.params[i].requires_grad]
            if self._reducing and self._in_step
            else []
        )
        hook = self._on_accumulated if self._observing else self._on_final
        handles = [self.params[i].register_post_accumulate_grad_hook(hook(i)) for i in indices]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _on_accumulated(self, i: int) -> Any:
        def hook(p: nn.Parameter) -> None:
            self._fires[i] += 1

        return hook

    def _settle_observation(self) -> None:
        """After the first step: parameters accumulated more than once in a last backward, on any replica, are
        reduced in ``hand_over`` from now on (one collective, once; every replica plans the same buckets)."""
        fires = torch.tensor(self._fires, dtype=torch.int32)
        if self._reducing:
            fires = fires.to(group_device(self._dp_group))
            dist.all_reduce(fires, op=dist.ReduceOp.MAX, group=self._dp_group)
        repeated = fires.cpu().tolist()
        self._plan([h and n <= 1 for h, n in zip(self._hookable, repeated)])
        self._observing = False

    def _on_final(self, i: int) -> Any:
        bucket = self._bucket_of[i]

        def hook(p: nn.Parameter) -> None:
            self._ready[bucket] += 1
            while self._next < len(self._buckets) and self._ready[self._next] == len(self._buckets[self._next]):
                self._start(self._next, [self.params[j].grad for j in self._buckets[self._next]])
                self._next += 1

        return hook

    def _start(self, bucket: int, grads: list[Tensor | None]) -> None:
        members = [(j, g) for j, g in zip(self._buckets[bucket], grads) if g is not None]
        if not members:
            return
        members = [(j, local(g)) for j, g in members]
        if self._want_norms:
            for j, n in zip((j for j, _ in members), _norms([g for _, g in members])):
                self._norms.setdefault(self._stage_of[j], []).append(n)
        present = [g for _, g in members]
        if len(present) == 1 and present[0].is_contiguous():
            self._works.append(dist.all_reduce(present[0], group=self._dp_group, async_op=True))
            self._large.append(present[0])
            return
        flat = torch._utils._flatten_dense_tensors(present)
        self._works.append(dist.all_reduce(flat, group=self._dp_group, async_op=True))
        self._flats.append((flat, present))

    def hand_over(self, local_norms: bool = False) -> dict[int, Tensor] | None:
        """Finish the fresh gradients' all-reduce over dp and add them to ``.grad``.

        Args:
            local_norms: Also return each held stage's gradient norm before the all-reduce (0-dim
                float64 tensors on the device: nothing is read on the host).

        Returns:
            ``{stage: norm}`` when ``local_norms``, else ``None`` (also when no step ran).
        """
        fresh, self._fresh = self._fresh, None
        if fresh is None:
            self._drain()
            return None
        if local_norms and not self._want_norms:
            if self._next:
                raise RuntimeError(
                    "internal: local norms asked for after buckets started without them; "
                    "pass `local_norms` to `during_step`"
                )
            self._want_norms = True
        self.started_in_backward = self._next
        if self._reducing:
            while self._next < len(self._buckets):
                self._start(self._next, [fresh[j] for j in self._buckets[self._next]])
                self._next += 1
            for work in self._works:
                work.wait()
            if self._large:
                torch._foreach_div_(self._large, self._dp_size)
            for flat, present in self._flats:
                _unflatten_into(flat.div_(self._dp_size), present)
        norms = None
        if local_norms:
            norms = (
                self._stage_norms(fresh)
                if not self._reducing
                else {k: _combine(self._norms.get(k, [])) for k in self._stages}
            )
        self._reset()
        if self._observing and self._reducing:
            self._settle_observation()
        index = {id(p): i for i, p in enumerate(self.params)}
        across = {id(p) for params, _ in self._shared for p in params}
        # copies on this rank's stages: one sum, in the copy the pipeline's sum reaches (if any)
        summed = [self._sum_ties(tie, fresh, index, across) for tie in self._ties]
        if self._shared:
            for params, group in self._shared:
                for p in params:  # every holder joins the sum, with zeros where it got no gradient
                    i = index[id(p)]
                    if fresh[i] is None:
                        fresh[i] = torch.zeros_like(p)
                # a sharded stage's copies are shards of one layout on every holder: their local parts add up
                _all_reduce_sum([local(fresh[index[id(p)]]) for p in params], group)
        for tie, target in zip(self._ties, summed):
            for p in tie if target is not None else ():
                if p is not target:
                    fresh[index[id(p)]] = fresh[index[id(target)]].clone()
        for p, g in zip(self.params, fresh):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        return norms

    @torch.no_grad()
    def _follow_ties(self) -> None:
        """The copies of a tied parameter take the values of the one the optimizer steps (their local shards: one
        layout on every copy)."""
        for first, *others in self._ties:
            for p in others:
                local(p).copy_(local(first))

    @staticmethod
    def _sum_ties(
        tie: list[nn.Parameter], fresh: list[Tensor | None], index: dict[int, int], across: set[int]
    ) -> nn.Parameter | None:
        """Add the gradients of a tied parameter's copies into one copy (returned): the one whose gradient is
        summed across ranks too (``across``), else the first that has one; ``None`` where none has one."""
        held = [p for p in tie if fresh[index[id(p)]] is not None]
        target = next((p for p in tie if id(p) in across), held[0] if held else None)
        if target is None:
            return None
        if fresh[index[id(target)]] is None:
            fresh[index[id(target)]] = torch.zeros_like(target)
        into = local(fresh[index[id(target)]])
        for p in held:
            if p is not target:
                into.add_(local(fresh[index[id(p)]]))
        return target

    def _stage_norms(self, grads: list[Tensor | None]) -> dict[int, Tensor]:
        per_stage: dict[int, list[Tensor]] = {k: [] for k in self._stages}
        for k, g in zip(self._stage_of, grads):
            if g is not None:
                per_stage[k].append(g)
        return {k: _combine(_norms([local(g) for g in gs])) for k, gs in per_stage.items()}


def _norms(grads: list[Tensor]) -> list[Tensor]:
    """Each gradient's 2-norm, at least in float32 (bf16 and fp16 gradients' norms are taken in float32)."""
    if not grads:
        return []
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    return list(torch._foreach_norm(grads, 2, dtype=dtype))


def _combine(norms: list[Tensor]) -> Tensor:
    """The norm of the concatenation, from the norms of the parts (float64)."""
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack([n.double() for n in norms]))


def _plan_buckets(params: list[nn.Parameter], order: list[int], numel: int) -> list[list[int]]:
    """Parameter indices grouped into buckets, in ``order``: a large parameter alone, small ones of one dtype
    together up to ``numel`` elements."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size, dtype = 0, None
    for i in order:
        p = local(params[i])
        if p.numel() >= _IN_PLACE_NUMEL:
            buckets.append([i])
            continue
        if current and (p.dtype != dtype or size >= numel):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel()
        dtype = p.dtype
    if current:
        buckets.append(current)
    return buckets


def _all_reduce_sum(grads: list[Tensor], group: Any) -> None:
    """Sum ``grads`` over ``group`` in place: large ones where they are, small ones flattened per dtype."""
    large = [g for g in grads if g.numel() >= _IN_PLACE_NUMEL and g.is_contiguous()]
    small: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        if not (g.numel() >= _IN_PLACE_NUMEL and g.is_contiguous()):
            small.setdefault(g.dtype, []).append(g)
    works = [dist.all_reduce(g, group=group, async_op=True) for g in large]
    flats = []
    for present in small.values():
        flat = torch._utils._flatten_dense_tensors(present)
        works.append(dist.all_reduce(flat, group=group, async_op=True))
        flats.append((flat, present))
    for work in works:
        work.wait()
    for flat, present in flats:
        _unflatten_into(flat, present)


def _unflatten_into(flat: Tensor, tensors: list[Tensor]) -> None:
    """Copy the parts of ``flat`` (``_flatten_dense_tensors(tensors)``) back into ``tensors``."""
    for t, part in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(part)


def tied_aliases(module: nn.Module, shared: dict[str, list[int]]) -> dict[str, list[str]]:
    """Every name of each shared parameter in the whole ``module``: a tied weight is one parameter under several
    names (``embed.weight`` and ``head.weight``), and a rank that holds only some of the units keeps only theirs."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    params = dict(module.named_parameters(remove_duplicate=False))
    return {n: names[id(params[n])] if n in params else [n] for n in shared}


def held_by_name(module: nn.Module, aliases: dict[str, list[str]]) -> dict[str, nn.Parameter]:
    """This rank's parameters by name, each shared one also under the name :func:`shared_gradient_groups` knows it
    by (the first of its ``aliases``), whichever of its names this rank holds it under."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, names in aliases.items():
        held = next((params[a] for a in names if a in params), None)
        if held is not None:
            params[name] = held
    return params


def shared_gradient_groups(
    shared: dict[str, list[int]], params: dict[str, nn.Parameter], positions: list[list[int]], mesh: Any
) -> list[tuple[list[nn.Parameter], Any]]:
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
    where = {
        n: tuple(sorted({r for r, held in enumerate(positions) for k in ks if k in held})) for n, ks in shared.items()
    }
    groups = mesh.groups_over_positions(sorted({ps for ps in where.values() if len(ps) > 1}))
    out: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for n, ps in where.items():
        if groups.get(ps) is None:
            continue
        if n not in params:  # a member that would skip the sum leaves the others waiting in it: stop here instead
            raise RuntimeError(
                f"internal: this rank's stages use the shared parameter {n!r}, but it holds no tensor "
                f"of that name ({sorted(params)[:8]}...)"
            )
        out.setdefault(ps, []).append(params[n])
    return [(ps_params, groups[ps]) for ps, ps_params in sorted(out.items())]
