"""One search over the whole plan, behind ``plan="auto"`` and the planning CLI alike: the degrees (pp,
dp_replicate, dp_shard, tp), the schedule, the micro-batches, the cuts and the kind of every position.

:func:`search_plan` takes the ranks of a job (their device kinds, and the host each sits on), the batch one
step trains on and what the user fixed, and returns the plan with the smallest predicted step among all of

* ``pp × dp × tp`` = world size, ``pp = 1`` included (plain data parallelism: every rank holds the whole model,
  whatever its kind);
* ``tp``: the tensor-parallel degrees the model's plan divides (the profile's ``tp_degrees``; 1 where it has
  none), each group of ``tp`` neighbouring ranks of one kind and, unless ``tp_across_hosts``, on one host:
  a layer's all-reduces stay on the host's links;
* ``n_microbatches`` ``m``: every divisor of the per-replica batch up to ``max_microbatches``;
* every schedule the runtime runs (:data:`~lightning_hpp.pipeline.schedules.SCHEDULES`): ``gpipe``
  and ``1f1b`` with one stage per rank; ``interleaved1f1b``, ``looped_bfs`` and ``interleaved_zb``
  with ``v`` = 2 .. :data:`MAX_STAGES_PER_RANK` stages per rank, stage ``s`` on rank ``s mod pp``;
  ``zbv`` and ``dualpipev`` with two stages per rank in the V (rank ``r`` holds stages ``r`` and
  ``2 pp - 1 - r``) — each where torch can build it (1F1B and DualPipeV need ``m >= stages``, the
  interleaved ones ``m`` a multiple of their rounds);
* the contiguous cuts of the units into ``pp * v`` stages (:mod:`~lightning_hpp.planning.solver`), the device
  kind of every position (each on ``dp · tp`` ranks of one kind when ``pp > 1``; a position's stages share its
  kind), and the precision where the profile has several for a kind;
* the data-parallel mode of the stages' replicas (``data_parallel``): fixed by the caller (``"ddp"``,
  the default; ``"fsdp"``: every candidate's stages sharded over its ``dp`` replicas; ``"hsdp"``: over
  ``dp / dp_replicate`` of them, candidates whose ``dp`` ``dp_replicate`` does not divide excluded), or
  ``None``: memory decides. Then every structure is searched with ``"ddp"`` first, and only where no cut of it
  fits with ``dp > 1``, with ``"fsdp"`` over its ``dp`` replicas (``reshard_after_forward=False``; ``pp = 1`` is
  FSDP alone). fsdp and tp are not tried where a kind's costs are fp8 (neither takes fp8 stages yet). Between a
  ddp and an fsdp version of one structure that both fit, ddp is the one kept; across structures, the step time
  decides.

The batch: ``batch_size`` is what one *data group* draws per step (the DataLoader's batch), and
``data_groups`` how many distinct batches the job draws per step. A plan with ``dp`` replicas
splits each data group's batch between ``dp / data_groups`` replicas (a replica's ``tp`` ranks share its
micro-batches), so every candidate trains on the same global batch, ``batch_size * data_groups``.

The cost of a cut is :class:`~lightning_hpp.planning.costs.CostModel`'s (compute split over the tp ranks and a
layer's all-reduces; boundary messages; the gradient all-reduce over the dp replicas, FSDP2's gathers, the
optimizer on a rank's share of the parameters, ``1 / (dp_shard · tp)`` of the split weights), replayed in the
schedule's own action order (:mod:`~lightning_hpp.planning.replay`): every action starts when its rank is free
and what it waits for has finished. Memory: every rank must fit its stages' share of parameters, gradients and
optimizer state plus the peak, over its order, of the activations its stages keep
(:mod:`~lightning_hpp.planning.memory`). The search is exact for this model wherever a structure has at most
:data:`~lightning_hpp.planning.solver.EXACT_CUTS` cuts; tests compare it with brute force over torch's orders.

:func:`evaluate_plan` predicts a given cut with the same model (the CLI's baselines, a plan one wants to check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from lightning_hpp.errors import PartitionError, PlacementError, ScheduleError
from lightning_hpp.pipeline.dims import ParallelDims
from lightning_hpp.pipeline.schedules import SCHEDULES, check_schedule
from lightning_hpp.planning.cluster import DEFAULT_LINK_GBPS, DeviceGroup
from lightning_hpp.planning.costs import CostModel, KindCosts, choose_costs, precision_map
from lightning_hpp.planning.devices import assign_ranks, normalize_kind, stage_kind_orders, tp_group_kinds
from lightning_hpp.planning.profile import CostProfile
from lightning_hpp.planning.replay import program
from lightning_hpp.planning.result import PlanResult
from lightning_hpp.planning.solver import StructureSolver, whole_model
from lightning_hpp.validation import check_int

MAX_MICROBATCHES = 32
"""Largest number of micro-batches the search tries when the user does not fix it."""

MAX_STAGES_PER_RANK = 4
"""Most stages per rank the search gives the looped schedules (``interleaved1f1b``, ``looped_bfs``,
``interleaved_zb``)."""

DATA_PARALLEL_MODES = ("ddp", "fsdp", "hsdp")
"""The data-parallel modes ``search_plan(data_parallel=...)`` takes (``None``: ddp, or fsdp where memory decides)."""

SEARCHED_SCHEDULES = tuple(SCHEDULES)
"""Every schedule the runtime runs, in the order ties are broken (fewer stages, then this order)."""

_PREFERENCE = ("1f1b", "gpipe", "interleaved1f1b", "zbv", "interleaved_zb", "looped_bfs", "dualpipev")

# our names, torch's registry names and class names, lower case: "ZBVZeroBubble" and "zbv" are one schedule
_ALIASES = {
    alias.lower().replace("_", ""): name
    for name, kind in SCHEDULES.items()
    for alias in (name, kind.cls.__name__, kind.cls.__name__.removeprefix("Schedule"))
}


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


def microbatch_options(
    per_replica: int, fixed: int | None, pp: int, schedule: str, limit: int, v: int = 1
) -> list[int]:
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


def _schedules(schedule: str | None) -> list[str]:
    """The schedules to search: the one fixed (ours or torch's name), else every one.

    Raises:
        PartitionError: a name that is no schedule.
    """
    if schedule is None:
        return list(SEARCHED_SCHEDULES)
    name = schedule_name(schedule)
    if name is None:
        raise PartitionError(
            f"plan='auto' searches the schedules {', '.join(SEARCHED_SCHEDULES)} (or torch's names for them); "
            f"schedule={schedule!r} was fixed. Leave `schedule` unset to let the search choose, or fix one of those."
        )
    return [name]


def tp_options(tp_degree: int | Sequence[int] | None, profile: CostProfile) -> list[int]:
    """The tensor-parallel degrees to try: the one fixed, the ones listed, or (``None``) those the profile's model
    divides (``tp_degrees``; 1 alone where it records none)."""
    if isinstance(tp_degree, int):
        return [check_int(tp_degree, "search_plan(tp_degree=...)", error=PartitionError)]
    listed = tp_degree if tp_degree is not None else (profile.tp_degrees or [1])
    return sorted({check_int(t, "search_plan(tp_degree=...)", error=PartitionError) for t in [1, *listed]})


def tp_refusal(
    tp: int, rank_kinds: Sequence[str], hosts: Sequence[Hashable] | None, across_hosts: bool, fp8: Sequence[str]
) -> str | None:
    """Why groups of ``tp`` neighbouring ranks cannot split the layers (``None``: they can)."""
    if tp == 1:
        return None
    if fp8:
        return f"tensor parallel does not take the fp8 stages of {', '.join(fp8)} yet"
    try:
        tp_group_kinds(rank_kinds, tp)
    except PlacementError:
        return "a group of neighbouring ranks mixes device kinds"
    if hosts is not None and not across_hosts:
        split = [g for g in range(len(rank_kinds) // tp) if len(set(hosts[g * tp : (g + 1) * tp])) > 1]
        if split:
            first = hosts[split[0] * tp : (split[0] + 1) * tp]
            return (
                f"the group of ranks {split[0] * tp}-{split[0] * tp + tp - 1} spans hosts "
                f"{sorted(set(map(str, first)))} (allow it with tp_across_hosts)"
            )
    return None


def search_plan(
    profile: CostProfile,
    rank_kinds: Sequence[str],
    *,
    batch_size: int,
    data_groups: int = 1,
    pp_degree: int | None = None,
    dp_degree: int | None = None,
    tp_degree: int | Sequence[int] | None = 1,
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
    hosts: Sequence[Hashable] | None = None,
    tp_across_hosts: bool = False,
) -> PlanResult:
    """The fastest plan for these ranks under the cost model of the module docstring.

    Args:
        profile: Unit costs (and :class:`~lightning_hpp.planning.profile.Overheads` per entry) at
            the micro-batch size of ``profile.input_shapes``.
        rank_kinds: The kind of every global rank (index = rank).
        batch_size: Samples each data group draws per step (the DataLoader's batch).
        data_groups: Distinct batches per step; every plan's ``dp`` must be a multiple of it.
        pp_degree, dp_degree, n_microbatches, schedule: Values the user fixed (``None``: searched).
        tp_degree: The tensor-parallel degree fixed, the degrees to try, or ``None``: those the profile's model
            divides (:func:`tp_options`). Default 1: no tensor parallel.
        precision: One precision for every kind, or one per kind (``{"h100": "bf16-mixed"}``); kinds without
            one follow the device: fp8 where supported, else bf16, else fp16, else fp32.
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
        hosts: The host of every rank (any label; ``None``: one host): a tensor-parallel group stays on one.
        tp_across_hosts: Let a tensor-parallel group span hosts.

    Returns:
        The best plan; ``result.ranks`` is its rank grid ``ranks[position][replica · tp + tp_rank]``,
        ``result.data_parallel``, ``result.dp_shard`` and ``result.tp_degree`` how its stages' replicas share
        and split them. Ties go to fewer stages, then a smaller tp, then fewer micro-batches, then 1F1B.

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
    if hosts is not None and len(hosts) != world:
        raise PartitionError(f"search_plan(hosts=...) names {len(hosts)} hosts for {world} ranks; give one per rank.")
    if profile.microbatch_size is None:
        raise PartitionError(
            "The profile records no input shape, so its micro-batch size is unknown; profile the model on a real batch."
        )
    schedules = _schedules(schedule)
    have = [normalize_kind(k, f"rank {r} kind") for r, k in enumerate(rank_kinds)]
    kinds = sorted(set(have))
    mem = dict(memory_bytes or {})
    groups = [DeviceGroup(k, have.count(k), mem.get(k), link_gbps) for k in kinds]
    fixed = precision_map(precision, kinds)
    costs: list[KindCosts] = [choose_costs(profile, k, fixed[k]) for k in kinds]
    n = len(names)
    pps = [pp_degree] if pp_degree is not None else [p for p in range(1, min(n, world) + 1) if world % p == 0]
    tps = tp_options(tp_degree, profile)
    b0 = profile.microbatch_size
    fp8 = sorted(c.kind for c in costs if c.precision == "fp8")
    tried = _modes_text(data_parallel, dp_replicate, fp8)
    split, reduces = profile.tp_shape()

    best: tuple[tuple, PlanResult] | None = None
    excluded: list[str] = []
    for p in pps:
        for t in tps:
            where = f"pp={p}" + (f", tp={t}" if t > 1 else "")
            if world % (p * t) or p > n:
                excluded.append(
                    f"{where}: needs pp <= {n} units and pp{' × tp' if t > 1 else ''} a divisor of "
                    f"the world size {world}"
                )
                continue
            refusal = tp_refusal(t, have, hosts, tp_across_hosts, fp8)
            if refusal is not None:
                excluded.append(f"{where}: {refusal}")
                continue
            group_kinds = have[::t]
            dp = world // (p * t)
            if dp_degree is not None and dp != dp_degree:
                excluded.append(f"{where}: dp={dp} replicas, not the dp_degree={dp_degree} fixed")
                continue
            if not split_batches and dp != data_groups:
                excluded.append(
                    f"{where}: dp={dp} replicas would split the loader's batches, which cannot be rebatched"
                )
                continue
            if dp % data_groups or batch_size % (dp // data_groups):
                excluded.append(
                    f"{where}: dp={dp} replicas cannot split {data_groups} batch(es) of {batch_size} evenly"
                )
                continue
            per_replica = batch_size // (dp // data_groups)
            modes = _sharding_modes(data_parallel, dp, dp_replicate, fp8)
            if isinstance(modes, str):
                excluded.append(f"{where}: {modes}")
                continue
            if p == 1:
                orders: list[list[str]] = [kinds]
            else:
                try:
                    orders = stage_kind_orders(group_kinds, p, dp)
                except PlacementError:
                    orders = []
                if not orders:
                    excluded.append(f"{where}: the ranks' kinds cannot form {dp} replicas with one kind per stage")
                    continue
            if p == 1 and all(SCHEDULES[x].multi for x in schedules):
                excluded.append(f"pp=1: one stage cannot run {schedules[0]!r}, which holds several stages per rank")
            for sched in schedules if p > 1 else [x for x in schedules if not SCHEDULES[x].multi]:
                vs = stages_per_rank_options(sched, p, n)
                if not vs:
                    excluded.append(f"{where}, {sched}: needs at least {2 * p} stages, more than the model's {n} units")
                for v in vs:
                    ms = microbatch_options(per_replica, n_microbatches, p, sched, max_microbatches, v)
                    if not ms:
                        excluded.append(
                            f"{where}, {sched}, {v} stage(s) per rank: no micro-batch count (fixed {n_microbatches!r}) "
                            f"divides {per_replica} samples per replica and runs under the schedule"
                        )
                    for m in ms:
                        base = CostModel(
                            costs,
                            groups,
                            sched,
                            optimizer_factor,
                            scale=per_replica / m / b0,
                            tp=t,
                            tp_split=split,
                            tp_allreduces=reduces,
                        )
                        models = {
                            shard: base
                            if shard == 1
                            else dataclasses.replace(base, dp_shard=shard, reshard_after_forward=reshard_after_forward)
                            for _, shard in modes
                        }
                        label = ", ".join(mode if shard == 1 else f"{mode} over {shard}" for mode, shard in modes)
                        cands = []
                        if p == 1:
                            res = None
                            for mode, shard in modes:  # the first mode whose whole model fits
                                res = whole_model(models[shard], m, dp, names, [kinds.index(k) for k in orders[0]])
                                if res is not None:
                                    res.data_parallel = mode
                                    break
                            if res is None:
                                excluded.append(f"{where}, m={m}: the whole model does not fit one device ({label})")
                                continue
                            res.ranks = [list(range(world))]
                            res.fixed_step_ms = max(base.overheads(kinds.index(k)).step_ms for k in orders[0])
                            cands = [res]
                        else:
                            prog = None
                            for order in orders:
                                ks = [kinds.index(k) for k in order]
                                if best is not None and base.lower_bound(ks, p * v, m) > best[1].step_ms:
                                    continue  # no cut of this layout can beat the best plan so far
                                prog = prog or program(sched, p, p * v, m)
                                for mode, shard in modes:  # the first mode in which a cut of this layout fits
                                    solver = StructureSolver(models[shard], prog, ks, dp)
                                    found = solver.best()
                                    if found is not None:
                                        res = solver.result(*found, m, names, sched)
                                        res.data_parallel = mode
                                        dims = ParallelDims(p, dp // shard, shard, t)
                                        res.ranks = dims.expand_tp(assign_ranks(list(order), group_kinds, p, dp))
                                        cands.append(res)
                                        break
                            if not cands:
                                excluded.append(f"{where}, {sched}, v={v}, m={m}: no cut fits in memory ({label})")
                        for res in cands:
                            res.microbatch_size = per_replica // m
                            res.label = "auto"
                            key = (round(res.step_ms, 9), p, t, v, m, _PREFERENCE.index(res.schedule))
                            if best is None or key < best[0]:
                                best = (key, res)
    if best is None:
        why = "; ".join(excluded) or "no candidates"
        raise PartitionError(
            f"plan='auto' found no plan for {world} rank(s) ({', '.join(have)}) with batch_size={batch_size}, "
            f"pp_degree={pp_degree!r}, n_microbatches={n_microbatches!r}, schedule={schedule!r}, data parallel "
            f"{tried}"
            + (f", tp in {tps}" if tps != [1] else "")
            + f": {why}. Relax a fixed value, or change the batch size."
        )
    result = best[1]
    result.notes.append(
        f"searched: pp in {pps}"
        + (f", tp in {tps}" if tps != [1] else "")
        + f", schedules {schedules} (up to {MAX_STAGES_PER_RANK} stages per rank), m up to "
        f"{n_microbatches or max_microbatches}, data parallel {tried}, "
        f"global batch {batch_size * data_groups}; chose data_parallel={result.data_parallel}"
        + (f", tp={result.tp_degree}" if tps != [1] else "")
    )
    return result


def evaluate_plan(
    profile: CostProfile,
    rank_kinds: Sequence[str],
    stages: Sequence[Sequence[str]],
    position_kinds: Sequence[str],
    *,
    schedule: str,
    n_microbatches: int,
    batch_size: int,
    data_groups: int = 1,
    tp_degree: int = 1,
    data_parallel: str = "ddp",
    dp_replicate: int | None = None,
    reshard_after_forward: bool = False,
    precision: str | Mapping[str, str] | None = None,
    optimizer_factor: float = 3.0,
    memory_bytes: Mapping[str, float] | None = None,
    link_gbps: float = DEFAULT_LINK_GBPS,
    label: str = "given",
) -> PlanResult:
    """The predicted numbers of a given plan on these ranks, by the cost model :func:`search_plan` minimises (a
    constrained call of it: everything fixed, the cut included).

    Args:
        profile, rank_kinds, batch_size, data_groups, precision, optimizer_factor, memory_bytes, link_gbps: As for
            :func:`search_plan`.
        stages: The unit names of every stage, contiguous and in order, covering every unit.
        position_kinds: The kind of every pipeline position (``pp`` of them; ``len(stages) / pp`` stages each).
        schedule, n_microbatches, tp_degree, data_parallel, dp_replicate, reshard_after_forward: The plan's.
        label: Its name in the table.

    Returns:
        The estimates, also where a stage does not fit (``result.fits``; :meth:`PlanResult.require_fit` refuses).

    Raises:
        PartitionError: stages that do not cover the units in order, a layout the ranks cannot form.
    """
    name = schedule_name(schedule)
    if name is None:
        raise PartitionError(f"evaluate_plan(schedule={schedule!r}) is no schedule; use one of {', '.join(SCHEDULES)}.")
    stages = [list(s) for s in stages]
    if [u for s in stages for u in s] != list(profile.unit_names) or any(not s for s in stages):
        raise PartitionError(
            f"Stages {stages} must be non-empty and cover the profile's units in order: {profile.unit_names}."
        )
    _check_sharding(data_parallel, dp_replicate)
    pp, world = len(position_kinds), len(rank_kinds)
    if not pp or len(stages) % pp:
        raise PartitionError(
            f"{len(stages)} stages cannot sit on {pp} pipeline positions; give one kind per position "
            f"and a multiple of it in stages."
        )
    try:
        dims = ParallelDims.resolve(world, pp, tp=tp_degree, data_parallel=data_parallel, dp_replicate=dp_replicate)
    except ValueError as err:
        raise PartitionError(str(err)) from None
    have = [normalize_kind(k, f"rank {r} kind") for r, k in enumerate(rank_kinds)]
    wanted = [normalize_kind(k, f"position {r} kind") for r, k in enumerate(position_kinds)]
    kinds = sorted(set(have))
    absent = sorted(set(wanted) - set(kinds))
    if absent:
        raise PartitionError(f"The plan asks for kind(s) {absent}, but the ranks are {', '.join(kinds)}.")
    try:
        grid = dims.expand_tp(assign_ranks(wanted, tp_group_kinds(have, dims.tp), pp, dims.dp))
    except PlacementError as err:
        raise PartitionError(str(err)) from None
    if dims.dp % data_groups or batch_size % (dims.dp // data_groups):
        raise PartitionError(f"dp={dims.dp} replicas cannot split {data_groups} batch(es) of {batch_size} evenly.")
    per_replica = batch_size // (dims.dp // data_groups)
    m = check_int(n_microbatches, "evaluate_plan(n_microbatches=...)", error=PartitionError)
    if per_replica % m:
        raise PartitionError(f"{m} micro-batches do not divide the {per_replica} samples of each replica.")
    try:
        check_schedule(name, len(stages), pp, m)
    except ScheduleError as err:
        raise PartitionError(str(err)) from None
    mem = dict(memory_bytes or {})
    groups = [DeviceGroup(k, have.count(k), mem.get(k), link_gbps) for k in kinds]
    fixed = precision_map(precision, kinds)
    split, reduces = profile.tp_shape()
    model = CostModel(
        [choose_costs(profile, k, fixed[k]) for k in kinds],
        groups,
        name,
        optimizer_factor,
        scale=per_replica / m / profile.microbatch_size,
        dp_shard=dims.dp_shard,
        reshard_after_forward=reshard_after_forward,
        tp=dims.tp,
        tp_split=split,
        tp_allreduces=reduces,
    )
    solver = StructureSolver(model, program(name, pp, len(stages), m), [kinds.index(k) for k in wanted], dims.dp)
    cuts = np.cumsum([0] + [len(s) for s in stages])[None, :]
    result = solver.result(0, solver.score(cuts), m, profile.unit_names, name)
    result.data_parallel, result.ranks = dims.data_parallel, grid
    result.microbatch_size, result.label = per_replica // m, label
    return result


def _check_sharding(data_parallel: str | None, dp_replicate: int | None) -> None:
    if data_parallel is not None and data_parallel not in DATA_PARALLEL_MODES:
        raise PartitionError(
            f"search_plan(data_parallel={data_parallel!r}): use one of {DATA_PARALLEL_MODES}, or None "
            f"(ddp, and fsdp where only sharded stages fit)."
        )
    if (data_parallel == "hsdp") != (dp_replicate is not None):
        raise PartitionError(
            f"search_plan(data_parallel={data_parallel!r}, dp_replicate={dp_replicate!r}): "
            f"dp_replicate is hsdp's number of replica groups; give it with data_parallel='hsdp' only."
        )
    if dp_replicate is not None:
        check_int(dp_replicate, "search_plan(dp_replicate=...)", error=PartitionError)


def _sharding_modes(
    data_parallel: str | None, dp: int, dp_replicate: int | None, fp8: Sequence[str]
) -> list[tuple[str, int]] | str:
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
