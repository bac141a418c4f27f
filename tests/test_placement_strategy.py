"""Placement inside HPPStrategy: stages by device kind, and plan="auto" on a running job."""

from __future__ import annotations

import pytest
import torch

from lightning_hpp.assembly.placement import kind_grid
from lightning_hpp.errors import PlacementError
from lightning_hpp.pipeline.dims import ParallelDims
from lightning_hpp.planning.plan import StagePlan, StageSpec
from lightning_hpp.planning.profile import CostProfile, ProfileEntry, UnitCost
from tests.harness.results import load_rank, merged_state
from tests.reference import train_reference

pytestmark = pytest.mark.slow


def _synthetic_profile(path, names):
    """Equal units; kind 'slow' takes twice as long as kind 'fast' (the cgroup-halved core)."""
    def entry(kind, scale):
        return ProfileEntry(kind, "32-true", [UnitCost(n, 1.0 * scale, 2.0 * scale, 1024, 256) for n in names],
                            source="synthetic")

    prof = CostProfile(model="MLP", unit_names=list(names), param_counts=[0] * len(names), input_shapes=[[4, 8]],
                       entries=[entry("fast", 1.0), entry("slow", 2.0)])
    prof.save(str(path))


def two_rank_runs(tmp_path) -> list[dict]:
    """This module's configurations for the shared 2-rank ``run_hpp`` job of tests/conftest.py (``hpp_jobs``);
    writes the synthetic profile they read into ``tmp_path``."""
    names = [f"layers.{i}" for i in range(11)]  # MLP(depth=6)
    _synthetic_profile(tmp_path / "profile.json", names)
    runs = [
        # measured on this machine's ranks, a pipeline fixed by the user: whatever the cut, training equals
        # single-process training
        {"name": "measured", "strategy": {}, "depth": 4, "steps": 16, "pp": 2, "schedule": "1f1b", "n_micro": 4},
        # nothing fixed, a tiny compute-bound model on two equal ranks: plain data parallelism (pp=1, dp=2),
        # each replica taking half of the loader's batch, so the global batch and the training stay the same
        {"name": "free", "strategy": {}, "depth": 4, "steps": 6},
        # a profile of two device kinds, rank 0 'fast' and rank 1 'slow' (2x): a pipeline, the fast rank gets ~2/3
        {"name": "kinds", "depth": 6,
         "strategy": {"placement": {"device_map": "0:fast,1:slow", "profile": str(tmp_path / "profile.json")}}},
    ]
    for r in runs:
        r.setdefault("steps", 4)
        r.update(batch=16, out=str(tmp_path / r["name"]))
    return runs


def four_rank_runs(tmp_path) -> list[dict]:
    """This module's configurations for the shared 4-rank ``run_hpp`` job: pp_degree=1 on 4 ranks with 1 byte less
    per device than ddp's whole model needs (4 x its parameter bytes with Adam's state), so only fsdp over the 4
    replicas fits (3 x the parameters, plus the activations); and plan="auto" over two kinds of two ranks each."""
    from tests.harness.zoo import MLP

    params = sum(p.numel() * p.element_size() for p in MLP(depth=4).parameters())
    _synthetic_profile(tmp_path / "profile.json", [f"layers.{i}" for i in range(11)])  # MLP(depth=6)
    return [{"name": "fsdp", "pp": 1, "steps": 4, "batch": 4, "out": str(tmp_path / "fsdp"),
             "strategy": {"placement": {"memory": {"cpu": 4 * params - 1}}}},
            # two fast and two slow ranks, nothing fixed: plan="auto" chooses two replicas of a two-stages-per-rank
            # pipeline (test_auto_plan_on_four_ranks_...)
            {"name": "kinds4", "depth": 6, "steps": 4, "batch": 16, "out": str(tmp_path / "kinds4"),
             "strategy": {"placement": {"device_map": "0:fast,1:fast,2:slow,3:slow",
                                        "profile": str(tmp_path / "profile.json")}}}]


def test_auto_plan_shards_the_stages_where_only_sharded_stages_fit(hpp_jobs):
    out = hpp_jobs.placement / "fsdp"
    ranks = [load_rank(out, r) for r in range(4)]
    predicted = ranks[0]["plan_meta"]["predicted"]
    assert (predicted["pp_degree"], predicted["dp_degree"], predicted["data_parallel"], predicted["dp_shard"]) == \
        (1, 4, "fsdp", 4)
    assert all(r["plan"] == ranks[0]["plan"] for r in ranks)  # every rank chose the same plan
    # the stages really are FSDP2-sharded: every parameter a DTensor shard, on every rank
    for r in ranks:
        assert r["sharded_stages"] and sorted(r["sharded"]) == sorted(r["state"]), r["sharded"]
    # and train as one process does on the global batch of the 4 replicas' loader batches
    reference, trainer = train_reference(steps=4, batch=16)
    for r in ranks:  # the gathered parameters of every replica
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6)
    # each replica logs the loss of its own quarter of the last batch: their mean is the one process's loss
    mean = sum(r["metrics"]["train_loss"] for r in ranks) / 4
    assert mean == pytest.approx(float(trainer.callback_metrics["train_loss"]), rel=1e-5)


