"""One search over the whole plan behind ``plan="auto"``: pp × dp, micro-batches, schedule, cuts, kinds.

:func:`search_plan` takes the ranks of a job (their device kinds), the batch one step trains on and
what the user fixed, and returns the plan with the smallest predicted step time among all of

* ``pp`` × ``dp`` = world size, ``pp = 1`` included (plain data parallelism: every rank holds the
  whole model, whatever its kind);
* ``n_microbatches`` ``m``: every divisor of the per-replica batch up to ``max_microbatches``;
* every schedule the runtime runs (:data:`~lightning_hpp.pipeline.schedules.SCHEDULES`): ``gpipe``
  and ``1f1b`` with one stage per rank; ``interleaved1f1b``, ``looped_bfs`` and ``interleaved_zb``
  with ``v`` = 2 .. :data:`MAX_STAGES_PER_RANK` stages per rank, stage ``s`` on rank ``s mod pp``;
  ``zbv`` and ``dualpipev`` with two stages per rank in the V (rank ``r`` holds stages ``r`` and
  ``2 pp - 1 - r``) — each where torch can build it (1F1B and DualPipeV need ``m >= stages``, the
  interleaved ones ``m`` a multiple of their rounds);
* the contiguous cuts of the units into ``pp * v`` stages, the device kind of every position (each
  on ``dp`` ranks of one kind when ``pp > 1``; a position's stages share its kind), and the
  precision where the profile has several for a kind;
* the data-parallel mode of the stages' replicas (``data_parallel``): fixed by the caller (``"ddp"``,
  the default; ``"fsdp"``: every candidate's stages sharded over its ``dp`` replicas; ``"hsdp"``: over
  ``dp / dp_replicate`` of them, candidates whose ``dp`` ``dp_replicate`` does not divide excluded), or
  ``None``: memory decides. Then every structure (pp, dp, m, schedule, v, kinds) is searched with
  ``"ddp"`` first, and only where no cut of it fits with ``dp > 1``, with ``"fsdp"`` over its ``dp``
  replicas (``reshard_after_forward=False``; ``pp = 1`` is FSDP alone); fsdp is not tried where a
  kind's costs are fp8 (sharded stages do not take fp8 yet). Between a ddp and an fsdp version of one
  structure that both fit, ddp is the one kept; across structures, the step time decides.

The batch: ``batch_size`` is what one *data group* draws per step (the DataLoader's batch), and
``data_groups`` how many distinct batches the job draws per step. A plan with ``dp`` replicas
splits each data group's batch between ``dp / data_groups`` replicas, so every candidate trains on
the same global batch, ``batch_size * data_groups``.

The cost model, for micro-batches of ``b = batch_size / (dp / data_groups) / m`` samples. A stage
holding units ``[i, j)`` on kind ``k`` costs, per micro-batch and action::

    F_s = sum_units fwd_share * (F_u + V_u * b) + c_mb / 2 + [last] L / 3 + [output to another rank] msg_out
    B_s = sum_units bwd_share * (F_u + V_u * b) + c_mb / 2 + [last] 2 L / 3 + [input from another rank] msg_in
    W_s = half of the units' backward,  I_s = B_s - W_s          (the zero-bubble schedules' split)
    msg = latency + bytes * b / b0 / bandwidth

and the step is::

    step = replay(schedule's action order, F/B/I/W per stage) + max_rank u_rank + c_step
    u_rank = max(a(first unit of its first stage), sum over its stages of a_s - o * backward_s) + optimizer_ms_per_byte * params
    a_s  = 2 (dp - 1) / dp * params_s / allreduce_bandwidth + 2 (dp - 1) * latency

(the gradient all-reduce starts bucket by bucket during each stage's last backward,
:mod:`~lightning_hpp.pipeline.grads`: the step waits for what the backward of one micro-batch does
not hide, and at least for the bucket of the rank's first unit, whose gradients come last; ``o`` is the
kind's ``Overheads.allreduce_overlap``: 1 where the reduction runs beside the backward, as NCCL's on a GPU,
0 on CPU ranks, where gloo sums on the cores the backward computes on and hides nothing)

``replay`` is the makespan of torch's own per-rank order of the schedule
(:mod:`~lightning_hpp.planning.replay`, the order :func:`lightning_hpp.telemetry.model.simulate`
replays): every action starts when its rank is free and what it waits for has finished. ``F_u`` is
the unit's fixed time per micro-batch (weights re-read, kernels launched), ``V_u`` its time per
sample, both from the profile at micro-batch size ``b0`` (``UnitCost.fixed_ms``), split between
forward and backward as the profile's ``fwd_ms`` and ``bwd_ms``; ``c_mb`` / ``c_step`` the
schedule's fixed cost per micro-batch and per step, ``L`` the loss on the last stage (all from the
kind's :class:`~lightning_hpp.planning.profile.Overheads`). With ``pp = 1`` (one stage, ``m``
micro-batches in turn) the step is ``m * (F + B) + u + c_step``, the slowest kind's where the ranks
have several. Sharded stages (fsdp, hsdp over ``dp_shard`` ranks) add FSDP2's all-gather of their
parameters to ``u_rank``, not overlapped, with the ring's terms::

    g_s = gathers * ((dp_shard - 1) / dp_shard * params_s / allreduce_bandwidth + (dp_shard - 1) * latency)

(``gathers`` = 1 per step, ``2 m`` with ``reshard_after_forward=True``), and keep the gradient
reduction's ``a_s`` as ddp's: a sharded version of a structure is never faster than its ddp version.

Memory: every rank must fit its stages' parameters, gradients and optimizer state plus the peak,
over its order, of the activations its stages keep for micro-batches whose backward has not run
(``saved_bytes * b / b0`` each), by :func:`~lightning_hpp.planning.memory.stage_memory_bytes` with the
rank's stages taken together: ``params * (1 + optimizer_factor)`` unsharded, ``params * (1 +
optimizer_factor) / dp_shard + gathered`` sharded, where ``gathered`` is ``2 * params`` with several
micro-batches, and with one ``params`` plus the largest unit's (``2 *`` the largest unit's with
``reshard_after_forward=True``).

The search is exact for this model wherever a structure (pp, dp, m, schedule, v, kinds) has at
most :data:`EXACT_CUTS` cuts: every one is replayed (in one batch). Beyond, it starts from the cuts
that minimise the slowest stage (the bottleneck programme of
:mod:`~lightning_hpp.planning.partition`) and moves one cut by one unit at a time while the replayed
step falls. Tests compare it with brute force over torch's orders.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from lightning_hpp.errors import PartitionError, PlacementError, ScheduleError
from lightning_hpp.pipeline.schedules import SCHEDULES, check_schedule
from lightning_hpp.planning.devices import assign_ranks, normalize_kind, stage_kind_orders
from lightning_hpp.planning.memory import stage_memory_bytes
from lightning_hpp.planning.partition import (
    _INF,
    DEFAULT_LINK_GBPS,
    DeviceGroup,
    KindCosts,
    PartitionResult,
    StageEstimate,
    _bottleneck,
    _choose_costs,
    _in_flight,
    _precision_map,
    _Problem,
    _ring,
)
from lightning_hpp.planning.profile import CostProfile, Overheads
from lightning_hpp.planning.replay import Program, program
from lightning_hpp.validation import check_int

MAX_MICROBATCHES = 32
"""Largest number of micro-batches the search tries when the user does not fix it."""

MAX_STAGES_PER_RANK = 4
"""Most stages per rank the search gives the looped schedules (``interleaved1f1b``, ``looped_bfs``, ``interleaved_zb``)."""

EXACT_CUTS = 4096
"""Structures with at most this many cuts are searched exhaustively; larger ones by local search."""

DATA_PARALLEL_MODES = ("ddp", "fsdp", "hsdp")
"""The data-parallel modes ``search_plan(data_parallel=...)`` takes (``None``: ddp, or fsdp where memory decides)."""

SEARCHED_SCHEDULES = tuple(SCHEDULES)
"""Every schedule the runtime runs, in the order ties are broken (fewer stages, then this order)."""

_PREFERENCE = ("1f1b", "gpipe", "interleaved1f1b", "zbv", "interleaved_zb", "looped_bfs", "dualpipev")

# our names, torch's registry names and class names, lower case: "ZBVZeroBubble" and "zbv" are one schedule
_ALIASES = {alias.lower().replace("_", ""): name for name, kind in SCHEDULES.items()
            for alias in (name, kind.cls.__name__, kind.cls.__name__.removeprefix("Schedule"))}

_NONE = Overheads()


def schedule_name(schedule: str) -> str | None:
    """Our name of a schedule given as ours or torch's (any case), ``None`` if unknown."""
    return _ALIASES.get(str(schedule).lower().replace("_", "").replace("-", ""))


