"""The planner's parts, offline: the cluster description, the exact bottleneck cut against brute force, the 8:4
reference, precision per kind, memory, and a given cut predicted by the search's own cost model."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from lightning_hpp.errors import PartitionError
from lightning_hpp.planning.cluster import Cluster
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.planning.profile import CostProfile, ProfileEntry, UnitCost
from lightning_hpp.planning.search import evaluate_plan, search_plan
from lightning_hpp.planning.solver import bottleneck


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
    kw = dict(batch_size=48, pp_degree=2, n_microbatches=12, schedule="1f1b")
    res = search_plan(prof, ["fast", "slow"], **kw)
    assert res.cuts == [8, 4]
    assert [s.device for s in res.stages] == ["fast", "slow"]
    uni = evaluate_plan(prof, ["fast", "slow"], [prof.unit_names[:6], prof.unit_names[6:]], ["fast", "slow"],
                        schedule="1f1b", n_microbatches=12, batch_size=48)
    # the slow rank's 6 x 6 ms against 4 x 6 ms per micro-batch, 12 micro-batches and the fill: 12 x 36 + 18 against
    # 13 x 24 ms (the boundary sends are tiny)
    assert uni.step_ms / res.step_ms == pytest.approx((12 * 36 + 18) / (13 * 24), rel=0.01)


def test_plan_carries_modules_devices_precision_and_predictions(tmp_path):
    prof = equal_layers()
    res = search_plan(prof, ["fast", "slow"], batch_size=48, pp_degree=2, n_microbatches=12, schedule="1f1b")
    plan = res.plan
    assert isinstance(plan, StagePlan)
    assert plan.resolve(prof.unit_names) == [prof.unit_names[:8], prof.unit_names[8:]]
    assert [s.device for s in plan.stages] == ["fast", "slow"]
    assert [s.precision for s in plan.stages] == ["32-true", "32-true"]
    pred = plan.meta["predicted"]
    assert pred["step_ms"] == pytest.approx(res.step_ms)
    assert pred["stage_ms"] == pytest.approx([s.stage_ms for s in res.stages])
    assert (pred["pp_degree"], pred["dp_degree"], pred["tp_degree"], pred["n_microbatches"]) == (2, 1, 1, 12)
    path = tmp_path / "stage_plan.json"
    plan.save(str(path))
    assert StagePlan.load(str(path)).meta["predicted"]["step_ms"] == pytest.approx(res.step_ms)
    table = res.format_table()
    assert "layers.0 .. layers.7 (8)" in table and "predicted step" in table


def test_memory_limit_moves_the_cut():
    # 1 GB of params per layer: with Adam (x4) the fast device can hold at most 5 layers in 21 GB
    prof = equal_layers(params=10**9)
    res = search_plan(prof, ["fast", "slow"], batch_size=48, pp_degree=2, n_microbatches=12, schedule="1f1b",
                      memory_bytes={"fast": 21e9, "slow": 100e9})
    assert res.fits and res.cuts == [5, 7]
    assert res.stages[0].memory_bytes == pytest.approx(5 * 4e9 + 2 * 5 * 4096)  # 2 micro-batches in flight


def test_in_flight_activations_follow_the_schedule():
    prof = equal_layers(saved=1000)
    stages = [prof.unit_names[:6], prof.unit_names[6:]]
    kw = dict(n_microbatches=8, batch_size=32)  # the profile's micro-batch (4 samples): the saved bytes as profiled
    f1b = evaluate_plan(prof, ["fast", "slow"], stages, ["fast", "slow"], schedule="1f1b", **kw)
    gp = evaluate_plan(prof, ["fast", "slow"], stages, ["fast", "slow"], schedule="gpipe", **kw)
    assert [s.in_flight for s in f1b.stages] == [2, 1]
    assert [s.in_flight for s in gp.stages] == [8, 8]
    assert f1b.stages[0].memory_bytes == pytest.approx(6 * 4096 * 4 + 2 * 6 * 1000)
    assert gp.stages[1].memory_bytes == pytest.approx(6 * 4096 * 4 + 8 * 6 * 1000)


# ---------------------------------------------------------------------------- precision per kind
def test_precision_follows_the_device_and_scales_unmeasured_kinds():
    units = [(1.0, 2.0, 4000, 400, 0)] * 4
    prof = make_profile({"a100": units}, precision="bf16-mixed")
    res = search_plan(prof, ["a100", "h100"], batch_size=16, pp_degree=2, n_microbatches=4, schedule="1f1b")
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
    kw = dict(batch_size=16, pp_degree=2, n_microbatches=4, schedule="1f1b")
    res = search_plan(prof, ["a100", "h100"], **kw)
    assert {s.device: s.precision for s in res.stages} == {"a100": "bf16-mixed", "h100": "fp8"}
    fixed = search_plan(prof, ["a100", "h100"], precision="bf16-mixed", **kw)
    assert {s.precision for s in fixed.stages} == {"bf16-mixed"}
    with pytest.raises(PartitionError, match="'a100', which does not support fp8"):
        search_plan(prof, ["a100", "a100"], batch_size=16, precision={"a100": "fp8"})
    with pytest.raises(PartitionError, match="no 'tpu' devices"):
        search_plan(prof, ["a100", "a100"], batch_size=16, precision={"tpu": "bf16-mixed"})


def test_impossible_memory_names_what_was_tried():
    prof = equal_layers(n=3, params=10**9)
    with pytest.raises(PartitionError, match=r"found no plan for 2 rank\(s\).*no cut fits in memory"):
        search_plan(prof, ["fast", "slow"], batch_size=16, memory_bytes={"fast": 3e9, "slow": 3e9})
    with pytest.raises(PartitionError, match="no costs for kind 'tpu'"):
        search_plan(prof, ["fast", "tpu"], batch_size=16)


def test_a_given_cut_that_does_not_fit_is_refused_naming_the_stage_and_the_bytes():
    prof = make_profile({"a100": [(1.0, 2.0, 4_000_000, 1000, 1000)] * 4})  # 4 MB of parameters per unit
    stages = [prof.unit_names[:2], prof.unit_names[2:]]
    kw = dict(schedule="1f1b", n_microbatches=2, batch_size=16, memory_bytes={"a100": 30e6})  # 2 x 4 samples a replica
    ddp = evaluate_plan(prof, ["a100"] * 4, stages, ["a100"] * 2, **kw)
    # in flight under 1f1b: 2 micro-batches on stage 0, 1 on stage 1, each keeping 2 x 1000 B
    assert [s.memory_bytes for s in ddp.stages] == [8e6 * 4 + 2 * 2000, 8e6 * 4 + 2000]  # 32 MB: over
    with pytest.raises(PartitionError, match=r"Stage 0 \(layers.0, layers.1 on a100\) needs 32.0 MB per rank "
                                             r"\(parameters 8.0 MB x \(1 \+ optimizer_factor 3\) \+ 2 in-flight"
                                             r".*but the device has 30.0 MB.*ShardingOptions\(data_parallel='fsdp'\)"):
        ddp.require_fit()
    # sharded over its 2 replicas with one unit gathered at a time (one micro-batch a step), the same stage fits
    one = dict(kw, n_microbatches=1, schedule="gpipe", batch_size=8)
    fsdp = evaluate_plan(prof, ["a100"] * 4, stages, ["a100"] * 2, data_parallel="fsdp", reshard_after_forward=True,
                         **one)
    assert fsdp.stages[0].memory_bytes == 8e6 * 4 / 2 + 2 * 4e6 + 2000
    assert fsdp.require_fit() is fsdp and "/ dp_shard 2 + 8.0 MB gathered" in fsdp.stages[0].memory_detail
    # split over 2 tp ranks instead: each rank holds half of every stage (all of this profile's bytes split)
    tp = evaluate_plan(prof, ["a100"] * 4, stages, ["a100"] * 2, tp_degree=2, **dict(kw, batch_size=8))
    assert tp.stages[0].memory_bytes == 8e6 * 4 / 2 + 2 * 2000 and tp.fits and tp.tp_degree == 2
    with pytest.raises(PartitionError, match=r"Stages .* must be non-empty and cover the profile's units in order"):
        evaluate_plan(prof, ["a100"] * 4, [prof.unit_names[:1]], ["a100"], **kw)


# ---------------------------------------------------------------------------- the cluster
def test_cluster_strings_and_hosts():
    cluster = Cluster.parse("4xA100, 2xh100:40")
    assert [(g.kind, g.count, g.memory_bytes) for g in cluster.groups] == [("a100", 4, None), ("h100", 2, 40e9)]
    assert cluster.rank_kinds() == ["a100"] * 4 + ["h100"] * 2
    assert cluster.hosts(2) == ["a100-0", "a100-0", "a100-1", "a100-1", "h100-0", "h100-0"]
    assert cluster.memory_bytes() == {"h100": 40e9}
    with pytest.raises(PartitionError, match="'a100x128' .* is not 'COUNTxKIND'"):
        Cluster.parse("a100x128")
    with pytest.raises(PartitionError, match=r"kind\(s\) \['a100'\] more than once"):
        Cluster.parse("1xa100,2xa100")


# ---------------------------------------------------------------------------- the exact bottleneck cut
def _brute_bottleneck(cost: list[np.ndarray], budgets: list[int], n: int, p: int) -> float:
    best = math.inf
    for inner in itertools.combinations(range(1, n), p - 1):
        b = [0, *inner, n]
        for ks in itertools.product(range(len(budgets)), repeat=p):
            if any(ks.count(k) > budgets[k] for k in range(len(budgets))):
                continue
            best = min(best, max(cost[k][b[s], b[s + 1]] for s, k in enumerate(ks)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_bottleneck_programme_equals_brute_force(seed):
    """The dynamic programme the search starts large structures from is exact: the smallest slowest stage over
    every cut and every choice of kinds within their budgets."""
    rng = random.Random(seed)
    n, p, K = rng.randint(1, 7), rng.randint(1, 4), rng.randint(1, 3)
    budgets = [rng.randint(0, 3) for _ in range(K)]
    cost = []
    for _ in range(K):
        unit = np.array([rng.uniform(0.1, 3.0) for _ in range(n)])
        c = np.concatenate([[0.0], np.cumsum(unit)])
        mat = c[None, :] - c[:, None] + rng.uniform(0, 1)
        mat[~np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)] = math.inf
        if rng.random() < 0.3:  # some segments not allowed on this kind (memory)
            mat[mat > rng.uniform(1, 6)] = math.inf
        cost.append(mat)
    expected = _brute_bottleneck(cost, budgets, n, p) if p <= n else math.inf
    got = bottleneck(n, p, budgets, lambda k, s: cost[k])
    if math.isinf(expected):
        assert got is None
        return
    value, cuts, kinds = got
    assert value == pytest.approx(expected, rel=1e-12)
    assert cuts[0] == 0 and cuts[-1] == n and all(a < b for a, b in zip(cuts, cuts[1:]))
    assert max(cost[k][cuts[s], cuts[s + 1]] for s, k in enumerate(kinds)) == pytest.approx(value, rel=1e-12)
    assert all(kinds.count(k) <= budgets[k] for k in range(K))
