"""Planning at scale: simulate_cluster, the command line (the search behind plan="auto"), the shipped field-report
profile, and the CLI and plan="auto" choosing the same plan for the same profile and ranks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_hpp.planning.cli import main, plan_cluster, simulate_cluster
from lightning_hpp.planning.cluster import Cluster
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.planning.profile import CostProfile
from lightning_hpp.planning.search import evaluate_plan, search_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(ROOT, "benchmarks", "placement", "field_report_profile.json")


@pytest.fixture(scope="module")
def profile() -> CostProfile:
    return CostProfile.load(PROFILE)


def _rows(sim):
    return {alt.label: alt.result for alt in sim.rows}


def test_the_simulation_compares_the_auto_plan_with_its_cluster_parts_on_one_global_batch(profile):
    sim = simulate_cluster(profile, "4xa100,4xh100", global_batch=256)
    rows = _rows(sim)
    auto = rows["auto (this cluster)"]
    assert auto.devices_used == 8 and auto.ranks is not None
    # the auto plan is the search's on the cluster's ranks; its uniform cut is predicted by the same model
    assert auto.predicted() == search_plan(profile, Cluster.parse("4xa100,4xh100").rank_kinds(), batch_size=256,
                                           tp_degree=None, data_parallel=None,
                                           hosts=Cluster.parse("4xa100,4xh100").hosts()).predicted()
    if auto.pp_degree > 1:
        uni = rows["uniform cut, same layout"]
        assert uni is None or uni.step_ms >= auto.step_ms
    for r in rows.values():  # every row trains the same global batch
        if r is not None:
            assert r.dp_degree * r.n_microbatches * r.microbatch_size == 256
    assert rows["all h100"].step_ms < rows["all a100"].step_ms
    text = sim.format()
    assert "auto plan" in text and "all h100" in text and "datasheet" in text and "devices per host" in text


def test_precision_follows_the_device_in_the_simulation(profile):
    sim = simulate_cluster(profile, "2xa100,2xh100", global_batch=128)
    precisions = {(s.device, s.precision) for s in sim.auto.stages}
    assert precisions <= {("a100", "bf16-mixed"), ("h100", "fp8"), ("a100|h100", "bf16-mixed")}
    fixed = simulate_cluster(profile, "2xa100,2xh100", global_batch=128, precision={"h100": "bf16-mixed"})
    assert {s.precision for s in fixed.auto.stages} == {"bf16-mixed"}
    assert sim.auto.step_ms <= fixed.auto.step_ms  # fp8 on the H100s can only help the predicted step


def test_cli_prints_plan_and_saves_it(profile, tmp_path, capsys):
    out = tmp_path / "stage_plan.json"
    rc = main(["--profile", PROFILE, "--cluster", "2xa100,2xh100", "--global-batch", "256",
               "--save-plan", str(out), "--markdown"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "auto plan:" in text and "| placement |" in text
    plan = StagePlan.load(str(out))
    assert plan.resolve(profile.unit_names)  # covers the profile's units in order
    direct = plan_cluster(profile, "2xa100,2xh100", global_batch=256, tp_degree=None, data_parallel=None)
    assert plan.meta["predicted"] == direct.predicted()
    assert [s.device for s in plan.stages] == [s.device for s in direct.plan.stages]


def test_cli_fixed_values_are_constraints_of_the_search(capsys):
    rc = main(["--profile", PROFILE, "--cluster", "2xa100,2xh100", "--global-microbatches", "16", "--pp", "2",
               "--microbatches", "8", "--no-compare", "--schedule", "gpipe"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "gpipe, 8 micro-batches per replica" in text and "pp=2 x dp=2" in text and "vs auto" not in text


@pytest.mark.parametrize(
    "args, match",
    [
        (["--cluster", "a100:128", "--global-batch", "256"], "is not 'COUNTxKIND'"),
        (["--cluster", "2xa100"], "Give --global-batch"),
        (["--cluster", "2xa100", "--global-batch", "64", "--precision", "a100=fp8"], "does not support fp8"),
        (["--cluster", "2xa100", "--global-batch", "64", "--tp", "two"], "--tp 'two' must be 'auto'"),
        (["--cluster", "2xa100", "--global-batch", "64", "--data-parallel", "hsdp"], "needs --dp-replicate"),
        (["--cluster", "2xa100", "--global-batch", "64", "--pp", "3"], "pp=3: needs pp <= 18 units"),
    ],
)
def test_cli_bad_input_exits_2_with_the_reason(args, match, capsys):
    assert main(["--profile", PROFILE, *args]) == 2
    assert match in capsys.readouterr().err


def test_cli_reports_a_profile_that_does_not_exist(tmp_path, capsys):
    assert main(["--profile", str(tmp_path / "none.json"), "--cluster", "1xa100", "--global-batch", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_module_entry_point_runs_and_says_what_answers_large_clusters():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_hpp.planning.cli", "--profile", PROFILE, "--cluster", "1xa100,1xh100",
         "--global-microbatches", "8", "--no-compare"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "predicted step" in proc.stdout
    helptext = " ".join(subprocess.run([sys.executable, "-m", "lightning_hpp.planning.cli", "--help"],
                                       capture_output=True, text=True, timeout=120, cwd=ROOT).stdout.split())
    assert "search and cost model of plan='auto'" in helptext and "256-GPU cluster in seconds" in helptext


def test_shipped_profile_is_reproducible_from_its_stated_assumptions(profile):
    path = os.path.join(ROOT, "benchmarks", "placement", "simulate.py")
    spec = importlib.util.spec_from_file_location("placement_simulate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rebuilt = mod.build_profile()
    assert rebuilt.signature == profile.signature
    assert sorted(rebuilt.pairs()) == sorted(profile.pairs())
    for e in rebuilt.entries:
        shipped = profile.get(e.device_kind, e.precision)
        for a, b in zip(e.units, shipped.units):
            assert a.name == b.name and a.param_bytes == b.param_bytes
            assert a.fwd_ms == pytest.approx(b.fwd_ms, rel=1e-9) and a.bwd_ms == pytest.approx(b.bwd_ms, rel=1e-9)


def test_uniform_baseline_on_the_shipped_profile_is_slower(profile):
    auto = search_plan(profile, ["a100", "h100"], batch_size=128, pp_degree=2, n_microbatches=16, schedule="1f1b",
                       precision="bf16-mixed")
    n = len(profile.unit_names)
    kinds = [s.device for s in auto.stages]
    uni = evaluate_plan(profile, ["a100", "h100"], [profile.unit_names[: n // 2], profile.unit_names[n // 2:]], kinds,
                        schedule="1f1b", n_microbatches=16, batch_size=128, precision="bf16-mixed")
    assert uni.step_ms > auto.step_ms


def test_the_cli_and_plan_auto_give_the_same_plan_for_the_same_profile_and_cluster(profile, tmp_path):
    """``lightning-hpp-plan --save-plan`` writes what ``plan="auto"`` chooses on a job of those ranks from the same
    profile (``PlacementOptions(profile=...)``): the same search, the same cost model, the same defaults."""
    from lightning_hpp.assembly.placement import auto_plan

    out = tmp_path / "stage_plan.json"
    assert main(["--profile", PROFILE, "--cluster", "4xa100,4xh100", "--global-batch", "256", "--devices-per-host",
                 "8", "--no-compare", "--save-plan", str(out)]) == 0
    saved = StagePlan.load(str(out))
    units = [(name, nn.Identity()) for name in profile.unit_names]
    plan, grid, _, chosen = auto_plan(units, (), 0, Cluster.parse("4xa100,4xh100").rank_kinds(), batch_size=256,
                                      device=torch.device("cpu"), profile_path=PROFILE, data_parallel=None)
    assert [(s.modules, s.device, s.precision) for s in plan.stages] == [
        (s.modules, s.device, s.precision) for s in saved.stages]
    assert plan.meta["predicted"] == saved.meta["predicted"] and grid == saved.meta["ranks"]
