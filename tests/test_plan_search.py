"""The whole-plan search behind plan="auto" (offline, no processes): brute force over every schedule family
(torch's own orders replayed by the telemetry's simulate), constraints, the cost terms."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpp.errors import MicroBatchError, PartitionError, ProfileMismatchError, ScheduleError
from lightning_hpp.pipeline.data import can_rebatch, rebatch
from lightning_hpp.pipeline.schedules import SCHEDULES, check_schedule
from lightning_hpp.planning.devices import stage_kind_orders
from lightning_hpp.planning.measure import fit_fixed_costs
from lightning_hpp.planning.profile import CostProfile, Overheads, ProfileEntry, UnitCost
from lightning_hpp.planning.replay import rank_of_stages
from lightning_hpp.planning.search import search_plan
from lightning_hpp.telemetry.model import schedule_actions, simulate

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
                       allreduce_gbps=rng.choice([0.0, 0.1, 1.0]), allreduce_overlap=rng.choice([1.0, 0.0, 0.5]))
        entries.append(ProfileEntry(k, "32-true", units, overheads=oh))
    return CostProfile("m", names, [1] * n, [[b0, 4]], entries)


def _costs(prof, k, i, j, n, scale):
    """Forward, backward, loss and per-micro-batch costs of units [i, j) on kind k, as the model writes them."""
    e = prof.get(k, "32-true")
    oh = e.overheads
    us = e.units[i:j]
    fwd = sum((u.fixed_ms + (u.step_ms - u.fixed_ms) * scale) * u.fwd_ms / u.step_ms for u in us)
    bwd = sum((u.fixed_ms + (u.step_ms - u.fixed_ms) * scale) * u.bwd_ms / u.step_ms for u in us)
    loss = oh.loss_fixed_ms + (oh.loss_ms - oh.loss_fixed_ms) * scale if j == n else 0.0
    return e, oh, fwd, bwd, loss


def _ring(oh, params, dp):
    ar_bw = oh.allreduce_gbps * 1e6 if oh.allreduce_gbps else (oh.p2p_gbps or LINK) * 1e6
    return 2 * (dp - 1) / dp * params / ar_bw + 2 * (dp - 1) * oh.p2p_latency_ms


def _update(oh, ring, tail, backward, params, dp):
    """The optimizer, and what of the all-reduce one micro-batch's backward does not hide (at least the last bucket;
    all of it where the kind's reduction cannot run beside the backward, ``allreduce_overlap=0``)."""
    exposed = max(tail, ring - oh.allreduce_overlap * backward) if dp > 1 else 0.0
    return exposed + params / 1e6 * oh.optimizer_ms_per_mb


def _data_parallel_step(prof, kinds, n, dp, m, per_replica, mem, held=1):
    """pp = 1: m micro-batches of the whole model in turn, the slowest kind's; ``held`` micro-batches' activations
    live at once (1 for 1F1B; all ``m`` for GPipe, which runs every forward before the first backward)."""
    scale = per_replica / m / prof.microbatch_size
    times, updates, steps = [], [], []
    for k in kinds:
        e, oh, fwd, bwd, loss = _costs(prof, k, 0, n, n, scale)
        params = sum(u.param_bytes for u in e.units)
        if params * 4 + held * sum(u.saved_bytes for u in e.units) * scale > mem.get(k, float("inf")):
            return None
        times.append(fwd + bwd + loss + oh.microbatch_ms)
        updates.append(_update(oh, _ring(oh, params, dp), _ring(oh, e.units[0].param_bytes, dp), bwd, params, dp))
        steps.append(oh.step_ms)
    return m * max(times) + max(updates) + max(steps)


