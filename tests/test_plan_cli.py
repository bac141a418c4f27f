"""Planning at scale: simulate_cluster, the command line and the shipped field-report profile."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from lightning_hpp.planning.cli import main, simulate_cluster
from lightning_hpp.planning.partition import partition, uniform_partition
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.planning.profile import CostProfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(ROOT, "benchmarks", "placement", "field_report_profile.json")


@pytest.fixture(scope="module")
def profile() -> CostProfile:
    return CostProfile.load(PROFILE)


def _rows(sim):
    return {alt.label: alt.result for alt in sim.rows}


def test_auto_plan_beats_every_part_of_its_own_cluster(profile):
    sim = simulate_cluster(profile, "8xa100,8xh100", global_microbatches=64)
    rows = _rows(sim)
    auto = rows["auto (this cluster)"]
    # Using only one kind is one of the placements the exact search considers on the mixed cluster.
    assert auto.step_ms <= rows["only the a100"].step_ms
    assert auto.step_ms <= rows["only the h100"].step_ms
    assert auto.step_ms < rows["uniform cut, same devices"].step_ms
    # All rows process the same global batch.
    for r in rows.values():
        assert r.dp_degree * r.n_microbatches == 64
    uni = rows["uniform cut, same devices"]
    assert [s.device for s in uni.stages] == [s.device for s in auto.stages]
    assert {len(s.units) for s in uni.stages} <= {len(profile.unit_names) // auto.pp_degree,
                                                  len(profile.unit_names) // auto.pp_degree + 1}
    text = sim.format()
    assert "auto plan" in text and "all h100" in text and "datasheet" in text


def test_precision_follows_the_device_in_the_simulation(profile):
    sim = simulate_cluster(profile, "4xa100,4xh100", global_microbatches=32)
    precisions = {(s.device, s.precision) for s in sim.auto.stages}
    assert precisions <= {("a100", "bf16-mixed"), ("h100", "fp8")}
    fixed = simulate_cluster(profile, "4xa100,4xh100", global_microbatches=32, precision={"h100": "bf16-mixed"})
    assert {s.precision for s in fixed.auto.stages} == {"bf16-mixed"}
    # fp8 on the H100s can only help the predicted step.
    assert sim.auto.step_ms <= fixed.auto.step_ms


def test_cli_prints_plan_and_saves_it(profile, tmp_path, capsys):
    out = tmp_path / "stage_plan.json"
    rc = main(["--profile", PROFILE, "--cluster", "2xa100,2xh100", "--global-batch", "256",
               "--save-plan", str(out), "--markdown"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "auto plan: 1f1b" in text and "| placement |" in text
    plan = StagePlan.load(str(out))
    assert plan.resolve(profile.unit_names)  # covers the profile's units in order
    direct = partition(profile, "2xa100,2xh100", dp_degree="auto", global_microbatches=256 // profile.microbatch_size)
    assert plan.meta["predicted"]["step_ms"] == pytest.approx(direct.step_ms)
    assert [s.device for s in plan.stages] == [s.device for s in direct.stages]


def test_cli_fixed_dp_and_no_compare(capsys):
    rc = main(["--profile", PROFILE, "--cluster", "2xa100,2xh100", "--global-microbatches", "16", "--dp", "2",
               "--no-compare", "--schedule", "gpipe"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "gpipe, 8 micro-batches per replica" in text and "x dp=2" in text and "vs auto" not in text


@pytest.mark.parametrize(
    "args, match",
    [
        (["--cluster", "a100:128", "--global-batch", "256"], "is not 'COUNTxKIND'"),
        (["--cluster", "2xa100", "--global-batch", "100"], "not a multiple of the profile's micro-batch size 8"),
        (["--cluster", "2xa100"], "Give --global-batch"),
        (["--cluster", "2xa100", "--global-batch", "64", "--precision", "a100=fp8"], "does not support fp8"),
    ],
)
def test_cli_bad_input_exits_2_with_the_reason(args, match, capsys):
    assert main(["--profile", PROFILE, *args]) == 2
    assert match in capsys.readouterr().err


def test_cli_reports_a_profile_that_does_not_exist(tmp_path, capsys):
    assert main(["--profile", str(tmp_path / "none.json"), "--cluster", "1xa100", "--global-batch", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_module_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_hpp.planning.cli", "--profile", PROFILE, "--cluster", "1xa100,1xh100",
         "--global-microbatches", "8", "--no-compare"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "predicted step" in proc.stdout


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
    auto = partition(profile, "1xa100,1xh100", pp_degree=2, n_microbatches=16, precision="bf16-mixed")
    uni = uniform_partition(profile, "1xa100,1xh100", 2, stage_kinds=[s.device for s in auto.stages],
                            n_microbatches=16, precision="bf16-mixed")
    assert uni.step_ms > auto.step_ms
