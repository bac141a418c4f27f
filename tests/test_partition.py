"""The partitioner: exact against brute force, the 8:4 reference, precision per kind, errors."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_hpp.errors import PartitionError
from lightning_hpp.planning.partition import (
    Cluster,
    DeviceGroup,
    evaluate,
    partition,
    plan_for_ranks,
    uniform_partition,
)
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.planning.profile import CostProfile, ProfileEntry, UnitCost


def make_profile(kinds: dict[str, list[tuple]], precision: str = "32-true") -> CostProfile:
    """``kinds[kind]`` = per unit ``(fwd_ms, bwd_ms, param_bytes, activation_bytes, saved_bytes)``."""
    first = next(iter(kinds.values()))
    names = [f"layers.{i}" for i in range(len(first))]
    entries = [
        ProfileEntry(kind, precision, [UnitCost(n, *u) for n, u in zip(names, units)])
        for kind, units in kinds.items()
    ]
    return CostProfile("Toy", names, [u[2] // 4 for u in first], [[4, 16]], entries)


def equal_layers(n=12, slow_factor=2.0, act=4096, params=4096, saved=0):
    fast = [(1.0, 2.0, params, act, saved)] * n
    slow = [(1.0 * slow_factor, 2.0 * slow_factor, params, act, saved)] * n
    return make_profile({"fast": fast, "slow": slow})


# ---------------------------------------------------------------------------- the reference case
def test_two_x_slower_device_gets_a_third_of_twelve_layers():
    prof = equal_layers()
    res = partition(prof, {"fast": 1, "slow": 1}, schedule="1f1b", n_microbatches=12)
    assert res.cuts == [8, 4]
    assert [s.device for s in res.stages] == ["fast", "slow"]
    uni = uniform_partition(prof, {"fast": 1, "slow": 1}, 2, schedule="1f1b", n_microbatches=12)
    assert uni.cuts == [6, 6]
    # fast 8 x 3 ms vs slow 6 x 6 ms per micro-batch: 1.5x predicted (the boundary send is tiny).
    assert uni.step_ms / res.step_ms == pytest.approx(36 / 24, rel=1e-3)


def test_plan_carries_modules_devices_precision_and_predictions(tmp_path):
    prof = equal_layers()
    res = partition(prof, {"fast": 1, "slow": 1}, n_microbatches=12)
    plan = res.plan
    assert isinstance(plan, StagePlan)
    assert plan.resolve(prof.unit_names) == [prof.unit_names[:8], prof.unit_names[8:]]
    assert [s.device for s in plan.stages] == ["fast", "slow"]
    assert [s.precision for s in plan.stages] == ["32-true", "32-true"]
    pred = plan.meta["predicted"]
    assert pred["step_ms"] == pytest.approx(res.step_ms)
    assert pred["stage_ms"] == pytest.approx([s.stage_ms for s in res.stages])
    assert pred["pp_degree"] == 2 and pred["dp_degree"] == 1 and pred["n_microbatches"] == 12
    path = tmp_path / "stage_plan.json"
    plan.save(str(path))
    again = StagePlan.load(str(path))
    assert again.meta["predicted"]["step_ms"] == pytest.approx(res.step_ms)
    table = res.format_table()
    assert "layers.0 .. layers.7 (8)" in table and "predicted step" in table


def test_memory_limit_moves_the_cut():
    # 1 GB of params per layer: with Adam (x4) the fast device can hold at most 5 layers in 21 GB.
    prof = equal_layers(params=10**9)
    cluster = Cluster([DeviceGroup("fast", 1, 21e9), DeviceGroup("slow", 1, 100e9)])
    res = partition(prof, cluster, n_microbatches=12, pp_degree=2)
    assert res.fits
    assert res.cuts == [5, 7]
    assert res.stages[0].memory_bytes == pytest.approx(5 * 4e9 + 2 * 5 * 4096)


def test_in_flight_activations_follow_the_schedule():
    prof = equal_layers(saved=1000)
    stages = [prof.unit_names[:6], prof.unit_names[6:]]
    f1b = evaluate(prof, {"fast": 1, "slow": 1}, stages, ["fast", "slow"], schedule="1f1b", n_microbatches=8)
    gp = evaluate(prof, {"fast": 1, "slow": 1}, stages, ["fast", "slow"], schedule="gpipe", n_microbatches=8)
    assert [s.in_flight for s in f1b.stages] == [2, 1]
    assert [s.in_flight for s in gp.stages] == [8, 8]
    assert f1b.stages[0].memory_bytes == pytest.approx(6 * 4096 * 4 + 2 * 6 * 1000)
    assert gp.stages[1].memory_bytes == pytest.approx(6 * 4096 * 4 + 8 * 6 * 1000)


def test_dp_auto_trades_pipeline_depth_for_replicas():
    prof = equal_layers(n=8, slow_factor=1.0, params=1000)
    res = partition(prof, {"fast": 4}, dp_degree="auto", global_microbatches=8)
    # With cheap all-reduce, pure data parallelism has no bubble and wins.
    assert (res.pp_degree, res.dp_degree, res.n_microbatches) == (1, 4, 2)


# ---------------------------------------------------------------------------- precision per kind
def test_precision_follows_the_device_and_scales_unmeasured_kinds():
    units = [(1.0, 2.0, 4000, 400, 0)] * 4
    prof = make_profile({"a100": units}, precision="bf16-mixed")
    res = partition(prof, {"a100": 1, "h100": 1}, pp_degree=2, n_microbatches=4)
    by_kind = {s.device: s for s in res.stages}
    assert by_kind["a100"].precision == "bf16-mixed" and by_kind["a100"].cost_source == "measured"
    h = by_kind["h100"]
    assert h.precision == "bf16-mixed"  # no fp8 costs anywhere: fp8 cannot be predicted
    assert "scaled from a100" in h.cost_source
    assert h.compute_ms == pytest.approx(len(h.units) * 3.0 * 312 / 989.4)


def test_fp8_is_chosen_where_supported_and_costs_exist():
    units = [(1.0, 2.0, 4000, 400, 0)] * 4
    prof = make_profile({"a100": units}, precision="bf16-mixed")
    prof.add(ProfileEntry("h100", "fp8", [UnitCost(n, 0.2, 0.4, 4000, 400) for n in prof.unit_names]))
    res = partition(prof, {"a100": 1, "h100": 1}, pp_degree=2, n_microbatches=4)
    assert {s.device: s.precision for s in res.stages} == {"a100": "bf16-mixed", "h100": "fp8"}
    fixed = partition(prof, {"a100": 1, "h100": 1}, pp_degree=2, n_microbatches=4, precision="bf16-mixed")
    assert {s.precision for s in fixed.stages} == {"bf16-mixed"}


def test_cpu_stages_run_fp32():
    prof = make_profile({"cpu": [(1.0, 2.0, 4000, 400, 0)] * 3})
    res = partition(prof, {"cpu": 3}, n_microbatches=4)
    assert {s.precision for s in res.stages} == {"32-true"}


def test_fp8_fixed_on_a_device_without_it_is_refused():
    prof = make_profile({"a100": [(1.0, 2.0, 4000, 400, 0)] * 3}, precision="bf16-mixed")
    with pytest.raises(PartitionError, match="'a100', which does not support fp8"):
        partition(prof, {"a100": 2}, precision={"a100": "fp8"})


# ---------------------------------------------------------------------------- errors
def test_impossible_memory_names_stage_need_and_limit():
    prof = equal_layers(n=3, params=10**9)
    cluster = Cluster([DeviceGroup("fast", 1, 3e9), DeviceGroup("slow", 1, 3e9)])
    with pytest.raises(PartitionError) as err:
        partition(prof, cluster, n_microbatches=4)
    msg = str(err.value)
    assert "No placement fits in device memory" in msg
    assert "8.0 GB" in msg and "limit of 3.0 GB" in msg  # two 1 GB layers x (1 + 3) on one device
    assert "stage" in msg and "optimizer_factor" in msg


def test_zero_devices_of_a_needed_kind():
    prof = equal_layers(n=4)
    with pytest.raises(PartitionError, match=r"\['medium'\], but the cluster has zero"):
        partition(prof, {"fast": 1, "slow": 1}, stage_kinds=["fast", "medium"])
    with pytest.raises(PartitionError, match="no costs for kind 'tpu'"):
        partition(prof, {"fast": 1, "tpu": 1})


def test_fewer_units_than_stages():
    prof = equal_layers(n=3)
    with pytest.raises(PartitionError, match="pp_degree=4 stages but the profile has only 3 units"):
        partition(prof, {"fast": 4}, pp_degree=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"schedule": "interleaved1f1b"}, "models schedules gpipe, 1f1b"),
        ({"dp_degree": "auto"}, "needs `global_microbatches`"),
        ({"n_microbatches": 0}, "`n_microbatches=0`: must be a positive integer"),
        ({"precision": {"h100": "bf16-mixed"}}, "no 'h100' devices"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(PartitionError, match=match):
        partition(equal_layers(n=4), {"fast": 1, "slow": 1}, **kwargs)


def test_bad_cluster_strings():
    assert [(g.kind, g.count, g.memory_bytes) for g in Cluster.parse("128xA100, 2xh100:40").groups] == [
        ("a100", 128, None), ("h100", 2, 40e9)]
    with pytest.raises(PartitionError, match="'a100x128' .* is not 'COUNTxKIND'"):
        Cluster.parse("a100x128")


# ---------------------------------------------------------------------------- rank-aware planning
def test_plan_for_ranks_respects_rank_order():
    prof = equal_layers()
    # Rank 0 is slow, rank 1 fast: the pipeline must start on rank 0, so slow gets the first stage.
    res = plan_for_ranks(prof, ["slow", "fast"], n_microbatches=12)
    assert [s.device for s in res.stages] == ["slow", "fast"]
    assert res.cuts == [4, 8]
    assert res.ranks == [[0], [1]] and res.plan.meta["ranks"] == [[0], [1]]
    res2 = plan_for_ranks(prof, ["fast", "fast", "slow", "slow"], dp_degree=2, n_microbatches=12)
    assert res2.ranks == [[0, 1], [2, 3]] and res2.cuts == [8, 4]


# ---------------------------------------------------------------------------- exact vs brute force
def brute_force(units, groups, schedule, options, pp, opt):
    """Independent exhaustive search over the cost model stated in partition.py's docstring."""
    n = len(next(iter(units.values())))
    kinds = list(units)
    best = math.inf
    for dp, m in options:
        for p in ([pp] if pp else range(1, n + 1)):
            for cuts in itertools.combinations(range(1, n), p - 1):
                b = [0, *cuts, n]
                for ks in itertools.product(range(len(kinds)), repeat=p):
                    if any(ks.count(k) * dp > groups[kinds[k]][0] for k in range(len(kinds))):
                        continue
                    ts, ars, ok = [], [], True
                    for s, k in enumerate(ks):
                        us = units[kinds[k]][b[s] : b[s + 1]]
                        count, mem, link = groups[kinds[k]]
                        comp = sum(u[0] + u[1] for u in us)
                        out = units[kinds[k]][b[s + 1] - 1][3] if b[s + 1] < n else 0
                        gin = units[kinds[k]][b[s] - 1][3] if b[s] > 0 else 0
                        ts.append(comp + (out + gin) / (link * 1e6))
                        params = sum(u[2] for u in us)
                        ars.append(2 * (dp - 1) / dp * params / (link * 1e6))
                        fl = m if schedule == "gpipe" else min(m, p - s)
                        if params * (1 + opt) + fl * sum(u[4] or u[3] for u in us) > mem:
                            ok = False
                    if ok:
                        best = min(best, (m + p - 1) * max(ts) + max(ars))
    return best