def _pipeline_step(prof, position_kinds, cuts, sched, p, dp, m, per_replica, mem):
    """pp > 1: torch's own order of `sched` replayed by the telemetry's simulate (None if it does not fit)."""
    scale = per_replica / m / prof.microbatch_size
    n, S = len(prof.unit_names), len(cuts) - 1
    rank_of = [s for s in range(S)] if S == p else list(rank_of_stages(sched, p, S))
    cost, params, stash = {}, [0.0] * p, [0.0] * S
    rings, tails, windows, steps = [0.0] * p, [None] * p, [0.0] * p, []
    for s in range(S):
        r, (i, j) = rank_of[s], (cuts[s], cuts[s + 1])
        e, oh, fwd, bwd, loss = _costs(prof, position_kinds[r], i, j, n, scale)
        bw = (oh.p2p_gbps or LINK) * 1e6
        f = fwd + oh.microbatch_ms / 2 + loss / 3
        b = bwd + oh.microbatch_ms / 2 + 2 * loss / 3
        if s + 1 < S and rank_of[s + 1] != r:
            f += oh.p2p_latency_ms + e.units[j - 1].activation_bytes * scale / bw
        if s > 0 and rank_of[s - 1] != r:
            b += oh.p2p_latency_ms + e.units[i - 1].activation_bytes * scale / bw
        cost[s] = {"F": f, "B": b, "I": b - bwd / 2, "W": bwd / 2}
        par = sum(u.param_bytes for u in e.units[i:j])
        params[r] += par
        stash[s] = sum(u.saved_bytes for u in e.units[i:j]) * scale
        rings[r] += _ring(oh, par, dp)
        windows[r] += bwd
        if tails[r] is None:  # the rank's lowest stage: its first unit's gradients come last
            tails[r] = _ring(oh, e.units[i].param_bytes, dp)
        steps.append(oh.step_ms)
    orders = schedule_actions(sched, p, m, S)
    for r, acts in orders.items():  # the activations held: a forward keeps them, B (or W) frees them
        held, peak = [0] * S, 0.0
        for a in acts:
            held[a.stage] += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
            peak = max(peak, sum(h * x for h, x in zip(held, stash)))
        if params[rank_of[acts[0].stage]] * 4 + peak > mem.get(position_kinds[rank_of[acts[0].stage]], float("inf")):
            return None
    span = simulate(orders, lambda a: cost[a.stage][a.kind]).makespan
    ohs = [prof.get(position_kinds[r], "32-true").overheads for r in range(p)]
    updates = [_update(ohs[r], rings[r], tails[r], windows[r], params[r], dp) for r in range(p)]
    return span + max(updates) + max(steps)


