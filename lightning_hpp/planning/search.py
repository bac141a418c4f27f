"""One search over the whole plan behind ``plan="auto"``: pp × dp, micro-batches, schedule, cuts, kinds.

:func:`search_plan` takes the ranks of a job (their device kinds), the batch one step trains on and
what the user fixed, and returns the plan with the smallest predicted step time among all of

* ``pp`` × ``dp`` = world size, ``pp = 1`` included (plain data parallelism: every rank holds the
  whole model, whatever its kind);
* ``n_microbatches`` ``m``: every divisor of the per-replica batch up to ``max_microbatches``;
* the schedule: ``gpipe`` and ``1f1b`` (one stage per rank; 1F1B needs ``m >= pp``);
* the contiguous cuts and the device kind of every stage (each stage on ``dp`` ranks of one
  kind when ``pp > 1``), and the precision where the profile has several for a kind.

The batch: ``batch_size`` is what one *data group* draws per step (the DataLoader's batch), and
``data_groups`` how many distinct batches the job draws per step. A plan with ``dp`` replicas
splits each data group's batch between ``dp / data_groups`` replicas, so every candidate trains on
the same global batch, ``batch_size * data_groups``.

The cost model, for micro-batches of ``b = batch_size / (dp / data_groups) / m`` samples::

    step = (m + p - 1) * max_s t_s + max_s u_s + c_step
    t_s  = sum_units (F_u + V_u * b) + c_mb + [last stage] (L_F + L_V * b)
           + messages_s * latency + bytes_s * b / b0 / bandwidth
    u_s  = 2 (dp - 1) / dp * params_s / allreduce_bandwidth + 2 (dp - 1) * latency + optimizer_ms_per_byte * params_s

``F_u`` is the unit's fixed time per micro-batch (weights re-read, kernels launched), ``V_u`` its
time per sample, both from the profile at micro-batch size ``b0`` (``UnitCost.fixed_ms``);
``c_mb`` / ``c_step`` the schedule's fixed cost per micro-batch and per step, ``L`` the loss on the
last stage, ``messages_s`` the boundaries the stage sends over (its output forward, its input
gradient backward) and ``u_s`` the update after the schedule (all taken from the kind's
:class:`~lightning_hpp.planning.profile.Overheads`). With ``pp = 1`` and ranks of several kinds the
step is the slowest kind's. Memory: every stage must fit
``params * (1 + optimizer_factor) + in_flight * saved_bytes * b / b0`` on its kind.

The search is exact for this model: every (pp, dp, m, schedule, stage-kind order) is enumerated
and, for each, :mod:`~lightning_hpp.planning.partition`'s dynamic programme finds the optimal cuts.
Tests compare it with brute force.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from lightning_hpp.errors import PartitionError, PlacementError
from lightning_hpp.planning.devices import assign_ranks, normalize_kind, stage_kind_orders
from lightning_hpp.planning.partition import (
    _INF,
    _SCHEDULE_ALIASES,
    DEFAULT_LINK_GBPS,
    MODELLED_SCHEDULES,
    DeviceGroup,
    KindCosts,
    PartitionResult,
    StageEstimate,
    _choose_costs,
    _in_flight,
    _precision_map,
    _Problem,
    _ring,
)
from lightning_hpp.planning.profile import CostProfile, Overheads
from lightning_hpp.validation import check_int

MAX_MICROBATCHES = 32
"""Largest number of micro-batches the search tries when the user does not fix it."""

_NONE = Overheads()


def microbatch_options(per_replica: int, fixed: int | None, pp: int, schedule: str, limit: int) -> list[int]:
    """The micro-batch counts to try: the divisors of ``per_replica`` up to ``limit`` (or ``fixed``),
    at least ``pp`` of them for 1F1B."""
    if fixed is not None:
        ms = [fixed] if per_replica % fixed == 0 else []
    else:
        ms = [m for m in range(1, min(per_replica, limit) + 1) if per_replica % m == 0]
    return [m for m in ms if schedule != "1f1b" or m >= pp]


@dataclasses.dataclass
class _PlanProblem(_Problem):
    """:class:`~lightning_hpp.planning.partition._Problem` at micro-batch size ``b = scale * b0``,
    with the fixed costs, the loss, message latency and the optimizer of the module docstring."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.n
        i = np.arange(n + 1)[:, None]
        j = np.arange(n + 1)[None, :]
        self._messages = (i > 0).astype(float) + (j < n).astype(float)

    def _oh(self, k: int) -> Overheads:
        return self.costs[k].overheads or _NONE

    def _bandwidth(self, k: int) -> float:
        oh = self._oh(k)
        return (oh.p2p_gbps or self.groups[k].link_gbps) * 1e6  # bytes per ms

    def parts(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(compute_ms, comm_ms)`` of every segment on kind ``k`` (``inf`` where invalid)."""
        comp, comm, _, _ = self._mats[k]
        costs, oh = self.costs[k], self._oh(k)
        fixed = costs._f[None, :] - costs._f[:, None]
        compute = fixed + (comp - fixed) * self.scale + oh.microbatch_ms
        loss = oh.loss_fixed_ms + (oh.loss_ms - oh.loss_fixed_ms) * self.scale
        compute[:, self.n] += loss
        talk = self._messages * oh.p2p_latency_ms + comm * self.scale / self._bandwidth(k)
        return np.where(self._invalid, _INF, compute), np.where(self._invalid, _INF, talk)

    def time(self, k: int) -> np.ndarray:
        compute, talk = self.parts(k)
        return compute + talk

    def memory(self, k: int, s: int, p: int, m: int) -> np.ndarray:
        _, _, params, stash = self._mats[k]
        return params * (1 + self.optimizer_factor) + _in_flight(self.schedule, s, p, m) * stash * self.scale

    def optimizer(self, k: int) -> np.ndarray:
        return self._mats[k][2] / 1e6 * self._oh(k).optimizer_ms_per_mb

    def allreduce(self, k: int, dp: int) -> np.ndarray:
        oh = self._oh(k)
        latency = 2 * (dp - 1) * oh.p2p_latency_ms  # a ring sends 2 (dp - 1) messages
        bandwidth = oh.allreduce_gbps * 1e6 if oh.allreduce_gbps else self._bandwidth(k)
        return _ring(dp) * self._mats[k][2] / bandwidth + latency + self.optimizer(k)

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
            allreduce_ms=float(self.allreduce(k, dp)[i, j]) - opt,
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
    slowest = max(ests, key=lambda e: (e.stage_ms, e.allreduce_ms + e.optimizer_ms))
    est = dataclasses.replace(slowest)
    update = max(ests, key=lambda e: e.allreduce_ms + e.optimizer_ms)  # the slowest kind's update
    est.allreduce_ms, est.optimizer_ms = update.allreduce_ms, update.optimizer_ms
    est.memory_bytes = max(e.memory_bytes for e in ests)
    est.memory_limit = min(e.memory_limit for e in ests)
    if len(kinds) > 1:
        est.replica_kinds = [problem.groups[k].kind for k in kinds]
        est.device = "|".join(est.replica_kinds)
    return PartitionResult([est], problem.schedule, m, dp)


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

    Returns:
        The best plan; ``result.ranks`` is its rank grid ``ranks[stage][replica]``. Ties go to fewer
        stages, then fewer micro-batches, then 1F1B (fewer micro-batches in flight).

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
    if profile.microbatch_size is None:
        raise PartitionError(
            "The profile records no input shape, so its micro-batch size is unknown; profile the model on a real batch."
        )
    if schedule is not None:
        key = str(schedule).lower()
        if _SCHEDULE_ALIASES.get(key) is None:
            raise PartitionError(
                f"plan='auto' models the schedules {', '.join(MODELLED_SCHEDULES)} (one stage per rank); "
                f"schedule={schedule!r} was fixed. Leave `schedule` unset to let the search choose, or write the "
                f"stage plan by hand."
            )
        schedules = [_SCHEDULE_ALIASES[key]]
    else:
        schedules = list(MODELLED_SCHEDULES)
    have = [normalize_kind(k, f"rank {r} kind") for r, k in enumerate(rank_kinds)]
    kinds = sorted(set(have))
    mem = dict(memory_bytes or {})
    groups = [DeviceGroup(k, have.count(k), mem.get(k), link_gbps) for k in kinds]
    fixed = _precision_map(precision, kinds)
    costs: list[KindCosts] = [_choose_costs(profile, k, fixed[k]) for k in kinds]
    n = len(names)
    pps = [pp_degree] if pp_degree is not None else [p for p in range(1, min(n, world) + 1) if world % p == 0]
    b0 = profile.microbatch_size

    best: tuple[tuple[float, int, int], PartitionResult] | None = None
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
        for sched in schedules:
            ms = microbatch_options(per_replica, n_microbatches, p, sched, max_microbatches)
            if not ms:
                excluded.append(
                    f"pp={p}, {sched}: no micro-batch count (fixed {n_microbatches!r}) divides {per_replica} "
                    f"samples per replica{' with m >= pp' if sched == '1f1b' else ''}"
                )
            for m in ms:
                problem = _PlanProblem(costs, groups, sched, optimizer_factor, None, scale=per_replica / m / b0)
                if p == 1:
                    res = _data_parallel(problem, m, dp, names, [kinds.index(k) for k in orders[0]])
                    if res is None:
                        excluded.append(f"pp=1, m={m}: the whole model does not fit one device")
                        continue
                    res.ranks = [list(range(world))]
                    res.fixed_step_ms = max((costs[kinds.index(k)].overheads or _NONE).step_ms for k in orders[0])
                    cands = [res]
                else:
                    cands = []
                    for order in orders:
                        problem.pinned = [kinds.index(k) for k in order]
                        sol = problem.solve(p, dp, m)
                        if sol is None:
                            continue
                        _, cuts, ks = sol
                        stages = [
                            problem.estimate(k, cuts[s], cuts[s + 1], s, p, m, dp, names) for s, k in enumerate(ks)
                        ]
                        res = PartitionResult(stages, sched, m, dp)
                        res.fixed_step_ms = max((costs[k].overheads or _NONE).step_ms for k in set(ks))
                        res.ranks = assign_ranks([s.device for s in stages], have, p, dp)
                        cands.append(res)
                    if not cands:
                        excluded.append(f"pp={p}, {sched}, m={m}: no cut fits in memory")
                for res in cands:
                    res.microbatch_size = per_replica // m
                    res.label = "auto"
                    key = (res.step_ms, p, m, sched != "1f1b")
                    if best is None or key < best[0]:
                        best = (key, res)
    if best is None:
        why = "; ".join(excluded) or "no candidates"
        raise PartitionError(
            f"plan='auto' found no plan for {world} rank(s) ({', '.join(have)}) with batch_size={batch_size}, "
            f"pp_degree={pp_degree!r}, n_microbatches={n_microbatches!r}, schedule={schedule!r}: {why}. Relax a fixed "
            f"value, or change the batch size."
        )
    result = best[1]
    result.notes.append(
        f"searched: pp in {pps}, schedules {schedules}, m up to {n_microbatches or max_microbatches}, "
        f"global batch {batch_size * data_groups}"
    )
    return result
