"""The straggler watch: detection offline, re-planning inputs offline, and real 2-rank jobs (a slowed rank named,
no false alarm over 200 steps, "stop" and "replan" with their exit codes and checkpoints, a timed-out transfer)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lightning_hpp.assembly.callbacks import pipeline_callbacks
from lightning_hpp.checkpoint import list_checkpoints
from lightning_hpp.errors import PlacementError
from lightning_hpp.options import PlacementOptions
from lightning_hpp.planning.profile import CostProfile, Overheads, ProfileEntry, UnitCost
from lightning_hpp.planning.speeds import with_rank_speeds
from lightning_hpp.planning.search import search_plan
from lightning_hpp.telemetry.watch import (REPLAN_EXIT_CODE, STOP_EXIT_CODE, SlowdownDetector, StragglerWatch,
                                           WatchOptions)
from tests.harness.launch import Job, finish, run_jobs, start

TWO = [["layers.0-3"], ["layers.4-6"]]
WORKER = "tests.workers.run_watch"


# ------------------------------------------------------------------------------------------- offline
def _detector(**kw) -> SlowdownDetector:
    o = WatchOptions(**kw)
    return SlowdownDetector(o.ratio, o.steps, o.warmup, o.window, o.min_ms, o.min_s)


def _noisy(rng: random.Random, base: float) -> float:
    """A step time on a loaded machine: +-20% jitter, and one step in 15 hit by a 3x stall."""
    return base * rng.uniform(0.8, 1.2) * (3.0 if rng.random() < 1 / 15 else 1.0)


def _feed(d: SlowdownDetector, values) -> list:
    """Observe ``values`` (ms per step) back to back on a clock of their own; the steps that found a slowdown."""
    now, out = 0.0, []
    for step, v in enumerate(values):
        now += v / 1e3
        found = d.observe(step, v, now)
        if found is not None:
            out.append((step, found))
    return out


def test_detector_ignores_noise_and_isolated_stalls():
    rng = random.Random(0)
    assert _feed(_detector(), [_noisy(rng, 20.0) for _ in range(2000)]) == []


def test_detector_waits_min_s_of_wall_time():
    # 2 ms steps, 4x slower from step 100 for 0.5 s (a burst of load), then from step 500 on for good
    values = [2.0] * 100 + [8.0] * 62 + [2.0] * 338 + [8.0] * 400
    found = _feed(_detector(min_s=1.0), values)
    assert [f.since_step for _, f in found] == [500]
    assert found[0][0] >= 500 + 1000 / 8 - 1


def test_detector_finds_a_step_change_within_the_window_and_reports_it_once():
    rng = random.Random(1)
    found = _feed(_detector(min_s=0.0), [_noisy(rng, 20.0) * (2.0 if s >= 100 else 1.0) for s in range(300)])
    assert len(found) == 1
    step, f = found[0]
    assert 100 <= step < 100 + WatchOptions().steps + 2
    assert f.since_step == 100
    assert f.speed == pytest.approx(0.5, rel=0.25)


def test_a_noisy_step_before_the_change_is_not_where_the_slowdown_began():
    # one slow step (96) four steps before the change (100): still in the window that confirms the change
    values = [20.0] * 96 + [60.0] + [20.0] * 3 + [40.0] * 50
    (step, f), = _feed(_detector(min_s=0.0), values)
    assert f.since_step == 100 and 100 < step < 100 + WatchOptions().steps


def test_min_s_counts_from_the_slowdowns_first_step():
    # 200 ms steps from step 100: 1 s of slowdown has passed at the end of step 104, when most of the window is slow
    (step, f), = _feed(_detector(min_s=1.0), [20.0] * 100 + [200.0] * 50)
    assert (f.since_step, step) == (100, 104)


def test_detector_finds_an_intermittent_quota_and_skips_warmup():
    d = _detector(warmup=10, min_s=0.0)
    # a quota that pauses the rank in two steps of three, from step 50 on; the first 10 steps are 10x slow (warm-up)
    values = [200.0 if s < 10 else 20.0 if s < 50 or s % 3 == 0 else 60.0 for s in range(120)]
    found = _feed(d, values)
    assert [s for s, _ in found] and found[0][0] < 60 and found[0][1].since_step >= 50
    assert all(s >= 50 for s, _ in found)


def test_detector_ignores_increases_below_min_ms():
    assert not _feed(_detector(min_ms=5.0, min_s=0.0), [1.0 if s < 50 else 3.0 for s in range(100)])  # 2 ms: noise
    assert _feed(_detector(min_ms=5.0, min_s=0.0), [1.0 if s < 50 else 30.0 for s in range(100)])


def test_watch_options_forms_and_refusals():
    assert PlacementOptions().watch == WatchOptions(action="warn")
    assert PlacementOptions(watch="replan").watch.action == "replan"
    assert PlacementOptions(watch={"action": "stop", "steps": 3}).watch == WatchOptions(action="stop", steps=3)
    assert PlacementOptions(watch=False).watch.action == "off"
    with pytest.raises(PlacementError, match="'pause' is not an action"):
        PlacementOptions(watch="pause")
    with pytest.raises(PlacementError, match="unknown keys"):
        PlacementOptions(watch={"actions": "stop"})
    with pytest.raises(PlacementError, match="ratio"):
        WatchOptions(ratio=0.5)
    with pytest.raises(PlacementError, match="window"):
        WatchOptions(steps=10, window=5)


def test_callbacks_add_the_watch_and_refuse_stop_without_a_checkpoint_dir():
    added = pipeline_callbacks([], None, auto=False, watch=WatchOptions())
    assert [type(cb) for cb in added] == [StragglerWatch]
    assert pipeline_callbacks([], None, auto=False, watch=WatchOptions(action="off")) == []
    with pytest.raises(PlacementError, match=r"CheckpointOptions\(dir=\.\.\.\)"):
        pipeline_callbacks([], None, auto=False, watch=WatchOptions(action="stop"))


def test_one_observation_per_optimizer_step_under_gradient_accumulation():
    from lightning_hpp.telemetry.watch import _StepTimer

    seen = []

    class Detector:  # records what the watch feeds it
        current_ratio = 0.0

        def observe(self, step, ms):
            seen.append((step, ms))

    watch = StragglerWatch(WatchOptions())
    watch._timer = timer = _StepTimer(0, str, None)
    watch._detectors = {"compute": Detector(), "transfer": Detector()}
    # two batches per optimizer step; each batch's times are read when the next step's exchange asks for the flags
    for step, ms in [(0, 1.0), (0, 2.0), (1, 3.0), (1, 4.0), (2, 5.0)]:
        timer.fresh, timer.fresh_label, timer.fresh_times = True, step, (int(ms * 1e6), 0, None)
        watch._flag("level")
    assert seen[0::2] == [(0, 1.0), (1, 3.0), (2, 5.0)]  # compute: the first batch of each step, labelled by its step
    assert watch._observed_step == 2


def _profile(n_units: int = 8) -> CostProfile:
    units = [UnitCost(f"u{i}", 1.0, 2.0, 4000, 4000, fixed_ms=0.1) for i in range(n_units)]
    return CostProfile("toy", [u.name for u in units], [1000] * n_units, [[8, 8]],
                       entries=[ProfileEntry("cpu", "32-true", units,
                                             overheads=Overheads(microbatch_ms=0.2, p2p_gbps=1.0))])


def test_with_rank_speeds_gives_a_slowed_rank_its_own_scaled_kind():
    profile = _profile()
    out, kinds = with_rank_speeds(profile, ["cpu", "cpu"], {0: 1.02, 1: 0.5})
    assert kinds == ["cpu", "cpu-r1"]  # within the tolerance: rank 0 stays on its kind
    slow = out.get("cpu-r1", "32-true")
    assert [u.fwd_ms for u in slow.units] == [2.0] * 8 and slow.units[0].fixed_ms == pytest.approx(0.2)
    assert slow.overheads.microbatch_ms == pytest.approx(0.4) and slow.overheads.p2p_gbps == 1.0
    assert profile.get("cpu-r1", "32-true") is None  # the input is left alone
    assert with_rank_speeds(profile, ["cpu", "cpu"], None) == (profile, ["cpu", "cpu"])


def test_search_moves_units_off_a_rank_recorded_slow():
    def units_per_rank(kinds, profile):
        result = search_plan(profile, kinds, batch_size=32, pp_degree=2, n_microbatches=4, schedule="1f1b")
        return {row[0]: len(s.modules) for row, s in zip(result.ranks, result.plan.stages)}

    equal = units_per_rank(["cpu", "cpu"], _profile())
    assert equal == {0: 4, 1: 4}
    slowed = units_per_rank(*reversed(with_rank_speeds(_profile(), ["cpu", "cpu"], {1: 1 / 3})))
    assert slowed[1] < slowed[0] and sum(slowed.values()) == 8


# ------------------------------------------------------------------------------------------- real processes
def _read(out: Path, tag: str, rank: int) -> dict:
    return json.loads((out / f"{tag}_rank{rank}.json").read_text())


def _summary(out: Path, tag: str) -> str:
    """What both ranks of a job found (for assertion messages)."""
    return "; ".join(f"rank {r}: step {d['global_step']}, {d['ended']}, findings {d['findings']}, alerts {d['alerts']}"
                     for r, d in ((r, _read(out, tag, r)) for r in (0, 1)))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Two rounds of jobs side by side (each job its own directory and port).

    Round 1: ``warn`` (rank 1 sleeps 100 ms per stage forward from step 30), ``quiet`` (200 ordinary steps),
    ``stop`` (slowed from step 20, ``watch="stop"``), ``replan`` (``plan="auto"``, slowed from step 20,
    ``watch="replan"``) and the one-process reference. Round 2: ``replan`` again with the same command
    (``resume="auto"``), ``stop`` resumed, and under torchrun ``timeout`` (rank 1 sleeps 40 s once at step 5,
    timeout 20 s).
    """
    out = tmp_path_factory.mktemp("watch")
    slow = {"rank": 1, "after": 20, "ms": 100}
    base = {"out": str(out), "n_micro": 4, "schedule": "1f1b", "plan": TWO}
    cfg = {
        "warn": {**base, "tag": "warn", "steps": 60, "slow": {"rank": 1, "after": 30, "ms": 100}},
        "quiet": {**base, "tag": "quiet", "steps": 200},
        "stop": {**base, "tag": "stop", "steps": 40, "slow": slow, "watch": "stop", "ckpt_dir": str(out / "stop_ckpt"),
                 "resume": "auto"},
        "replan": {"out": str(out), "tag": "replan", "steps": 40, "plan": "auto", "pp": 2, "slow": slow,
                   "watch": "replan",
                   "ckpt_dir": str(out / "replan_ckpt"), "resume": "auto"},
        "reference": {"reference": True, "out": str(out), "tag": "reference", "steps": 40},
    }
    first = dict(zip(cfg, run_jobs([Job(WORKER, c, ranks=1 if tag == "reference" else 2, timeout=900)
                                    for tag, c in cfg.items()], check=False)))
    for tag, proc in first.items():  # a job that failed to start says why, instead of a missing file
        assert all((out / f"{tag}_rank{r}.json").exists() for r in ((0,) if tag == "reference" else (0, 1))), \
            f"{tag} exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
    snapshot = {t: [_read(out, t, r) for r in (0, 1)] for t in ("stop", "replan")}
    stop_ckpts = [c.url for c in sorted(list_checkpoints(str(out / "stop_ckpt")), key=lambda c: c.step, reverse=True)]
    resumed = {**cfg["stop"], "tag": "stop_resumed", "watch": "warn", "slow": None}
    # torchrun starts both ranks at once, so the rendezvous fits in the short timeout (Lightning's launcher would
    # start rank 1 only once rank 0 has imported everything)
    timed_out = {**base, "tag": "timeout", "steps": 10, "timeout": 20,
                 "slow": {"rank": 1, "after": 5, "ms": 40000, "once": True}}
    torchrun = start(Job((sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
                          "c10d", "--rdzv-endpoint", f"127.0.0.1:{find_free_network_port()}", "-m", WORKER),
                         timed_out, ranks=2, script=True, timeout=600), out / "logs")
    second = dict(zip(("replan", "stop_resumed"), run_jobs([Job(WORKER, cfg["replan"], ranks=2, timeout=600),
                                                            Job(WORKER, resumed, ranks=2, timeout=600)], check=False)))
    try:
        second["timeout"] = finish(torchrun)
    finally:
        torchrun.kill()  # the sleeping rank, if it is still asleep
    return {"out": out, "first": first, "second": second, "snapshot": snapshot, "stop_ckpts": stop_ckpts}