def _brute_force(prof, rank_kinds, batch, groups, mem, pp=None, m_fixed=None, sched_fixed=None, limit=32, vmax=4):
    world, n = len(rank_kinds), len(prof.unit_names)
    best = None
    for p in range(1, min(n, world) + 1):
        if world % p or (pp is not None and p != pp):
            continue
        dp = world // p
        if dp % groups or batch % (dp // groups):
            continue
        per_replica = batch // (dp // groups)
        for sched in SCHEDULES if sched_fixed is None else [sched_fixed]:
            kind = SCHEDULES[sched]
            if p == 1 and kind.multi:
                continue
            vs = [1] if not kind.multi or p == 1 else [2] if kind.style == "v" else range(2, vmax + 1)
            for v in vs:
                S = p * v
                if S > n:
                    continue
                for m in range(1, min(per_replica, limit) + 1):
                    if per_replica % m or (m_fixed is not None and m != m_fixed):
                        continue
                    try:
                        check_schedule(sched, S, p, m)
                    except ScheduleError:
                        continue
                    if p == 1:
                        val = _data_parallel_step(prof, sorted(set(rank_kinds)), n, dp, m, per_replica, mem,
                                                  held=m if sched == "gpipe" else 1)
                        cands = [] if val is None else [val]
                    else:
                        cands = []
                        for order in stage_kind_orders(rank_kinds, p, dp):
                            for inner in itertools.combinations(range(1, n), S - 1):
                                val = _pipeline_step(prof, order, [0, *inner, n], sched, p, dp, m, per_replica, mem)
                                if val is not None:
                                    cands.append(val)
                    for val in cands:
                        if best is None or val < best[0] - 1e-9:
                            best = (val, p, m, sched, v)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_search_equals_brute_force_over_pp_dp_m_schedule_and_cuts(seed):
    rng = random.Random(seed)
    kinds = ["fast", "slow", "mid"][: rng.choice([1, 2, 2, 3])]
    world = rng.choice([2, 3, 4]) if len(kinds) < 3 else 3
    rank_kinds = [kinds[r % len(kinds)] for r in range(world)]
    n = rng.randint(2, 6)
    prof = _profile(rng, n, kinds, b0=rng.choice([2, 4]))
    groups = rng.choice([1, 1, 2]) if world % 2 == 0 else 1
    batch = rng.choice([8, 12, 16])
    mem = {k: rng.choice([float("inf"), 2e6]) for k in kinds}
    fixed = rng.choice([{}, {"pp": world}, {"m_fixed": 4}, {"sched_fixed": rng.choice(list(SCHEDULES))}])
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
    per_replica = batch // (got.dp_degree // groups)
    if got.pp_degree == 1:
        again = _data_parallel_step(prof, got.stages[0].replica_kinds or [got.stages[0].device], len(prof.unit_names),
                                    got.dp_degree, got.n_microbatches, per_replica, mem)
    else:
        kinds = [got.stages[got.positions.index(r)].device for r in range(got.pp_degree)]
        again = _pipeline_step(prof, kinds, [0, *itertools.accumulate(len(s.units) for s in got.stages)], got.schedule,
                               got.pp_degree, got.dp_degree, got.n_microbatches, per_replica, mem)
    assert again == pytest.approx(got.step_ms, rel=1e-9)
    assert got.pp_degree * got.dp_degree == world and got.dp_degree % groups == 0
    if "pp" in fixed:
        assert got.pp_degree == fixed["pp"]
    if "m_fixed" in fixed:
        assert got.n_microbatches == 4
    if "sched_fixed" in fixed:
        assert got.schedule == fixed["sched_fixed"]
    assert sorted(r for row in got.ranks for r in row) == list(range(world))


def _bubble_bound_profile(n: int, latency: float = 0.0) -> CostProfile:
    """``n`` units of 1 ms forward and 2 ms backward, no parameters, no fixed costs: the bubble is all there is."""
    names = [f"u{i}" for i in range(n)]
    units = [UnitCost(nm, 1.0 + 0.1 * (i % 3), 2.0 + 0.2 * (i % 3), 0, 1000, 1000) for i, nm in enumerate(names)]
    entry = ProfileEntry("cpu", "32-true", units, overheads=Overheads(p2p_latency_ms=latency))
    return CostProfile("m", names, [1] * n, [[4, 4]], [entry])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_schedule_family_gets_its_known_optimum(schedule):
    # unequal units, 2 ranks, a few micro-batches: the cuts, the micro-batch count and v all matter
    prof = _bubble_bound_profile(6, latency=0.2)
    want = _brute_force(prof, ["cpu", "cpu"], 16, 1, {}, pp=2, sched_fixed=schedule, limit=8)
    got = search_plan(prof, ["cpu", "cpu"], batch_size=16, pp_degree=2, schedule=schedule, max_microbatches=8)
    assert got.schedule == schedule and got.pp_degree == 2
    assert got.step_ms == pytest.approx(want[0], rel=1e-9), (got.format_table(), want)
    assert (got.n_microbatches, got.stages_per_rank) == (want[2], want[4])
    assert got.plan.num_stages == 2 * got.stages_per_rank
    assert len(got.ranks) == 2 and sorted(got.positions) == sorted(list(range(2)) * got.stages_per_rank)


def test_few_microbatches_make_a_multi_stage_schedule_win():
    # two micro-batches on two ranks: one stage per rank idles a third of the step, v stages per rank far less
    prof = _bubble_bound_profile(8)
    got = search_plan(prof, ["cpu", "cpu"], batch_size=8, pp_degree=2, n_microbatches=2)
    want = _brute_force(prof, ["cpu", "cpu"], 8, 1, {}, pp=2, m_fixed=2)
    assert got.step_ms == pytest.approx(want[0], rel=1e-9) and got.schedule == want[3]
    assert SCHEDULES[got.schedule].multi and got.stages_per_rank >= 2, got.format_table()
    single = min(search_plan(prof, ["cpu", "cpu"], batch_size=8, pp_degree=2, n_microbatches=2, schedule=s).step_ms
                 for s in ("gpipe", "1f1b"))
    assert got.step_ms < 0.85 * single
    # the V keeps the tip of the pipeline on one rank: with a costly link it sends fewer messages than the loop
    slow = _bubble_bound_profile(8, latency=0.5)
    zbv = search_plan(slow, ["cpu", "cpu"], batch_size=8, pp_degree=2, n_microbatches=2, schedule="zbv")
    loop = search_plan(slow, ["cpu", "cpu"], batch_size=8, pp_degree=2, n_microbatches=2, schedule="interleaved_zb")
    assert zbv.stages[1].comm_ms < loop.stages[1].comm_ms and zbv.positions == [0, 1, 1, 0]


def test_large_models_are_cut_by_local_search_from_the_bottleneck_cut(monkeypatch):
    import lightning_hpp.planning.solver as solver

    prof = _bubble_bound_profile(6, latency=0.2)
    exact = search_plan(prof, ["cpu", "cpu"], batch_size=8, pp_degree=2, n_microbatches=4, schedule="zbv")
    monkeypatch.setattr(solver, "EXACT_CUTS", 0)
    local = search_plan(prof, ["cpu", "cpu"], batch_size=8, pp_degree=2, n_microbatches=4, schedule="zbv")
    cuts = [0, *itertools.accumulate(len(s.units) for s in local.stages)]
    assert local.step_ms == pytest.approx(_pipeline_step(prof, ["cpu", "cpu"], cuts, "zbv", 2, 1, 4, 8, {}), rel=1e-9)
    assert exact.step_ms <= local.step_ms <= 1.05 * exact.step_ms


def _mlp_profile(fixed_share: float, slow: float | None, gbps: float = 1.0, optimizer: float = 0.5) -> CostProfile:
    """A 12-block MLP + head measured at micro-batch 16: weight re-reads are ``fixed_share`` of each block."""
    names = [f"blocks.{i}" for i in range(12)] + ["head"]
    act = 16 * 1024 * 4

    def entry(kind, speed):
        units = [UnitCost(nm, 1.0 * speed, 2.0 * speed, 4 << 20, act, 2 * act, fixed_ms=3.0 * speed * fixed_share)
                 for nm in names[:-1]]
        units.append(UnitCost("head", 0.02 * speed, 0.04 * speed, 40960, 640, 640))
        oh = Overheads(microbatch_ms=0.3 * speed, step_ms=2.0, loss_ms=0.1, optimizer_ms_per_mb=optimizer * speed,
                       p2p_latency_ms=0.1, p2p_gbps=gbps)
        return ProfileEntry(kind, "32-true", units, overheads=oh)

    entries = [entry("fast", 1.0)] + ([entry("slow", slow)] if slow else [])
    return CostProfile("ParamMLP", names, [1] * 13, [[16, 1024]], entries)


def test_equal_ranks_and_compute_bound_model_choose_plain_data_parallel():
    got = search_plan(_mlp_profile(0.1, None, gbps=10.0, optimizer=0.1), ["fast", "fast"], batch_size=192)
    assert (got.pp_degree, got.dp_degree, got.n_microbatches) == (1, 2, 1), got.format_table()
    assert got.plan.num_stages == 1 and got.ranks == [[0, 1]]
    assert got.microbatch_size == 96  # each replica takes half of the loader's batch
    # where the optimizer's update is costly, two ranks that each update half of the model beat two that update all
    # of it, once the zero-bubble split leaves the pipeline almost no bubble
    split = search_plan(_mlp_profile(0.1, None, gbps=10.0, optimizer=0.5), ["fast", "fast"], batch_size=192)
    ddp = search_plan(_mlp_profile(0.1, None, gbps=10.0, optimizer=0.5), ["fast", "fast"], batch_size=192, pp_degree=1)
    assert split.pp_degree == 2 and split.step_ms < ddp.step_ms and split.update_ms < ddp.allreduce_ms / 2 + 1


def test_an_all_reduce_that_cannot_hide_behind_the_backward_makes_the_pipeline_win():
    """On CPU ranks gloo sums the gradients on the cores the backward computes on (``allreduce_overlap=0``): the
    step waits for the whole ring, and four equal ranks pipeline instead of replicating the model four times."""
    def profile(overlap):
        prof = _mlp_profile(0.1, None, gbps=1.0, optimizer=0.1)
        for e in prof.entries:
            e.overheads = dataclasses.replace(e.overheads, allreduce_gbps=1.0, allreduce_overlap=overlap)
        return prof

    hidden = search_plan(profile(1.0), ["fast"] * 4, batch_size=192)
    assert (hidden.pp_degree, hidden.dp_degree) == (1, 4), hidden.format_table()
    exposed = search_plan(profile(0.0), ["fast"] * 4, batch_size=192)
    assert exposed.pp_degree == 4 and exposed.dp_degree == 1, exposed.format_table()
    ddp = search_plan(profile(0.0), ["fast"] * 4, batch_size=192, pp_degree=1)
    params = sum(u.param_bytes for u in profile(0.0).entries[0].units)
    ring = 2 * 3 / 4 * params / 1e6 + 2 * 3 * 0.1  # ms at 1 GB/s, 6 messages of 0.1 ms
    # all of the ring (not what the last backward leaves of it), then the optimizer's update
    assert ddp.allreduce_ms == pytest.approx(ring + params / 1e6 * 0.1, rel=1e-6)
    assert exposed.step_ms < ddp.step_ms


def test_half_speed_rank_chooses_a_pipeline_with_few_microbatches():
    prof = _mlp_profile(0.3, 2.0)
    got = search_plan(prof, ["fast", "slow"], batch_size=192)
    assert got.pp_degree == 2 and got.ranks == [[0], [1]], got.format_table()
    assert [s.device for s in got.stages] == [["fast", "slow"][r] for r in got.positions]
    units = [sum(len(s.units) for s, r in zip(got.stages, got.positions) if r == q) for q in (0, 1)]
    assert units[0] > units[1]  # the fast rank holds more of the model
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
    fixed = search_plan(prof, ["fast", "fast"], batch_size=192, schedule="ScheduleInterleaved1F1B")  # torch's name
    assert fixed.schedule == "interleaved1f1b" and fixed.stages_per_rank >= 2 and fixed.pp_degree == 2
    with pytest.raises(PartitionError, match="interleaved1f1b.*'pipedream'"):
        search_plan(prof, ["fast", "fast"], batch_size=192, schedule="pipedream")
    with pytest.raises(PartitionError, match="pp=1: one stage cannot run 'zbv'"):
        search_plan(prof, ["fast", "fast"], batch_size=192, schedule="zbv", pp_degree=1)
    with pytest.raises(PartitionError, match="pp=2, zbv: needs at least 4 stages, more than the model's 3 units"):
        search_plan(_bubble_bound_profile(3), ["cpu", "cpu"], batch_size=8, schedule="zbv")
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


# ------------------------------------------------------------ data_parallel: ddp, or fsdp where memory decides
BIG, SMALL = 1e6, 1e4  # parameter bytes of the two units of _lopsided()


def _lopsided(latency: float = 0.01, gbps: float = 1.0) -> CostProfile:
    """Two units, one holding nearly all parameters, so no pipeline cut relieves its rank: on 4 ranks ddp needs
    4 x params on some rank in every layout (pp=1: the whole model; pp=2: the big unit), fsdp over dp=2 as
    much (params x 4 / 2 + 2 x params gathered), and fsdp over dp=4 (pp=1) 3 x params."""
    units = [UnitCost("u0", 1.0, 2.0, int(BIG), 100, 300), UnitCost("u1", 0.5, 1.0, int(SMALL), 100, 300)]
    oh = Overheads(p2p_latency_ms=latency, allreduce_gbps=gbps, p2p_gbps=gbps)
    return CostProfile("m", ["u0", "u1"], [1, 1], [[2, 4]], [ProfileEntry("fast", "32-true", units, overheads=oh)])


def test_with_ample_memory_auto_keeps_ddp_and_fsdp_pays_the_all_gather():
    prof = _lopsided()
    got = search_plan(prof, ["fast"] * 4, batch_size=8, data_parallel=None, memory_bytes={"fast": 1e9})
    assert got.data_parallel == "ddp" and got.dp_shard == 1, got.format_table()
    assert got.plan.meta["predicted"]["data_parallel"] == "ddp" and "chose data_parallel=ddp" in got.format_table()
    # the same structure sharded over its 4 replicas: the all-gather of the parameters per step on top
    ddp = search_plan(prof, ["fast"] * 4, batch_size=8, pp_degree=1, n_microbatches=2)
    fsdp = search_plan(prof, ["fast"] * 4, batch_size=8, pp_degree=1, n_microbatches=2, data_parallel="fsdp")
    gather = 3 / 4 * (BIG + SMALL) / 1e6 + 3 * 0.01
    assert (fsdp.data_parallel, fsdp.dp_shard) == ("fsdp", 4)
    assert fsdp.step_ms == pytest.approx(ddp.step_ms + gather, rel=1e-12)
    assert fsdp.stages[0].allreduce_ms == pytest.approx(ddp.stages[0].allreduce_ms + gather, rel=1e-12)


def test_where_only_sharded_stages_fit_auto_chooses_fsdp_with_the_memory_model_of_sharded_stages():
    from lightning_hpp.planning.memory import stage_memory_bytes

    prof = _lopsided()
    got = search_plan(prof, ["fast"] * 4, batch_size=8, data_parallel=None, memory_bytes={"fast": 3.5e6})
    assert (got.pp_degree, got.dp_degree, got.data_parallel, got.dp_shard) == (1, 4, "fsdp", 4), got.format_table()
    est = got.stages[0]
    scale = got.microbatch_size / prof.microbatch_size
    want = stage_memory_bytes(BIG + SMALL, 3.0, est.in_flight, 600 * scale, dp_shard=4,
                              n_microbatches=got.n_microbatches,
                              largest_unit_bytes=BIG)
    assert est.memory_bytes == pytest.approx(want, rel=1e-12) and est.memory_bytes <= 3.5e6
    assert got.plan.meta["predicted"]["data_parallel"] == "fsdp" and got.plan.meta["predicted"]["dp_shard"] == 4
    table = got.format_table()
    assert "data_parallel=fsdp (each stage sharded over 4 replicas)" in table and "chose data_parallel=fsdp" in table


def test_where_nothing_fits_the_error_names_the_modes_tried_and_fixed_ddp_does_not_switch():
    prof = _lopsided()
    with pytest.raises(PartitionError, match=r"ddp, or fsdp.*pp=1, m=1: the whole model does not fit one device "
                                             r"\(ddp, fsdp over 4\)"):
        search_plan(prof, ["fast"] * 4, batch_size=8, data_parallel=None, memory_bytes={"fast": 3e6})
    # the user fixed ddp: the limit fsdp would meet is refused, not met by sharding
    with pytest.raises(PartitionError, match=r"data parallel ddp:.*the whole model does not fit one device \(ddp\)"):
        search_plan(prof, ["fast"] * 4, batch_size=8, data_parallel="ddp", memory_bytes={"fast": 3.5e6})
    with pytest.raises(PartitionError, match="data_parallel='zero3'"):
        search_plan(prof, ["fast"] * 4, batch_size=8, data_parallel="zero3")
    with pytest.raises(PartitionError, match="dp_replicate"):
        search_plan(prof, ["fast"] * 4, batch_size=8, data_parallel="hsdp")


def test_fixed_sharding_is_scored_for_every_candidate():
    from lightning_hpp.planning.memory import stage_memory_bytes

    prof = _lopsided()
    # fsdp fixed: the pipeline of two positions is sharded over its 2 replicas, and holds what the memory model says
    got = search_plan(prof, ["fast"] * 4, batch_size=8, pp_degree=2, n_microbatches=2, schedule="1f1b",
                      data_parallel="fsdp")
    assert (got.data_parallel, got.dp_shard, got.stages[0].in_flight) == ("fsdp", 2, 2)
    assert got.stages[0].memory_bytes == pytest.approx(stage_memory_bytes(BIG, 3.0, 2, 300, dp_shard=2))
    # one micro-batch: the stage's parameters and one unit's gradients, or with reshard_after_forward one unit
    # gathered at a time
    for raf in (False, True):
        one = search_plan(prof, ["fast"] * 4, batch_size=8, pp_degree=1, n_microbatches=1, data_parallel="fsdp",
                          reshard_after_forward=raf)
        assert one.stages[0].memory_bytes == pytest.approx(stage_memory_bytes(
            BIG + SMALL, 3.0, 1, 600, dp_shard=4, n_microbatches=1, reshard_after_forward=raf, largest_unit_bytes=BIG))
    # hsdp: sharded over dp / dp_replicate; a dp that dp_replicate does not divide is excluded, saying so
    h = search_plan(prof, ["fast"] * 4, batch_size=8, pp_degree=1, data_parallel="hsdp", dp_replicate=2)
    assert (h.data_parallel, h.dp_shard) == ("hsdp", 2)
    with pytest.raises(PartitionError, match="dp=2 replicas cannot form dp_replicate=4 hsdp groups"):
        search_plan(prof, ["fast"] * 4, batch_size=8, pp_degree=2, data_parallel="hsdp", dp_replicate=4)


@pytest.mark.parametrize("seed", range(12))
def test_where_ddp_fits_the_fsdp_branch_changes_nothing(seed):
    """With unlimited memory auto is today's search; under a limit, wherever it keeps ddp the plan is the same."""
    rng = random.Random(seed)
    kinds = ["fast", "slow"][: rng.choice([1, 2])]
    world = rng.choice([2, 4])
    rank_kinds = [kinds[r % len(kinds)] for r in range(world)]
    prof = _profile(rng, rng.randint(2, 5), kinds, b0=2)
    for mem in ({}, {k: rng.choice([float("inf"), 2e6]) for k in kinds}):
        kwargs = {"batch_size": 8, "memory_bytes": mem, "link_gbps": LINK}
        try:
            today = search_plan(prof, rank_kinds, **kwargs)
        except PartitionError:
            today = None
        auto = search_plan(prof, rank_kinds, data_parallel=None, **kwargs) if today is not None or mem else None
        if not mem:
            assert auto.data_parallel == "ddp"
        if today is not None and auto.data_parallel == "ddp":
            assert auto.predicted() == today.predicted() and auto.ranks == today.ranks
            # the table too, but for its last line: what was searched
            assert auto.format_table().splitlines()[:-1] == today.format_table().splitlines()[:-1]


# ============================================================================ tensor parallel in the search
def _blocks(n: int = 4, split: float = 0.9, reduces=(2, 2), params: int = 1 << 20, degrees=(1, 2, 4)) -> CostProfile:
    """``n`` transformer-like blocks of ``params`` bytes each, ``split`` of them split by the model's tp plan."""
    names = [f"layers.{i}" for i in range(n)]
    units = [UnitCost(nm, 2.0, 4.0, params, 4096, 8192) for nm in names]
    oh = Overheads(p2p_latency_ms=0.01, p2p_gbps=10.0, allreduce_gbps=10.0)
    return CostProfile("tp", names, [1] * n, [[4, 8]], [ProfileEntry("fast", "32-true", units, overheads=oh)],
                       tp_split=[split] * n, tp_allreduces=[list(reduces)] * n, tp_degrees=list(degrees))


def test_tensor_parallel_splits_compute_and_memory_and_pays_its_per_layer_all_reduces():
    from lightning_hpp.planning.search import evaluate_plan

    prof = _blocks()
    halves = [prof.unit_names[:2], prof.unit_names[2:]]
    kw = dict(batch_size=8, n_microbatches=2, schedule="1f1b")
    one = evaluate_plan(prof, ["fast"] * 2, halves, ["fast"] * 2, **kw)
    two = evaluate_plan(prof, ["fast"] * 4, halves, ["fast"] * 2, tp_degree=2, **kw)
    assert (two.tp_degree, two.dp_degree, two.devices_used) == (2, 1, 4) and one.tp_degree == 1
    assert search_plan(prof, ["fast"] * 4, tp_degree=2, pp_degree=2, **kw).tp_degree == 2
    assert two.ranks == [[0, 1], [2, 3]]  # a replica's tp ranks are neighbours
    # compute: 0.9 of each block split in two; the forward and the backward each end in 2 all-reduces a block
    scale = 4 / 4  # micro-batches of the profile's size
    reduce_ms = 2 * 1 / 2 * 4096 * scale / 10e6 + 2 * 1 * 0.01  # ring over 2 ranks, and its 2 messages' latency
    share = 0.9 / 2 + 0.1
    assert two.stages[0].compute_ms == pytest.approx(2 * 6.0 * share + 2 * 2 * 2 * reduce_ms, rel=1e-9)
    # memory: each rank holds 1/tp of the split bytes and all of the rest (the share 1 / (dp_shard · tp))
    from lightning_hpp.planning.memory import stage_memory_bytes

    est = two.stages[0]
    assert est.memory_bytes == pytest.approx(
        stage_memory_bytes(2 * (1 << 20) * share, 3.0, 1, est.in_flight * 2 * 8192))
    assert two.plan.meta["predicted"]["tp_degree"] == 2 and "x tp=2" in two.format_table()


def test_tp_is_searched_only_among_the_degrees_the_model_divides_and_where_memory_asks_for_it():
    prof = _blocks(params=8 << 20)
    # 8 ranks, 25 MB each: every layout without tensor parallel holds at least a whole block's 32 MB of training
    # state on some rank (one block per position; sharding over replicas gathers it whole while a step runs)
    limit = {"fast": 25e6}
    with pytest.raises(PartitionError, match="no cut fits in memory"):
        search_plan(prof, ["fast"] * 8, batch_size=8, data_parallel=None, memory_bytes=limit)
    got = search_plan(prof, ["fast"] * 8, batch_size=8, tp_degree=None, data_parallel=None, memory_bytes=limit)
    assert got.tp_degree in (2, 4) and got.fits, got.format_table()
    assert max(s.memory_bytes for s in got.stages) <= 25e6
    assert "tp in [1, 2, 4]" in got.format_table()
    # a plan that splits nothing (no byte, no compute) only pays the all-reduces: never chosen
    assert search_plan(_blocks(split=0.0), ["fast"] * 8, batch_size=8, tp_degree=None,
                       data_parallel=None).tp_degree == 1
    # a model without a tp plan (the profile records [1]) is never split
    with pytest.raises(PartitionError, match="no cut fits in memory"):
        search_plan(_blocks(params=8 << 20, degrees=(1,)), ["fast"] * 8, batch_size=8, tp_degree=None,
                    data_parallel=None, memory_bytes=limit)


def test_a_tp_group_stays_on_one_host_unless_told_otherwise():
    prof = _blocks()
    hosts = ["a", "b"] * 2  # neighbouring ranks on different hosts
    with pytest.raises(PartitionError, match=r"tp=2: the group of ranks 0-1 spans hosts \['a', 'b'\]"):
        search_plan(prof, ["fast"] * 4, batch_size=8, tp_degree=2, hosts=hosts)
    assert search_plan(prof, ["fast"] * 4, batch_size=8, tp_degree=2, hosts=hosts, tp_across_hosts=True).tp_degree == 2
    assert search_plan(prof, ["fast"] * 4, batch_size=8, tp_degree=2, hosts=["a", "a", "b", "b"]).tp_degree == 2
    # mixed kinds within a group, and fp8 stages, are no tensor-parallel groups either
    mixed = _blocks()
    mixed.add(ProfileEntry("slow", "32-true", mixed.entries[0].units, overheads=mixed.entries[0].overheads))
    with pytest.raises(PartitionError, match="mixes device kinds"):
        search_plan(mixed, ["fast", "slow"] * 2, batch_size=8, tp_degree=2)


def test_the_profile_records_what_the_models_tp_plan_splits(tmp_path):
    from lightning_hpp.pipeline.tensor_parallel import plan_shape, resolve_tp_plan, tp_degrees
    from tests.harness.zoo.real import LMWrapper

    model = LMWrapper("llama", layers=2)
    units = ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1", "model.model.norm",
             "model.lm_head"]
    split, reduces = plan_shape(model, units, resolve_tp_plan(model, 2))
    layer = model.model.model.layers[0]
    whole = sum(p.numel() for p in layer.parameters())
    norms = sum(p.numel() for n, p in layer.named_parameters() if "norm" in n)
    assert split[1] == split[2] == pytest.approx((whole - norms) / whole) and split[0] == split[3] == split[4] == 0
    # q, k, v, gate, up colwise (an all-reduce of their input's gradient each); o, down rowwise (of their output)
    assert reduces == [[0, 0], [2, 5], [2, 5], [0, 0], [0, 0]]
    assert tp_degrees(model, 8) == [1, 2]  # 2 key/value heads: 4 and 8 do not divide them
    prof = _blocks()
    prof.save(tmp_path / "p.json")
    again = CostProfile.load(tmp_path / "p.json")
    assert (again.tp_split, again.tp_allreduces, again.tp_degrees) == (prof.tp_split, prof.tp_allreduces, [1, 2, 4])