def test_auto_plan_trains_like_single_process_and_balances_unequal_kinds(hpp_jobs):
    tmp_path = hpp_jobs.placement
    reference, _ = train_reference(steps=16, batch=16)
    got = merged_state(tmp_path / "measured", [0, 1])
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    meta = load_rank(tmp_path / "measured", 0)["plan_meta"]
    assert "predicted" in meta and len(meta["predicted"]["stage_ms"]) == 2
    assert (meta["predicted"]["schedule"], meta["predicted"]["n_microbatches"]) == ("1f1b", 4)  # the user's constraints

    free = [load_rank(tmp_path / "free", r) for r in (0, 1)]
    predicted = free[0]["plan_meta"]["predicted"]
    assert (predicted["pp_degree"], predicted["dp_degree"],
            predicted["microbatch_size"] * predicted["n_microbatches"]) == (1, 2, 8)
    assert free[0]["grid"] == [[0, 1]] and free[0]["stage_ids"] == free[1]["stage_ids"] == [0]
    reference, _ = train_reference(steps=6, batch=16)
    for k, v in reference.state_dict().items():
        for f in free:  # both replicas hold the whole model, equal to one process on the global batch
            torch.testing.assert_close(f["state"][k], v, rtol=1e-5, atol=1e-6)
    # the profile measured what a step costs besides the units, and on CPU ranks the gradient all-reduce counts in
    # full (gloo sums on the cores the backward computes on: nothing of it hides)
    assert predicted["fixed_step_ms"] > 0 and predicted["optimizer_ms"][0] > 0
    assert [e["overheads"]["allreduce_overlap"] for e in free[0]["plan_meta"]["profile"]["entries"]] == [0.0]
    # after 10 steps the strategy logged predicted against measured stage times (telemetry is on)
    metrics = load_rank(tmp_path / "measured", 0)["metrics"]
    for k in (0, 1):
        assert metrics[f"placement/stage_{k}/predicted_ms"] == pytest.approx(meta["predicted"]["stage_ms"][k])
        assert metrics[f"placement/stage_{k}/measured_ms"] > 0
    # and for the schedule's part of the step: the replay of 1F1B's order, at most (m + p - 1) x the slowest stage
    assert metrics["placement/step_predicted_ms"] == pytest.approx(meta["predicted"]["pipeline_ms"])
    assert 0 < meta["predicted"]["pipeline_ms"] <= 5 * max(meta["predicted"]["stage_ms"]) + 1e-6
    assert metrics["placement/step_measured_ms"] > 0
    # the telemetry plan="auto" started for that report stopped after it (steps 5 and 10 recorded, 15 not)
    assert load_rank(tmp_path / "measured",
                     0)["telemetry_steps"] and max(load_rank(tmp_path / "measured", 0)["telemetry_steps"]) <= 10

    plan = load_rank(tmp_path / "kinds", 0)["plan"]
    predicted = plan["meta"]["predicted"]
    assert predicted["pp_degree"] == 2  # the slow rank makes plain data parallelism the slower plan
    # a profile without message or fixed costs: the V of zero-bubble stages (two per rank) leaves the least bubble
    assert (predicted["schedule"], predicted["stages_per_rank"], predicted["positions"]) == ("zbv", 2, [0, 1, 1, 0])
    sizes = [len(s["modules"]) for s in plan["stages"]]
    assert [s["device"] for s in plan["stages"]] == ["fast", "slow", "slow", "fast"]
    assert sizes[0] + sizes[3] in (7, 8) and sum(sizes) == 11, sizes  # the fast rank holds about 2/3 of the units
    assert load_rank(tmp_path / "kinds", 1)["plan"] == plan  # every rank chose the same plan
    assert load_rank(tmp_path / "kinds",
                     0)["stage_ids"] == [0, 3] and load_rank(tmp_path / "kinds", 1)["stage_ids"] == [1, 2]
    # and the auto-chosen multi-stage plan trains as one process does
    reference, _ = train_reference(steps=4, batch=16, depth=6)
    got = merged_state(tmp_path / "kinds", [0, 1])
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def test_auto_plan_on_four_ranks_chooses_a_multi_stage_pipeline_and_trains_as_one_process(hpp_jobs):
    out = hpp_jobs.placement / "kinds4"
    ranks = [load_rank(out, r) for r in range(4)]
    plan = ranks[0]["plan"]
    predicted = plan["meta"]["predicted"]
    # the synthetic profile (no message, all-reduce or fixed costs; 'slow' at half speed) on ranks fast, fast, slow,
    # slow: two replicas of the ZBV pipeline, two stages per rank in the V, its ends on the fast ranks
    assert (predicted["pp_degree"], predicted["dp_degree"], predicted["schedule"], predicted["stages_per_rank"]) == \
        (2, 2, "zbv", 2), predicted
    assert [s["device"] for s in plan["stages"]] == ["fast", "slow", "slow", "fast"]
    assert all(r["plan"] == plan for r in ranks)  # every rank chose the same plan
    assert [r["stage_ids"] for r in ranks] == [[0, 3], [0, 3], [1, 2], [1, 2]]
    # and trains as one process does on the loader's batch (each replica half of it): every rank's stages, the two
    # replicas of each compared with each other
    reference, _ = train_reference(steps=4, batch=16, depth=6)
    got = merged_state(out, [0, 1, 2, 3])
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def test_stages_follow_device_kinds_and_absent_kinds_are_refused():
    plan = StagePlan([StageSpec(modules=["a"], device="h100"), StageSpec(modules=["b"], device="a100")])
    # rank 0 is an a100 and rank 1 an h100: the first stage (h100) must be on rank 1 - not ascending,
    # so the placement is refused rather than silently swapped
    grid = kind_grid(StagePlan([StageSpec(modules=["a"], device="a100"), StageSpec(modules=["b"], device="h100")]),
                     [[0], [1]], ["a100", "h100"], ParallelDims(pp=2))
    assert grid == [[0], [1]]
    with pytest.raises(PlacementError, match="cpu"):
        kind_grid(plan, [[0], [1]], ["cpu", "cpu"], ParallelDims(pp=2))
    assert kind_grid(StagePlan([StageSpec(modules=["a"]), StageSpec(modules=["b"])]), [[0], [1]], ["cpu", "cpu"],
                     ParallelDims(pp=2)) is None