@pytest.mark.slow
def test_a_slowed_rank_is_named_within_10_steps(jobs):
    proc = jobs["first"]["warn"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = _read(jobs["out"], "warn", 0), _read(jobs["out"], "warn", 1)
    assert r0["findings"] == [] and len(r1["findings"]) == 1, _summary(jobs["out"], "warn")  # rank 0 is not named
    (f,) = r1["findings"]
    assert (f["rank"], f["stages"], f["signal"]) == (1, [1], "compute")
    # named within 10 steps of the change (step 30); "since" is the first slow step after which no two steps in a
    # row were fast, which on a loaded machine may still be a noisy step just before
    assert 30 - 3 <= f["since_step"] <= 35 and 30 <= f["step"] < 40, _summary(jobs["out"], "warn")
    assert f["measured_ms"] > 2 * f["expected_ms"]
    assert "straggler: rank 1 (host" in proc.stderr and "since step" in proc.stderr
    assert r0["alerts"] == r1["alerts"]
    assert r0["alerts"][0][2] == {"1": pytest.approx(f["measured_ms"] / f["expected_ms"])}


@pytest.mark.slow
def test_no_false_alarm_over_200_ordinary_steps(jobs):
    proc = jobs["first"]["quiet"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in (0, 1):
        got = _read(jobs["out"], "quiet", r)
        assert got["global_step"] == 200 and got["findings"] == [] and got["alerts"] == [], \
            _summary(jobs["out"], "quiet")


@pytest.mark.slow
def test_stop_ends_every_rank_with_its_code_and_a_resumable_checkpoint(jobs):
    proc = jobs["first"]["stop"]
    assert proc.returncode == STOP_EXIT_CODE, proc.stderr[-4000:]
    r0, r1 = jobs["snapshot"]["stop"]
    assert r0["ended"] == r1["ended"] == f"exit {STOP_EXIT_CODE}"
    step = r0["global_step"]
    assert 20 < step <= 31
    newest = jobs["stop_ckpts"][0]
    assert newest.endswith(f"step-{step}")
    meta = json.loads((Path(newest) / "metadata.json").read_text())
    watch = meta["extra"]["watch"]
    assert watch["action"] == "stop" and watch["speeds"]["0"] == 1.0 and watch["speeds"]["1"] < 0.5
    assert [f["rank"] for f in watch["findings"]] == [1]
    assert f"exit code {STOP_EXIT_CODE}" in proc.stderr
    # resumable: the same command resumes from it and trains to the end on the same losses as the reference
    again = jobs["second"]["stop_resumed"]
    assert again.returncode == 0, again.stderr[-4000:]
    resumed = _read(jobs["out"], "stop_resumed", 0)
    assert resumed["resumed_from"] == newest and resumed["global_step"] == 40
    ref = _read(jobs["out"], "reference", 0)["losses"]
    for k, loss in {**r0["losses"], **resumed["losses"]}.items():
        assert loss == pytest.approx(ref[k], abs=1e-5), k


@pytest.mark.slow
def test_replan_resumes_on_a_new_cut_with_the_losses_of_the_uninterrupted_run(jobs):
    proc = jobs["first"]["replan"]
    assert proc.returncode == REPLAN_EXIT_CODE, proc.stderr[-4000:]
    before, _ = jobs["snapshot"]["replan"]
    again = jobs["second"]["replan"]
    assert again.returncode == 0, again.stderr[-4000:]
    after = _read(jobs["out"], "replan", 0)
    assert after["resumed_from"].endswith(f"step-{before['global_step']}") and after["global_step"] == 40
    assert after["rank_speeds"]["1"] < 0.5 and after["rank_speeds"]["0"] == 1.0
    units, units_after = before["units_per_rank"], after["units_per_rank"]
    assert sum(units.values()) == sum(units_after.values()) == 7
    assert units_after["1"] < units["1"], (before["stages"], after["stages"], units,
                                           units_after)  # rank 1 holds fewer now
    ref = _read(jobs["out"], "reference", 0)["losses"]
    losses = {**before["losses"], **after["losses"]}
    assert sorted(map(int, losses)) == list(range(40))
    for k, loss in losses.items():
        assert loss == pytest.approx(ref[k], abs=1e-5), k


@pytest.mark.slow
def test_a_timed_out_transfer_names_both_ranks(jobs):
    proc = jobs["second"]["timeout"]
    assert proc.returncode != 0
    r0 = _read(jobs["out"], "timeout", 0)
    assert r0["error"].startswith("TransferError: A pipeline transfer timed out after the timeout of 20 s"), \
        proc.stdout[-3000:]
    assert "rank 0 (host" in r0["error"] and "rank 1 (device kind 'cpu', stage(s) [1])" in r0["error"]
    assert r0["global_step"] == 5