def stages_per_rank_options(schedule: str, pp: int, n_units: int) -> list[int]:
    """The ``v`` the search tries for a schedule: 1, 2 for the V, 2 .. :data:`MAX_STAGES_PER_RANK` looped."""
    kind = SCHEDULES[schedule]
    if not kind.multi:
        return [1]
    top = 2 if kind.style == "v" else MAX_STAGES_PER_RANK
    return [v for v in range(2, top + 1) if pp * v <= n_units]


def microbatch_options(per_replica: int, fixed: int | None, pp: int, schedule: str, limit: int, v: int = 1) -> list[int]:
    """The micro-batch counts to try: the divisors of ``per_replica`` up to ``limit`` (or ``fixed``) that
    the schedule can run with ``pp * v`` stages."""
    if fixed is not None:
        ms = [fixed] if per_replica % fixed == 0 else []
    else:
        ms = [m for m in range(1, min(per_replica, limit) + 1) if per_replica % m == 0]
    out = []
    for m in ms:
        try:
            check_schedule(schedule, pp * v, pp, m)
        except ScheduleError:
            continue
        out.append(m)
    return out


@dataclasses.dataclass
class _PlanProblem(_Problem):
    """:class:`~lightning_hpp.planning.partition._Problem` at micro-batch size ``b = scale * b0``,
    with the fixed costs, the loss, message latency and the optimizer of the module docstring, for stages
    sharded over ``dp_shard`` ranks (1: unsharded) with FSDP2's ``reshard_after_forward``."""

    scale: float = 1.0
    dp_shard: int = 1
    reshard_after_forward: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.n
        i = np.arange(n + 1)[:, None]
        j = np.arange(n + 1)[None, :]
        self._messages = (i > 0).astype(float) + (j < n).astype(float)
        self._actions = [self._action_parts(k) for k in range(len(self.costs))]

    def _oh(self, k: int) -> Overheads:
        return self.costs[k].overheads or _NONE

    def _bandwidth(self, k: int) -> float:
        oh = self._oh(k)
        return (oh.p2p_gbps or self.groups[k].link_gbps) * 1e6  # bytes per ms

    def _action_parts(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float, float]:
        """Forward and backward compute of every segment, the message out at ``j`` and back at ``i``, and
        the per-micro-batch, loss-forward and loss-backward costs."""
        costs, oh = self.costs[k], self._oh(k)
        unit = costs.fixed_ms + (costs.step_ms - costs.fixed_ms) * self.scale
        share = np.divide(costs.fwd_ms, costs.step_ms, out=np.full(self.n, 1 / 3), where=costs.step_ms > 0)
        fw = np.concatenate([[0.0], np.cumsum(unit * share)])
        bw = np.concatenate([[0.0], np.cumsum(unit * (1 - share))])
        fwd, bwd = fw[None, :] - fw[:, None], bw[None, :] - bw[:, None]
        act = np.asarray(costs.activation_bytes, dtype=float) * self.scale / self._bandwidth(k)
        out = np.zeros(self.n + 1)
        out[1:self.n] = act[: self.n - 1] + oh.p2p_latency_ms
        back = np.zeros(self.n + 1)
        back[1:] = act + oh.p2p_latency_ms
        loss = oh.loss_fixed_ms + (oh.loss_ms - oh.loss_fixed_ms) * self.scale
        return fwd, bwd, out, back, oh.microbatch_ms, loss / 3, 2 * loss / 3

    def lower_bound(self, position_kinds: Sequence[int], n_stages: int, m: int) -> float:
        """A bound below the step of every cut of a layout: the busiest rank works at least the mean of all
        ranks' work (each unit at the fastest of the positions' kinds, every stage's fixed cost per
        micro-batch, the loss), and the fixed step cost is paid."""
        used = sorted(set(position_kinds))
        u = np.arange(self.n)
        fastest = np.min([self._actions[k][0][u, u + 1] + self._actions[k][1][u, u + 1] for k in used], axis=0).sum()
        per_mb = min(self._actions[k][4] for k in used) * n_stages + min(self._actions[k][5] + self._actions[k][6] for k in used)
        fixed = max((self.costs[k].overheads or _NONE).step_ms for k in used)
        return m * (float(fastest) + per_mb) / len(position_kinds) + fixed

    def parts(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(compute_ms, comm_ms)`` of every segment on kind ``k`` with both boundaries sent (``inf`` where invalid)."""
        fwd, bwd, out, back, mb, lf, lb = self._actions[k]
        compute = fwd + bwd + mb
        compute[:, self.n] += lf + lb
        talk = back[:, None] + out[None, :]
        return np.where(self._invalid, _INF, compute), np.where(self._invalid, _INF, talk)

    def time(self, k: int) -> np.ndarray:
        compute, talk = self.parts(k)
        return compute + talk

    def held(self, params: np.ndarray, largest: np.ndarray | None, activations: np.ndarray | float, m: int) -> np.ndarray:
        """What one rank holds for ``params`` bytes of parameters (of which the largest unit's ``largest``)
        and ``activations`` bytes kept for the backward, under this problem's sharding
        (:func:`~lightning_hpp.planning.memory.stage_memory_bytes`)."""
        return stage_memory_bytes(params, self.optimizer_factor, 1, activations, dp_shard=self.dp_shard,
                                  n_microbatches=m, reshard_after_forward=self.reshard_after_forward,
                                  largest_unit_bytes=largest)

    def largest(self, k: int) -> np.ndarray:
        """The largest unit's parameter bytes of every segment ``[i, j)`` on kind ``k``."""
        units = np.asarray(self.costs[k].param_bytes, dtype=float)
        out = np.zeros((self.n + 1, self.n + 1))
        for i in range(self.n):
            out[i, i + 1:] = np.maximum.accumulate(units[i:])
        return out

    def memory(self, k: int, s: int, p: int, m: int) -> np.ndarray:
        _, _, params, stash = self._mats[k]
        largest = self.largest(k) if self.dp_shard > 1 and m == 1 else None
        return self.held(params, largest, _in_flight(self.schedule, s, p, m) * stash * self.scale, m)

    def optimizer(self, k: int) -> np.ndarray:
        return self._mats[k][2] / 1e6 * self._oh(k).optimizer_ms_per_mb

    def ring(self, k: int, dp: int) -> np.ndarray:
        """The gradient all-reduce of every segment over ``dp`` replicas, not overlapped."""
        oh = self._oh(k)
        latency = 2 * (dp - 1) * oh.p2p_latency_ms  # a ring sends 2 (dp - 1) messages
        bandwidth = oh.allreduce_gbps * 1e6 if oh.allreduce_gbps else self._bandwidth(k)
        return _ring(dp) * self._mats[k][2] / bandwidth + latency

    def gather(self, k: int, m: int) -> np.ndarray:
        """FSDP2's all-gathers of every segment's parameters over the ``dp_shard`` ranks it is sharded over, per
        step and not overlapped (0 unsharded): once, or for every micro-batch's forward and backward with
        ``reshard_after_forward``; each with the ring's terms, one way."""
        s = self.dp_shard
        if s <= 1:
            return np.zeros_like(self._mats[k][2])
        oh = self._oh(k)
        bandwidth = oh.allreduce_gbps * 1e6 if oh.allreduce_gbps else self._bandwidth(k)
        gathers = 2 * m if self.reshard_after_forward else 1
        return gathers * ((s - 1) / s * self._mats[k][2] / bandwidth + (s - 1) * oh.p2p_latency_ms)

    def allreduce(self, k: int, dp: int, m: int = 1) -> np.ndarray:
        return self.ring(k, dp) + self.gather(k, m) + self.optimizer(k)

    def exposed(self, k: int, dp: int, i: int, j: int, m: int = 1) -> float:
        """What of segment ``[i, j)``'s all-reduce the step waits for: its buckets start during the last
        micro-batch's backward, the first unit's (final last) after it; and a sharded stage's all-gathers."""
        ring = self.ring(k, dp)
        gather = float(self.gather(k, m)[i, j])
        window = self._oh(k).allreduce_overlap * self._actions[k][1][i, j]
        return max(float(ring[i, i + 1]), float(ring[i, j] - window)) + gather if dp > 1 else 0.0

    def update_free(self, dp: int) -> bool:
        return dp == 1 and all(self._oh(k).optimizer_ms_per_mb == 0 for k in range(len(self.costs)))

    def estimate(self, k: int, i: int, j: int, s: int, p: int, m: int, dp: int, names: Sequence[str]) -> StageEstimate:
        compute, talk = self.parts(k)
        opt = float(self.optimizer(k)[i, j])
        return StageEstimate(
            units=list(names[i:j]),
            device=self.groups[k].kind,
            precision=self.costs[k].precision,
            compute_ms=float(compute[i, j]),
            comm_ms=float(talk[i, j]),
            allreduce_ms=float(self.allreduce(k, dp, m)[i, j]) - opt,
            memory_bytes=float(self.memory(k, s, p, m)[i, j]),
            memory_limit=self.groups[k].memory_limit,
            in_flight=_in_flight(self.schedule, s, p, m),
            cost_source=self.costs[k].source,
            optimizer_ms=opt,
        )


def _data_parallel(
    problem: _PlanProblem, m: int, dp: int, names: Sequence[str], kinds: list[int]
) -> PartitionResult | None:
    """``pp = 1``: the whole model on every rank; the slowest kind sets the step."""
    n = problem.n
    ests = [problem.estimate(k, 0, n, 0, 1, m, dp, names) for k in kinds]
    if any(not e.fits for e in ests):
        return None
    for k, e in zip(kinds, ests):  # the all-reduce overlaps the last micro-batch's backward
        e.allreduce_ms = problem.exposed(k, dp, 0, n, m)
    slowest = max(ests, key=lambda e: (e.stage_ms, e.allreduce_ms + e.optimizer_ms))
    est = dataclasses.replace(slowest)
    update = max(ests, key=lambda e: e.allreduce_ms + e.optimizer_ms)  # the slowest kind's update
    est.allreduce_ms, est.optimizer_ms = update.allreduce_ms, update.optimizer_ms
    est.memory_bytes = max(e.memory_bytes for e in ests)
    est.memory_limit = min(e.memory_limit for e in ests)
    if len(kinds) > 1:
        est.replica_kinds = [problem.groups[k].kind for k in kinds]
        est.device = "|".join(est.replica_kinds)
    return PartitionResult([est], problem.schedule, m, dp, dp_shard=problem.dp_shard)


@dataclasses.dataclass
class _Scored:
    """Candidate cuts ``(C, S + 1)`` of one structure and their predicted steps (``inf``: does not fit)."""

    cuts: np.ndarray
    step: np.ndarray
    pipeline: np.ndarray
    update: np.ndarray
    memory: np.ndarray  # (C, pp)
    costs: np.ndarray  # (C, 4, S)


class _Pipeline:
    """One structure (schedule program, dp, the kind of every position) of a :class:`_PlanProblem`."""

    def __init__(self, problem: _PlanProblem, prog: Program, position_kinds: Sequence[int], dp: int) -> None:
        self.problem, self.prog, self.dp = problem, prog, dp
        self.kinds = [position_kinds[prog.rank_of[s]] for s in range(prog.n_stages)]
        self.position_kinds = list(position_kinds)
        self.cross_out, self.cross_in = prog.cross_out(), prog.cross_in()
        self.updates = {k: problem.allreduce(k, dp, prog.m) for k in set(self.kinds)}
        self.rings = {k: problem.ring(k, dp) for k in set(self.kinds)}
        self.gathers = {k: problem.gather(k, prog.m) for k in set(self.kinds)}
        one = problem.dp_shard > 1 and prog.m == 1  # one micro-batch: the largest unit bounds what is gathered
        self.largest = {k: problem.largest(k) for k in set(self.kinds)} if one else None
        self.optimizers = {k: problem.optimizer(k) for k in set(self.kinds)}
        self.first_of = [min(prog.stages_of(r)) for r in range(prog.pp)]
        self.fixed = max((problem.costs[k].overheads or _NONE).step_ms for k in set(self.kinds))

    def score(self, cuts: np.ndarray) -> _Scored:
        pr, prog, n, S = self.problem, self.prog, self.problem.n, self.prog.n_stages
        C = cuts.shape[0]
        costs = np.zeros((C, 4, S))
        params = np.zeros((C, S))
        stash = np.zeros((C, S))
        largest = np.zeros((C, S))
        ring, window, tail, update, gather = (np.zeros((C, prog.pp)) for _ in range(5))
        for s, k in enumerate(self.kinds):
            i, j = cuts[:, s], cuts[:, s + 1]
            fwd, bwd, out, back, mb, lf, lb = pr._actions[k]
            last = j == n
            f = fwd[i, j] + mb / 2 + last * lf + (out[j] if self.cross_out[s] else 0.0)
            b = bwd[i, j] + mb / 2 + last * lb + (back[i] if self.cross_in[s] else 0.0)
            w = bwd[i, j] / 2
            costs[:, 0, s], costs[:, 1, s], costs[:, 2, s], costs[:, 3, s] = f, b, b - w, w
            _, _, par, st = pr._mats[k]
            params[:, s], stash[:, s] = par[i, j], st[i, j] * pr.scale
            if self.largest is not None:
                largest[:, s] = self.largest[k][i, j]
            r = prog.rank_of[s]
            ring[:, r] += self.rings[k][i, j]
            gather[:, r] += self.gathers[k][i, j]
            window[:, r] += bwd[i, j] * pr._oh(k).allreduce_overlap
            update[:, r] += self.optimizers[k][i, j]
            if s == self.first_of[r]:  # its first unit's gradients are the rank's last ones
                tail[:, r] = self.rings[k][i, i + 1]
        # the all-reduce overlaps each stage's last backward (pipeline/grads.py): the step waits for what is left
        update += np.maximum(tail, ring - window) + gather if self.dp > 1 else 0.0
        memory = prog.peak_memory(stash)
        fits = np.ones(C, dtype=bool)
        for r in range(prog.pp):
            k, own = self.position_kinds[r], list(prog.stages_of(r))
            memory[:, r] = pr.held(params[:, own].sum(axis=1), largest[:, own].max(axis=1), memory[:, r], prog.m)
            fits &= memory[:, r] <= pr.groups[k].memory_limit
        pipeline = prog.makespan(costs)
        upd = update.max(axis=1)
        step = np.where(fits, pipeline + upd + self.fixed, _INF)
        return _Scored(cuts, step, pipeline, upd, memory, costs)

    def seed(self) -> np.ndarray | None:
        """The cuts that minimise the slowest stage (both boundaries sent), ignoring memory."""
        pr, S = self.problem, self.prog.n_stages
        K = len(pr.costs)
        times = {k: pr.time(k) for k in set(self.kinds)}
        blocked = np.full((pr.n + 1, pr.n + 1), _INF)
        sol = _bottleneck(pr.n, S, [S] * K, lambda k, s: times[k] if k == self.kinds[s] else blocked)
        return None if sol is None else np.array([sol[1]])

    def best(self) -> tuple[int, _Scored] | None:
        """The best candidate (index into the returned batch), exhaustive or by local search."""
        n, S = self.problem.n, self.prog.n_stages
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
            current, scored = trial.cuts[i : i + 1], _take(trial, i)
        return (0, scored) if np.isfinite(scored.step[0]) else None

    def result(self, i: int, scored: _Scored, m: int, names: Sequence[str], schedule: str) -> PartitionResult:
        pr, prog, dp = self.problem, self.prog, self.dp
        cuts = [int(c) for c in scored.cuts[i]]
        held = prog.in_flight()
        stages = []
        for s, k in enumerate(self.kinds):
            a, b = cuts[s], cuts[s + 1]
            f, bk = scored.costs[i, 0, s], scored.costs[i, 1, s]
            fwd, bwd, out, back, mb, lf, lb = pr._actions[k]
            compute = float(fwd[a, b] + bwd[a, b] + mb + (lf + lb if b == pr.n else 0.0))
            opt = float(pr.optimizer(k)[a, b])
            r = prog.rank_of[s]
            stages.append(StageEstimate(
                units=list(names[a:b]), device=pr.groups[k].kind, precision=pr.costs[k].precision,
                compute_ms=compute, comm_ms=float(f + bk) - compute,
                allreduce_ms=float(self.updates[k][a, b]) - opt, optimizer_ms=opt,
                memory_bytes=float(scored.memory[i, r]), memory_limit=pr.groups[k].memory_limit,
                in_flight=held[s], cost_source=pr.costs[k].source,
            ))
        res = PartitionResult(stages, schedule, m, dp, dp_shard=pr.dp_shard, fixed_step_ms=self.fixed,
                              stages_per_rank=prog.stages_per_rank,
                              positions=list(prog.rank_of), pipeline_ms=float(scored.pipeline[i]),
                              update_ms=float(scored.update[i]),
                              replayed_bubble=float(prog.bubble(scored.costs[i : i + 1])[0]))
        return res


def _take(scored: _Scored, i: int) -> _Scored:
    sl = slice(i, i + 1)
    return _Scored(scored.cuts[sl], scored.step[sl], scored.pipeline[sl], scored.update[sl], scored.memory[sl],
                   scored.costs[sl])


def search_plan(
    profile: CostProfile,
    rank_kinds: Sequence[str],
    *,
    batch_size: int,
    data_groups: int = 1,
    pp_degree: int | None = None,
    n_microbatches: int | None = None,
    schedule: str | None = None,
    precision: str | Mapping[str, str] | None = None,
    optimizer_factor: float = 3.0,
    memory_bytes: Mapping[str, float] | None = None,
    link_gbps: float = DEFAULT_LINK_GBPS,
    max_microbatches: int = MAX_MICROBATCHES,
    split_batches: bool = True,
    data_parallel: str | None = "ddp",
    dp_replicate: int | None = None,
    reshard_after_forward: bool = False,
) -> PartitionResult:
    """The fastest plan for these ranks under the cost model of the module docstring.

    Args:
        profile: Unit costs (and :class:`~lightning_hpp.planning.profile.Overheads` per entry) at
            the micro-batch size of ``profile.input_shapes``.
        rank_kinds: The kind of every global rank (index = rank).
        batch_size: Samples each data group draws per step (the DataLoader's batch).
        data_groups: Distinct batches per step; every plan's ``dp`` must be a multiple of it.
        pp_degree, n_microbatches, schedule: Values the user fixed (``None``: searched).
        precision: As for :func:`~lightning_hpp.planning.partition.partition`.
        optimizer_factor: Bytes of gradients plus optimizer state per parameter byte.
        memory_bytes: Memory per device by kind (default: datasheet, unlimited for ``cpu``).
        link_gbps: Link speed where the profile has no measured point-to-point bandwidth.
        max_microbatches: Largest ``m`` tried when ``n_microbatches`` is not fixed.
        split_batches: Whether a data group's batch may be split between several replicas (the
            loader can be rebatched); ``False`` keeps ``dp == data_groups``.
        data_parallel: The stages' data-parallel mode, one of :data:`DATA_PARALLEL_MODES` (fixed, as
            ``ShardingOptions(data_parallel=...)``), or ``None``: ddp, and fsdp where no cut of a structure
            fits with ddp (the module docstring).
        dp_replicate: ``"hsdp"``'s replica groups (each stage sharded over ``dp / dp_replicate`` ranks).
        reshard_after_forward: FSDP2's choice for fixed sharded stages (``None``'s fsdp takes ``False``).

    Returns:
        The best plan; ``result.ranks`` is its rank grid ``ranks[stage][replica]``, ``result.data_parallel``
        and ``result.dp_shard`` how its stages' replicas share them. Ties go to fewer stages, then fewer
        micro-batches, then 1F1B (fewer micro-batches in flight).

    Raises:
        PartitionError: no candidate satisfies the constraints or fits in memory (the message says
            which constraint excluded what).
    """
    names = list(profile.unit_names)
    world = len(rank_kinds)
    for name, value in (
        ("batch_size", batch_size),
        ("data_groups", data_groups),
        ("max_microbatches", max_microbatches),
    ):
        check_int(value, f"search_plan({name}=...)", error=PartitionError)
    _check_sharding(data_parallel, dp_replicate)
    if profile.microbatch_size is None:
        raise PartitionError(
            "The profile records no input shape, so its micro-batch size is unknown; profile the model on a real batch."
        )
    if schedule is not None:
        name = schedule_name(schedule)
        if name is None:
            raise PartitionError(
                f"plan='auto' searches the schedules {', '.join(SEARCHED_SCHEDULES)} (or torch's names for them); "
                f"schedule={schedule!r} was fixed. Leave `schedule` unset to let the search choose, or fix one of those."
            )
        schedules = [name]
    else:
        schedules = list(SEARCHED_SCHEDULES)
    have = [normalize_kind(k, f"rank {r} kind") for r, k in enumerate(rank_kinds)]
    kinds = sorted(set(have))
    mem = dict(memory_bytes or {})
    groups = [DeviceGroup(k, have.count(k), mem.get(k), link_gbps) for k in kinds]
    fixed = _precision_map(precision, kinds)
    costs: list[KindCosts] = [_choose_costs(profile, k, fixed[k]) for k in kinds]
    n = len(names)
    pps = [pp_degree] if pp_degree is not None else [p for p in range(1, min(n, world) + 1) if world % p == 0]
    b0 = profile.microbatch_size
    fp8 = sorted(c.kind for c in costs if c.precision == "fp8")
    tried = _modes_text(data_parallel, dp_replicate, fp8)

    best: tuple[tuple, PartitionResult] | None = None
    excluded: list[str] = []
    for p in pps:
        if world % p or p > n:
            excluded.append(f"pp={p}: needs pp <= {n} units and a divisor of the world size {world}")
            continue
        dp = world // p
        if not split_batches and dp != data_groups:
            excluded.append(f"pp={p}: dp={dp} replicas would split the loader's batches, which cannot be rebatched")
            continue
        if dp % data_groups or batch_size % (dp // data_groups):
            excluded.append(f"pp={p}: dp={dp} replicas cannot split {data_groups} batch(es) of {batch_size} evenly")
            continue
        per_replica = batch_size // (dp // data_groups)
        modes = _sharding_modes(data_parallel, dp, dp_replicate, fp8)
        if isinstance(modes, str):
            excluded.append(f"pp={p}: {modes}")
            continue
        if p == 1:
            orders: list[list[str]] = [kinds]
        else:
            try:
                orders = stage_kind_orders(have, p, dp)
            except PlacementError:
                orders = []
            if not orders:
                excluded.append(f"pp={p}: the ranks' kinds cannot form {dp} replicas with one kind per stage")
                continue
        if p == 1 and all(SCHEDULES[x].multi for x in schedules):
            excluded.append(f"pp=1: one stage cannot run {schedules[0]!r}, which holds several stages per rank")
        for sched in schedules if p > 1 else [x for x in schedules if not SCHEDULES[x].multi]:
            vs = stages_per_rank_options(sched, p, n)
            if not vs:
                excluded.append(f"pp={p}, {sched}: needs at least {2 * p} stages, more than the model's {n} units")
            for v in vs:
                ms = microbatch_options(per_replica, n_microbatches, p, sched, max_microbatches, v)
                if not ms:
                    excluded.append(
                        f"pp={p}, {sched}, {v} stage(s) per rank: no micro-batch count (fixed {n_microbatches!r}) "
                        f"divides {per_replica} samples per replica and runs under the schedule"
                    )
                for m in ms:
                    problem = _PlanProblem(costs, groups, sched, optimizer_factor, None, scale=per_replica / m / b0)
                    sharded = {shard: problem if shard == 1 else dataclasses.replace(
                        problem, dp_shard=shard, reshard_after_forward=reshard_after_forward) for _, shard in modes}
                    label = ", ".join(mode if shard == 1 else f"{mode} over {shard}" for mode, shard in modes)
                    cands = []
                    if p == 1:
                        for mode, shard in modes:  # the first mode whose whole model fits
                            res = _data_parallel(sharded[shard], m, dp, names, [kinds.index(k) for k in orders[0]])
                            if res is not None:
                                res.data_parallel = mode
                                break
                        if res is None:
                            excluded.append(f"pp=1, m={m}: the whole model does not fit one device ({label})")
                            continue
                        res.ranks = [list(range(world))]
                        res.fixed_step_ms = max((costs[kinds.index(k)].overheads or _NONE).step_ms for k in orders[0])
                        cands = [res]
                    else:
                        prog = None
                        for order in orders:
                            ks = [kinds.index(k) for k in order]
                            if best is not None and problem.lower_bound(ks, p * v, m) > best[1].step_ms:
                                continue  # no cut of this layout can beat the best plan so far
                            prog = prog or program(sched, p, p * v, m)
                            for mode, shard in modes:  # the first mode in which a cut of this layout fits
                                pipe = _Pipeline(sharded[shard], prog, ks, dp)
                                found = pipe.best()
                                if found is not None:
                                    res = pipe.result(*found, m, names, sched)
                                    res.data_parallel = mode
                                    res.ranks = assign_ranks(list(order), have, p, dp)
                                    cands.append(res)
                                    break
                        if not cands:
                            excluded.append(f"pp={p}, {sched}, v={v}, m={m}: no cut fits in memory ({label})")
                    for res in cands:
                        res.microbatch_size = per_replica // m
                        res.label = "auto"
                        key = (round(res.step_ms, 9), p, v, m, _PREFERENCE.index(res.schedule))
                        if best is None or key < best[0]:
                            best = (key, res)
    if best is None:
        why = "; ".join(excluded) or "no candidates"
        raise PartitionError(
            f"plan='auto' found no plan for {world} rank(s) ({', '.join(have)}) with batch_size={batch_size}, "
            f"pp_degree={pp_degree!r}, n_microbatches={n_microbatches!r}, schedule={schedule!r}, data parallel "
            f"{tried}: {why}. Relax a fixed value, or change the batch size."
        )
    result = best[1]
    result.notes.append(
        f"searched: pp in {pps}, schedules {schedules} (up to {MAX_STAGES_PER_RANK} stages per rank), m up to "
        f"{n_microbatches or max_microbatches}, data parallel {tried}, "
        f"global batch {batch_size * data_groups}; chose data_parallel={result.data_parallel}"
    )
    return result


def _check_sharding(data_parallel: str | None, dp_replicate: int | None) -> None:
    if data_parallel is not None and data_parallel not in DATA_PARALLEL_MODES:
        raise PartitionError(f"search_plan(data_parallel={data_parallel!r}): use one of {DATA_PARALLEL_MODES}, or None "
                             f"(ddp, and fsdp where only sharded stages fit).")
    if (data_parallel == "hsdp") != (dp_replicate is not None):
        raise PartitionError(f"search_plan(data_parallel={data_parallel!r}, dp_replicate={dp_replicate!r}): "
                             f"dp_replicate is hsdp's number of replica groups; give it with data_parallel='hsdp' only.")
    if dp_replicate is not None:
        check_int(dp_replicate, "search_plan(dp_replicate=...)", error=PartitionError)


def _sharding_modes(data_parallel: str | None, dp: int, dp_replicate: int | None,
                    fp8: Sequence[str]) -> list[tuple[str, int]] | str:
    """The ``(mode, dp_shard)`` to try for a structure with ``dp`` replicas, in order (the first that fits
    is kept), or why no mode can run it."""
    if data_parallel == "fsdp":
        return [("fsdp", dp)]
    if data_parallel == "hsdp":
        assert dp_replicate is not None
        if dp % dp_replicate:
            return f"dp={dp} replicas cannot form dp_replicate={dp_replicate} hsdp groups of equal size"
        return [("hsdp", dp // dp_replicate)]
    if data_parallel is None and dp > 1 and not fp8:
        return [("ddp", 1), ("fsdp", dp)]
    return [("ddp", 1)]


def _modes_text(data_parallel: str | None, dp_replicate: int | None, fp8: Sequence[str]) -> str:
    """What the search tries for the stages' replicas, for the table and the no-plan error."""
    if data_parallel == "hsdp":
        return f"hsdp (dp_replicate={dp_replicate})"
    if data_parallel is not None:
        return str(data_parallel)
    if fp8:
        return f"ddp only (fsdp not tried: {', '.join(fp8)} run fp8, which sharded stages do not take yet)"
    return "ddp, or fsdp over the dp replicas where no ddp cut fits"
