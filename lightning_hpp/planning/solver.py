"""The cut solver: for one structure of the search (schedule program, degrees, the kind of every position),
the cuts of the units into stages with the smallest predicted step.

:meth:`StructureSolver.best` is exact for the cost model wherever the structure has at most
:data:`EXACT_CUTS` cuts: every one is scored, in one batch, by replaying the schedule's own action order
(:mod:`~lightning_hpp.planning.replay`). Beyond, it starts from the cuts that minimise the slowest stage and
moves one cut by one unit at a time while the replayed step falls. That start is :func:`bottleneck`, an exact
dynamic programme over (units placed, stages placed, stages of each kind) that minimises the slowest stage
in ``O(p · n² · K)`` per kind budget: it is what lets the planner answer a cluster of hundreds of devices
(deep pipelines, long unit lists, where the cuts number in the billions) in seconds.
:func:`whole_model` is the ``pp = 1`` structure (no cut: the whole model on every rank).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from lightning_hpp.planning.costs import CostModel, in_flight
from lightning_hpp.planning.memory import describe_memory
from lightning_hpp.planning.replay import Program
from lightning_hpp.planning.result import PlanResult, StageEstimate, fmt_bytes

EXACT_CUTS = 4096
"""Structures with at most this many cuts are searched exhaustively; larger ones by local search."""


def bottleneck(n: int, p: int, budgets: Sequence[int],
               cost: Callable[[int, int], np.ndarray]) -> tuple[float, list[int], list[int]] | None:
    """Minimise ``max_s cost(kind_s, s)[cut_s, cut_{s+1}]`` over contiguous cuts and kind choices (exact).

    ``cost(k, s)`` is an ``(n+1, n+1)`` matrix, ``inf`` where segment ``[i, j)`` is not allowed for
    stage ``s`` on kind ``k``; ``budgets[k]`` bounds the number of stages of kind ``k``.
    Returns ``(value, cuts, kinds)`` with ``cuts`` the ``p + 1`` boundaries, or ``None``.
    """
    K = len(budgets)
    cols = np.arange(n + 1)
    start = np.full(n + 1, math.inf)
    start[0] = 0.0
    f: dict[tuple[int, ...], np.ndarray] = {(0,) * K: start}
    back: list[dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]] = []
    for s in range(p):
        g: dict[tuple[int, ...], np.ndarray] = {}
        bk: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        for c, arr in f.items():
            if not np.isfinite(arr).any():
                continue
            for k in range(K):
                if c[k] >= budgets[k]:
                    continue
                mat = np.maximum(arr[:, None], cost(k, s))
                i_best = mat.argmin(axis=0)
                val = mat[i_best, cols]
                c2 = c[:k] + (c[k] + 1,) + c[k + 1 :]
                if c2 not in g:
                    g[c2] = val
                    bk[c2] = (np.full(n + 1, k), i_best)
                else:
                    better = val < g[c2]
                    g[c2] = np.where(better, val, g[c2])
                    bk[c2][0][better] = k
                    bk[c2][1][better] = i_best[better]
        f = g
        back.append(bk)
    best_c, best_v = None, math.inf
    for c, arr in f.items():
        if arr[n] < best_v:
            best_c, best_v = c, float(arr[n])
    if best_c is None:
        return None
    cuts, kinds, j, c = [n], [], n, best_c
    for s in range(p - 1, -1, -1):
        k = int(back[s][c][0][j])
        i = int(back[s][c][1][j])
        kinds.append(k)
        cuts.append(i)
        c = c[:k] + (c[k] - 1,) + c[k + 1 :]
        j = i
    return best_v, cuts[::-1], kinds[::-1]


@dataclasses.dataclass
class Scored:
    """Candidate cuts ``(C, S + 1)`` of one structure and their predicted steps (``inf``: does not fit)."""

    cuts: np.ndarray
    step: np.ndarray
    pipeline: np.ndarray
    update: np.ndarray
    memory: np.ndarray  # (C, pp)
    costs: np.ndarray  # (C, 4, S)
    fits: np.ndarray  # (C,)

    def take(self, i: int) -> Scored:
        sl = slice(i, i + 1)
        return Scored(self.cuts[sl], self.step[sl], self.pipeline[sl], self.update[sl], self.memory[sl], self.costs[sl],
                      self.fits[sl])


class StructureSolver:
    """One structure (schedule program, ``dp`` replicas, the kind of every position) of a :class:`CostModel`.

    The step of a cut: the replayed makespan of the program with every stage's ``F``/``B``/``I``/``W`` costs,
    plus the slowest position's update (what of its gradients' all-reduce one micro-batch's backward does not
    hide, and at least the bucket of its first unit, whose gradients come last; FSDP2's gathers; the
    optimizer), plus the step's fixed cost; ``inf`` where a position's peak memory (parameters and optimizer
    state, and the activations its order holds at once) exceeds its device's.
    """

    def __init__(self, model: CostModel, prog: Program, position_kinds: Sequence[int], dp: int) -> None:
        self.model, self.prog, self.dp = model, prog, dp
        self.kinds = [position_kinds[prog.rank_of[s]] for s in range(prog.n_stages)]
        self.position_kinds = list(position_kinds)
        self.cross_out, self.cross_in = prog.cross_out(), prog.cross_in()
        used = set(self.kinds)
        self.updates = {k: model.allreduce(k, dp, prog.m) for k in used}
        self.rings = {k: model.ring(k, dp) for k in used}
        self.gathers = {k: model.gather(k, prog.m) for k in used}
        one = model.dp_shard > 1 and prog.m == 1  # one micro-batch: the largest unit bounds what is gathered
        self.largest = {k: model.largest(k) for k in used} if one else None
        self.optimizers = {k: model.optimizer(k) for k in used}
        self.first_of = [min(prog.stages_of(r)) for r in range(prog.pp)]
        self.fixed = max(model.overheads(k).step_ms for k in used)

    def score(self, cuts: np.ndarray) -> Scored:
        """The predicted step of every candidate (rows of ``cuts``), ``inf`` where it does not fit."""
        md, prog, n, S = self.model, self.prog, self.model.n, self.prog.n_stages
        C = cuts.shape[0]
        costs = np.zeros((C, 4, S))
        params = np.zeros((C, S))
        stash = np.zeros((C, S))
        largest = np.zeros((C, S))
        ring, window, tail, update, gather = (np.zeros((C, prog.pp)) for _ in range(5))
        for s, k in enumerate(self.kinds):
            i, j = cuts[:, s], cuts[:, s + 1]
            fwd, bwd, out, back, mb, lf, lb = md.actions[k]
            last = j == n
            f = fwd[i, j] + mb / 2 + last * lf + (out[j] if self.cross_out[s] else 0.0)
            b = bwd[i, j] + mb / 2 + last * lb + (back[i] if self.cross_in[s] else 0.0)
            w = bwd[i, j] / 2
            costs[:, 0, s], costs[:, 1, s], costs[:, 2, s], costs[:, 3, s] = f, b, b - w, w
            params[:, s], stash[:, s] = md.params[k][i, j], md.stash[k][i, j] * md.scale
            if self.largest is not None:
                largest[:, s] = self.largest[k][i, j]
            r = prog.rank_of[s]
            ring[:, r] += self.rings[k][i, j]
            gather[:, r] += self.gathers[k][i, j]
            window[:, r] += bwd[i, j] * md.overheads(k).allreduce_overlap
            update[:, r] += self.optimizers[k][i, j]
            if s == self.first_of[r]:  # its first unit's gradients are the rank's last ones
                tail[:, r] = self.rings[k][i, i + 1]
        # the all-reduce overlaps each stage's last backward (pipeline/grads.py): the step waits for what is left
        update += np.maximum(tail, ring - window) + gather if self.dp > 1 else 0.0
        memory = prog.peak_memory(stash)
        fits = np.ones(C, dtype=bool)
        for r in range(prog.pp):
            k, own = self.position_kinds[r], list(prog.stages_of(r))
            memory[:, r] = md.held(params[:, own].sum(axis=1), largest[:, own].max(axis=1), memory[:, r], prog.m)
            fits &= memory[:, r] <= md.groups[k].memory_limit
        pipeline = prog.makespan(costs)
        upd = update.max(axis=1)
        step = np.where(fits, pipeline + upd + self.fixed, math.inf)
        return Scored(cuts, step, pipeline, upd, memory, costs, fits)

    def seed(self) -> np.ndarray | None:
        """The cuts that minimise the slowest stage (both boundaries sent, :func:`bottleneck`), ignoring memory."""
        md, S = self.model, self.prog.n_stages
        K = len(md.costs)
        times = {k: md.time(k) for k in set(self.kinds)}
        blocked = np.full((md.n + 1, md.n + 1), math.inf)
        sol = bottleneck(md.n, S, [S] * K, lambda k, s: times[k] if k == self.kinds[s] else blocked)
        return None if sol is None else np.array([sol[1]])

    def best(self) -> tuple[int, Scored] | None:
        """The best candidate (index into the returned batch), exhaustive or by local search."""
        n, S = self.model.n, self.prog.n_stages
        if math.comb(n - 1, S - 1) <= EXACT_CUTS:
            inner = np.array(list(itertools.combinations(range(1, n), S - 1)), dtype=int).reshape(-1, S - 1)
            cuts = np.concatenate([np.zeros((len(inner), 1), int), inner, np.full((len(inner), 1), n)], axis=1)
            scored = self.score(cuts)
            i = int(np.argmin(scored.step))
            return (i, scored) if np.isfinite(scored.step[i]) else None
        current = self.seed()
        if current is None:
            return None
        scored = self.score(current)
        while True:
            moves = []
            for b in range(1, S):
                for d in (-1, 1):
                    c = current[0].copy()
                    c[b] += d
                    if c[b - 1] < c[b] < c[b + 1]:
                        moves.append(c)
            if not moves:
                break
            trial = self.score(np.array(moves))
            i = int(np.argmin(trial.step))
            if not trial.step[i] < scored.step[0]:
                break
            current, scored = trial.cuts[i : i + 1], trial.take(i)
        return (0, scored) if np.isfinite(scored.step[0]) else None

    def result(self, i: int, scored: Scored, m: int, names: Sequence[str], schedule: str) -> PlanResult:
        """Candidate ``i`` as a result (its step as predicted even where it does not fit: ``result.fits`` says)."""
        md, prog, dp = self.model, self.prog, self.dp
        cuts = [int(c) for c in scored.cuts[i]]
        held = prog.in_flight()
        stages = []
        for s, k in enumerate(self.kinds):
            a, b = cuts[s], cuts[s + 1]
            f, bk = scored.costs[i, 0, s], scored.costs[i, 1, s]
            fwd, bwd, _, _, mb, lf, lb = md.actions[k]
            compute = float(fwd[a, b] + bwd[a, b] + mb + (lf + lb if b == md.n else 0.0))
            opt = float(md.optimizer(k)[a, b])
            r = prog.rank_of[s]
            params, stash = float(md.params[k][a, b]), float(md.stash[k][a, b] * md.scale)
            detail = describe_memory(params, md.optimizer_factor, held[s], stash, dp_shard=md.dp_shard,
                                     n_microbatches=m, reshard_after_forward=md.reshard_after_forward,
                                     largest_unit_bytes=float(md.largest(k)[a, b]), fmt=fmt_bytes)
            stages.append(StageEstimate(
                units=list(names[a:b]), device=md.groups[k].kind, precision=md.costs[k].precision,
                compute_ms=compute, comm_ms=float(f + bk) - compute,
                allreduce_ms=float(self.updates[k][a, b]) - opt, optimizer_ms=opt,
                memory_bytes=float(scored.memory[i, r]), memory_limit=md.groups[k].memory_limit,
                in_flight=held[s], cost_source=md.costs[k].source, memory_detail=detail,
            ))
        pipeline, update = float(scored.pipeline[i]), float(scored.update[i])
        return PlanResult(stages, schedule, m, dp, dp_shard=md.dp_shard, tp_degree=md.tp, fixed_step_ms=self.fixed,
                          stages_per_rank=prog.stages_per_rank, positions=list(prog.rank_of), pipeline_ms=pipeline,
                          update_ms=update, replayed_bubble=float(prog.bubble(scored.costs[i : i + 1])[0]))


def _estimate(model: CostModel, k: int, m: int, dp: int, names: Sequence[str]) -> StageEstimate:
    """The whole model as one stage on kind ``k``."""
    n = model.n
    compute, talk = model.parts(k)
    opt = float(model.optimizer(k)[0, n])
    return StageEstimate(
        units=list(names), device=model.groups[k].kind, precision=model.costs[k].precision,
        compute_ms=float(compute[0, n]), comm_ms=float(talk[0, n]), allreduce_ms=model.exposed(k, dp, 0, n, m),
        memory_bytes=float(model.memory(k, 0, 1, m)[0, n]), memory_limit=model.groups[k].memory_limit,
        in_flight=in_flight(model.schedule, 0, 1, m), cost_source=model.costs[k].source, optimizer_ms=opt,
    )


def whole_model(model: CostModel, m: int, dp: int, names: Sequence[str], kinds: list[int]) -> PlanResult | None:
    """``pp = 1``: the whole model on every rank (the all-reduce overlapping the last micro-batch's backward);
    the slowest kind sets the step. ``None`` where a kind's device cannot hold it."""
    ests = [_estimate(model, k, m, dp, names) for k in kinds]
    if any(not e.fits for e in ests):
        return None
    slowest = max(ests, key=lambda e: (e.stage_ms, e.allreduce_ms + e.optimizer_ms))
    est = dataclasses.replace(slowest)
    update = max(ests, key=lambda e: e.allreduce_ms + e.optimizer_ms)  # the slowest kind's update
    est.allreduce_ms, est.optimizer_ms = update.allreduce_ms, update.optimizer_ms
    est.memory_bytes = max(e.memory_bytes for e in ests)
    est.memory_limit = min(e.memory_limit for e in ests)
    if len(kinds) > 1:
        est.replica_kinds = [model.groups[k].kind for k in kinds]
        est.device = "|".join(est.replica_kinds)
    return PlanResult([est], model.schedule, m, dp, dp_shard=model.dp_shard, tp_degree=model.tp)
