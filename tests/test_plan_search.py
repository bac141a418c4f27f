"""The whole-plan search behind plan="auto" (offline, no processes): brute force, constraints, the cost terms."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpp.errors import MicroBatchError, PartitionError, ProfileMismatchError
from lightning_hpp.pipeline.data import can_rebatch, rebatch
from lightning_hpp.planning.devices import stage_kind_orders
from lightning_hpp.planning.profile import CostProfile, Overheads, ProfileEntry, UnitCost, fit_fixed_costs
from lightning_hpp.planning.search import search_plan

LINK = 25.0


def _profile(rng: random.Random, n: int, kinds: list[str], b0: int) -> CostProfile:
    names = [f"u{i}" for i in range(n)]
    params = [rng.choice([0, 1e3, 5e4, 2e5]) for _ in names]
    act = [rng.choice([1e2, 1e4, 1e5]) for _ in names]
    entries = []
    for k in kinds:
        speed = rng.choice([1.0, 1.5, 2.0])
        units = []
        for i, name in enumerate(names):
            step = rng.uniform(0.2, 3.0) * speed
            units.append(UnitCost(name, step / 3, 2 * step / 3, int(params[i]), int(act[i]), int(3 * act[i]),
                                  fixed_ms=rng.uniform(0, step)))
        loss = rng.uniform(0, 1)
        oh = Overheads(microbatch_ms=rng.uniform(0, 0.5), step_ms=rng.uniform(0, 2), loss_ms=loss,
                       loss_fixed_ms=rng.uniform(0, loss), optimizer_ms_per_mb=rng.choice([0.0, 0.5]),
                       p2p_latency_ms=rng.uniform(0, 0.2), p2p_gbps=rng.choice([0.0, 0.5, 2.0]),
                       allreduce_gbps=rng.choice([0.0, 0.1, 1.0]))
        entries.append(ProfileEntry(k, "32-true", units, overheads=oh))
    return CostProfile("m", names, [1] * n, [[b0, 4]], entries)


def _model_step(prof, kinds_of_stage, cuts, p, dp, m, sched, per_replica, mem):
    """The cost model of lightning_hpp.planning.search, written out for one candidate (None if it does not fit)."""
    b0 = prof.microbatch_size
    scale = per_replica / m / b0
    n = len(prof.unit_names)
    times, updates, steps = [], [], []
    for s in range(p):
        i, j = cuts[s], cuts[s + 1]
        worst_t, worst_u = 0.0, 0.0
        for k in kinds_of_stage[s]:
            e = prof.get(k, "32-true")
            oh = e.overheads
            bw = (oh.p2p_gbps or LINK) * 1e6
            us = e.units[i:j]
            t = sum(u.fixed_ms + (u.step_ms - u.fixed_ms) * scale for u in us) + oh.microbatch_ms
            if j == n:
                t += oh.loss_fixed_ms + (oh.loss_ms - oh.loss_fixed_ms) * scale
            sent = (e.units[j - 1].activation_bytes if j < n else 0) + (e.units[i - 1].activation_bytes if i > 0 else 0)
            t += ((i > 0) + (j < n)) * oh.p2p_latency_ms + sent * scale / bw
            params = sum(u.param_bytes for u in us)
            ar_bw = oh.allreduce_gbps * 1e6 if oh.allreduce_gbps else bw  # the measured all-reduce, else the link
            u_ = 2 * (dp - 1) / dp * params / ar_bw + 2 * (dp - 1) * oh.p2p_latency_ms + params / 1e6 * oh.optimizer_ms_per_mb
            in_flight = m if sched == "gpipe" else min(m, p - s)
            need = params * 4 + in_flight * sum(u.saved_bytes for u in us) * scale
            if need > mem.get(k, float("inf")):
                return None
            worst_t, worst_u = max(worst_t, t), max(worst_u, u_)
            steps.append(oh.step_ms)
        times.append(worst_t)
        updates.append(worst_u)
    return (m + p - 1) * max(times) + max(updates) + max(steps)


def _brute_force(prof, rank_kinds, batch, groups, mem, pp=None, m_fixed=None, sched_fixed=None, limit=32):
    world, n = len(rank_kinds), len(prof.unit_names)
    best = None
    for p in range(1, min(n, world) + 1):
        if world % p or (pp is not None and p != pp):
            continue
        dp = world // p
        if dp % groups or batch % (dp // groups):
            continue
        per_replica = batch // (dp // groups)
        for sched in ["gpipe", "1f1b"] if sched_fixed is None else [sched_fixed]:
            for m in range(1, min(per_replica, limit) + 1):
                if per_replica % m or (m_fixed is not None and m != m_fixed) or (sched == "1f1b" and m < p):
                    continue
                if p == 1:
                    orders = [[sorted(set(rank_kinds))]]
                else:
                    orders = [[[k] for k in o] for o in stage_kind_orders(rank_kinds, p, dp)]
                for order in orders:
                    for inner in itertools.combinations(range(1, n), p - 1):
                        v = _model_step(prof, order, [0, *inner, n], p, dp, m, sched, per_replica, mem)
                        if v is not None and (best is None or v < best[0]):
                            best = (v, p, m, sched)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_search_equals_brute_force_over_pp_dp_m_schedule_and_cuts(seed):
    rng = random.Random(seed)
    kinds = ["fast", "slow", "mid"][: rng.choice([1, 2, 2, 3])]
    world = rng.choice([2, 3, 4]) if len(kinds) < 3 else 3
    rank_kinds = [kinds[r % len(kinds)] for r in range(world)]
    n = rng.randint(2, 5)
    prof = _profile(rng, n, kinds, b0=rng.choice([2, 4]))
    groups = rng.choice([1, 1, 2]) if world % 2 == 0 else 1
    batch = rng.choice([8, 12, 16])
    mem = {k: rng.choice([float("inf"), 2e6]) for k in kinds}
    fixed = rng.choice([{}, {"pp": world}, {"m_fixed": 4}, {"sched_fixed": "gpipe"}])
    want = _brute_force(prof, rank_kinds, batch, groups, mem, **fixed)
    kwargs = dict(batch_size=batch, data_groups=groups, memory_bytes=mem, link_gbps=LINK, pp_degree=fixed.get("pp"),
                  n_microbatches=fixed.get("m_fixed"), schedule=fixed.get("sched_fixed"))
    if want is None:
        with pytest.raises(PartitionError):
            search_plan(prof, rank_kinds, **kwargs)
        return
    got = search_plan(prof, rank_kinds, **kwargs)
    assert got.step_ms == pytest.approx(want[0], rel=1e-9, abs=1e-9), (got.format_table(), want)
    # the reported plan is the candidate the model says it is
    again = _model_step(prof, [s.replica_kinds or [s.device] for s in got.stages],
                        [0, *itertools.accumulate(len(s.units) for s in got.stages)], got.pp_degree, got.dp_degree,
                        got.n_microbatches, got.schedule, batch // (got.dp_degree // groups), mem)
    assert again == pytest.approx(got.step_ms, rel=1e-9)
    assert got.pp_degree * got.dp_degree == world and got.dp_degree % groups == 0
    if "pp" in fixed:
        assert got.pp_degree == fixed["pp"]
    if "m_fixed" in fixed:
        assert got.n_microbatches == 4
    if "sched_fixed" in fixed and got.pp_degree > 1:
        assert got.schedule == "gpipe"
    assert sorted(r for row in got.ranks for r in row) == list(range(world))


def _mlp_profile(fixed_share: float, slow: float | None, gbps: float = 1.0) -> CostProfile:
    """A 12-block MLP + head measured at micro-batch 16: weight re-reads are ``fixed_share`` of each block."""
    names = [f"blocks.{i}" for i in range(12)] + ["head"]
    act = 16 * 1024 * 4

    def entry(kind, speed):
        units = [UnitCost(nm, 1.0 * speed, 2.0 * speed, 4 << 20, act, 2 * act, fixed_ms=3.0 * speed * fixed_share)
                 for nm in names[:-1]]
        units.append(UnitCost("head", 0.02 * speed, 0.04 * speed, 40960, 640, 640))
        oh = Overheads(microbatch_ms=0.3 * speed, step_ms=2.0, loss_ms=0.1, optimizer_ms_per_mb=0.5 * speed,
                       p2p_latency_ms=0.1, p2p_gbps=gbps)
        return ProfileEntry(kind, "32-true", units, overheads=oh)

    entries = [entry("fast", 1.0)] + ([entry("slow", slow)] if slow else [])
    return CostProfile("ParamMLP", names, [1] * 13, [[16, 1024]], entries)


def test_equal_ranks_and_compute_bound_model_choose_plain_data_parallel():
    got = search_plan(_mlp_profile(0.1, None, gbps=10.0), ["fast", "fast"], batch_size=192)
    assert (got.pp_degree, got.dp_degree, got.n_microbatches) == (1, 2, 1), got.format_table()
    assert got.plan.num_stages == 1 and got.ranks == [[0, 1]]
    assert got.microbatch_size == 96  # each replica takes half of the loader's batch


def test_half_speed_rank_chooses_a_pipeline_with_few_microbatches():
    prof = _mlp_profile(0.3, 2.0)
    got = search_plan(prof, ["fast", "slow"], batch_size=192)
    assert got.pp_degree == 2 and [s.device for s in got.stages] == ["fast", "slow"], got.format_table()
    assert len(got.stages[0].units) > len(got.stages[1].units)
    ddp = search_plan(prof, ["fast", "slow"], batch_size=192, pp_degree=1)
    many = search_plan(prof, ["fast", "slow"], batch_size=192, pp_degree=2, n_microbatches=24)
    assert got.step_ms < ddp.step_ms and got.step_ms < many.step_ms
    assert got.n_microbatches < 24  # the weights are re-read per micro-batch: fewer, larger ones pay less


def test_user_constraints_are_kept_and_impossible_ones_say_why():
    prof = _mlp_profile(0.1, None)
    got = search_plan(prof, ["fast", "fast"], batch_size=192, pp_degree=2, n_microbatches=8, schedule="1f1b")
    assert (got.pp_degree, got.n_microbatches, got.schedule) == (2, 8, "1f1b")
    with pytest.raises(PartitionError, match=r"n_microbatches=7.*divides"):
        search_plan(prof, ["fast", "fast"], batch_size=192, n_microbatches=7)
    with pytest.raises(PartitionError, match="interleaved1f1b"):
        search_plan(prof, ["fast", "fast"], batch_size=192, schedule="interleaved1f1b")
    # a loader that cannot be rebatched keeps one replica per loader batch: pp=1 would need two
    kept = search_plan(prof, ["fast", "fast"], batch_size=192, split_batches=False)
    assert kept.dp_degree == 1 and kept.pp_degree == 2


def test_fixed_costs_are_fitted_from_two_microbatch_sizes_and_saved(tmp_path):
    def prof(b, times):
        units = [UnitCost(f"u{i}", t / 3, 2 * t / 3, 8, 8) for i, t in enumerate(times)]
        return CostProfile("m", ["u0", "u1"], [1, 1], [[b, 4]], [ProfileEntry("cpu", "32-true", units)])

    # u0: 1 ms + 0.25 ms per sample; u1: no fixed part (noise would tip it below 0: clipped)
    big, small = prof(16, [5.0, 4.0]), prof(4, [2.0, 0.9])
    fitted = fit_fixed_costs(big, small)
    u0, u1 = fitted.entries[0].units
    assert u0.fixed_ms == pytest.approx(1.0) and u1.fixed_ms == 0.0
    fitted.entries[0].overheads = Overheads(microbatch_ms=0.5, p2p_gbps=2.0)
    fitted.save(tmp_path / "p.json")
    back = CostProfile.load(tmp_path / "p.json")
    assert back.entries[0].units[0].fixed_ms == pytest.approx(1.0)
    assert back.entries[0].overheads == Overheads(microbatch_ms=0.5, p2p_gbps=2.0)
    with pytest.raises(ProfileMismatchError, match="small < big"):
        fit_fixed_costs(small, big)


def test_rebatch_makes_loader_batches_smaller_once():
    loader = DataLoader(TensorDataset(torch.arange(24.0)), batch_size=12)
    assert can_rebatch(loader)
    rebatch(loader, 2)
    rebatch(loader, 2)  # idempotent: the same loader processed twice
    assert [len(b[0]) for b in loader] == [6, 6, 6, 6]
    with pytest.raises(MicroBatchError, match="divisible by 5"):
        rebatch(loader, 5)