def random_instance(seed: int):
    """A small random problem: <= 7 units, 2 kinds, <= 3 stages when dp is 1, dp fixed or searched."""
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    schedule = rng.choice(["gpipe", "1f1b"])
    opt = rng.choice([0.0, 1.0, 3.0])
    m = rng.randint(1, 6)
    pp = rng.choice([None, None, rng.randint(1, 3)])
    dp_mode = rng.choice(["1", "2", "auto", "auto"])
    counts = {"fast": rng.randint(0, 3), "slow": rng.randint(1, 3)}
    if dp_mode == "1":
        counts["slow"] = min(counts["slow"], 2)
        counts["fast"] = min(counts["fast"], 3 - counts["slow"])
    slow = rng.uniform(1.0, 3.0)
    base = [
        (rng.uniform(0.1, 2.0), rng.uniform(0.1, 4.0), rng.randint(1, 8) * 10**6, rng.randint(0, 4) * 10**6,
         rng.randint(0, 6) * 10**6)
        for _ in range(n)
    ]
    units = {"fast": base, "slow": [(f * slow, b * slow, *rest) for f, b, *rest in base]}
    # Memory: unlimited, or a fraction of what the whole model needs on one device (often binding).
    whole = sum(u[2] for u in base) * (1 + opt) + max(m, 6) * sum(u[4] or u[3] for u in base)
    groups = {
        k: (c, rng.choice([math.inf, rng.uniform(0.2, 0.8) * whole]), rng.uniform(0.5, 5.0))
        for k, c in counts.items()
    }
    if dp_mode == "auto":
        g = rng.choice([2, 4, 6])
        total = sum(counts.values())
        options = [(d, g // d) for d in range(1, min(g, total) + 1) if g % d == 0]
        kw = dict(dp_degree="auto", global_microbatches=g)
    else:
        options = [(int(dp_mode), m)]
        kw = dict(dp_degree=int(dp_mode), n_microbatches=m)
    kw.update(schedule=schedule, optimizer_factor=opt, pp_degree=pp)
    cluster = Cluster([DeviceGroup(k, c, None if math.isinf(mem) else mem, link) for k, (c, mem, link) in groups.items()])
    return dict(n=n, units=units, groups=groups, schedule=schedule, options=options, pp=pp, opt=opt,
                profile=make_profile(units), cluster=cluster, kw=kw)


@pytest.mark.parametrize("seed", range(50))
def test_partition_equals_brute_force(seed):
    inst = random_instance(seed)
    prof, cluster, kw = inst["profile"], inst["cluster"], inst["kw"]
    if inst["pp"] is not None and inst["pp"] > inst["n"]:
        with pytest.raises(PartitionError, match="stages but the profile has only"):
            partition(prof, cluster, **kw)
        return
    expected = brute_force(inst["units"], inst["groups"], inst["schedule"], inst["options"], inst["pp"], inst["opt"])
    if math.isinf(expected):
        with pytest.raises(PartitionError):
            partition(prof, cluster, **kw)
        return
    res = partition(prof, cluster, **kw)
    assert res.step_ms == pytest.approx(expected, rel=1e-9)
    assert res.fits
    # The numbers reported for the chosen placement are the cost model's for that placement.
    again = evaluate(prof, cluster, [s.units for s in res.stages], [s.device for s in res.stages],
                     schedule=inst["schedule"], n_microbatches=res.n_microbatches, dp_degree=res.dp_degree,
                     optimizer_factor=inst["opt"])
    assert again.step_ms == pytest.approx(res.step_ms, rel=1e-12)


def test_brute_force_instances_cover_the_interesting_cases():
    """The instances include infeasible ones, binding memory limits, dp > 1 and multi-stage optima."""
    seen = {"infeasible": 0, "memory binds": 0, "dp>1": 0, "pp>1": 0}
    for seed in range(50):
        inst = random_instance(seed)
        if inst["pp"] is not None and inst["pp"] > inst["n"]:
            continue
        free = {k: (c, math.inf, link) for k, (c, _, link) in inst["groups"].items()}
        unlimited = brute_force(inst["units"], free, inst["schedule"], inst["options"], inst["pp"], inst["opt"])
        try:
            res = partition(inst["profile"], inst["cluster"], **inst["kw"])
        except PartitionError:
            seen["infeasible"] += 1
            continue
        seen["memory binds"] += res.step_ms > unlimited * (1 + 1e-9)
        seen["dp>1"] += res.dp_degree > 1
        seen["pp>1"] += res.pp_degree > 1
    assert all(v >= 5 for v in seen.values()), seen
