"""Pipeline telemetry: theory, schedule orders and grids offline; one real 2-rank run end to end."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from PIL import Image

from lightning_hpp.errors import ScheduleError, TelemetryError
from lightning_hpp.pipeline.schedules import SCHEDULES
from lightning_hpp.telemetry.callback import PipelineTelemetry
from lightning_hpp.telemetry.model import Act, schedule_actions, simulate, theoretical_bubble
from lightning_hpp.telemetry.recorder import RankStep, ScheduleInfo, analyze
from lightning_hpp.telemetry.render import schedule_grid
from tests.harness.launch import Job, run_job
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders

COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


# ------------------------------------------------------------------------------------------- offline
def test_closed_forms():
    assert theoretical_bubble("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved1f1b", 2, 4, 2) == pytest.approx(1 / 9)
    assert theoretical_bubble("zbv", 2, 4, 2) == pytest.approx(1 / 25)
    # More micro-batches always shrink the bubble; interleaving shrinks it further.
    assert theoretical_bubble("1f1b", 4, 16) < theoretical_bubble("1f1b", 4, 8)
    assert theoretical_bubble("interleaved1f1b", 4, 8, 2) < theoretical_bubble("1f1b", 4, 8)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16)])
def test_theory_equals_replay_of_torch_orders(name, pp, m):
    """The closed form is what torch's own action order gives with equal stage costs (B = I + W), every output
    sent as soon as it is made; torch's runtime holds back what the first action of an overlapped pair sends
    (DualPipeV, the only schedule with pairs), and its replay is then that much higher."""
    orders = schedule_actions(name, pp, m)
    v = len({a.stage for a in orders[0]})
    every_mb = sorted((a.stage, a.kind, a.mb) for acts in orders.values() for a in acts if a.kind == "F")
    assert every_mb == sorted((s, "F", i) for s in range(pp * v) for i in range(m))
    unheld = {r: [a._replace(held=False) for a in acts] for r, acts in orders.items()}
    assert simulate(unheld,
                    lambda a: COSTS[a.kind]).bubble == pytest.approx(theoretical_bubble(name, pp, m, v), abs=1e-9)
    pairs = any(a.held for acts in orders.values() for a in acts)
    assert pairs == (name == "dualpipev")
    replayed = simulate(orders, lambda a: COSTS[a.kind]).bubble
    assert replayed > theoretical_bubble(
        name, pp, m, v) + 0.01 if pairs else replayed == pytest.approx(theoretical_bubble(name, pp, m, v))


def test_an_overlapped_pair_sends_after_its_last_action():
    """torch runs an OVERLAP_F_B pair's actions one after the other and posts their sends after both: the next
    rank gets the first action's output when the pair is done, not when that action is."""
    orders = {0: [Act(0, "F", 0, held=True), Act(0, "F", 1)], 1: [Act(1, "F", 0), Act(1, "F", 1)]}
    sim = simulate(orders, lambda a: 1.0, latency=0.5)
    when = {str(a): (s, e) for r in sim.starts for a, s, e in sim.starts[r]}
    assert when == {"0F0": (0.0, 1.0), "0F1": (1.0, 2.0), "1F0": (2.5, 3.5), "1F1": (3.5, 4.5)}
    alone = {r: [a._replace(held=False) for a in acts] for r, acts in orders.items()}
    assert simulate(alone, lambda a: 1.0, latency=0.5).makespan == 3.5  # 1F0 at 1.5, as soon as 0F0 is sent


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 6), (4, 8)])
def test_the_planners_replay_of_dualpipev_holds_the_pairs_sends_as_the_telemetrys_does(pp, m):
    import numpy as np

    from lightning_hpp.planning.replay import KINDS, program

    orders = schedule_actions("dualpipev", pp, m)
    prog = program("dualpipev", pp, 2 * pp, m)
    rng = np.random.default_rng(pp * 10 + m)
    costs = rng.uniform(0.5, 3.0, size=(5, len(KINDS), 2 * pp))
    for c in costs:
        sim = simulate(orders, lambda a, c=c: float(c[KINDS.index(a.kind), a.stage]))
        assert prog.makespan(c[None])[0] == pytest.approx(sim.makespan)
        assert prog.bubble(c[None])[0] == pytest.approx(sim.bubble)


def test_1f1b_grid():
    assert schedule_grid("1f1b", 2, 4).splitlines() == [
        "1f1b  pp=2  stages=2  microbatches=4",
        "slot  rank 0  rank 1",
        "   0  0F0     .",
        "   1  0F1     1F0",
        "   2  .       1B0",
        "   3  0B0     1F1",
        "   4  0F2     1B1",
        "   5  0B1     1F2",
        "   6  0F3     1B2",
        "   7  0B2     1F3",
        "   8  .       1B3",
        "   9  0B3     .",
        "idle 4 of 20 slots = 0.200 (theory, equal costs: 0.200)",
    ]


def test_gpipe_grid_fills_then_drains():
    rows = schedule_grid("gpipe", 3, 2).splitlines()[2:-1]
    cells = [r.split()[1:] for r in rows]
    assert cells[0] == ["0F0", ".", "."]
    assert cells[2] == [".", "1F1", "2F0"]
    assert len(rows) == 2 * 2 + 2 * (3 - 1)  # 2m busy slots per rank + 2(p-1) bubble slots
    assert rows[-1].split()[1:] == ["0B1", ".", "."]


def test_simulate_imbalanced_stages():
    orders = schedule_actions("gpipe", 2, 4)
    sim = simulate(orders, lambda a: 5.0 if a.stage == 0 else 20.0)
    # stage 0: F0 at 0..5, stage 1 runs 4 F and 4 B back to back from 5, stage 0's last B ends 5 later.
    assert sim.makespan == pytest.approx(5 + 8 * 20 + 5)
    assert sim.bubble == pytest.approx(((170 - 40) + (170 - 160)) / (2 * 170))


def test_simulate_latency_and_deadlock():
    sim = simulate(schedule_actions("gpipe", 2, 1), lambda a: 1.0, latency=3.0)
    assert sim.makespan == pytest.approx(1 + 3 + 1 + 1 + 3 + 1)
    with pytest.raises(TelemetryError, match="deadlock"):
        simulate({0: [Act(0, "B", 0), Act(0, "F", 0)], 1: [Act(1, "F", 0), Act(1, "B", 0)]}, lambda a: 1.0)


def test_analyze_splits_waits_at_the_peer_post():
    """A receive waited from 10 to 50 whose sender posted at 40: 30 ns waiting for the peer, 10 moving data."""
    info = ScheduleInfo("gpipe", 2, 1, 2, schedule_actions("gpipe", 2, 1))
    recs = []
    for replica, shift in ((0, 0), (1, 1000)):  # a second replica with its own timings
        r0 = RankStep(rank=2 * replica, replica=replica, position=0, step=0, start=shift, end=shift + 100, spans=[
            ("F", 0, 0, shift + 0, shift + 40, None),
            ("SEND_F", 0, 0, shift + 40, shift + 41, shift + 40),
            ("RECV_B", 0, 0, shift + 45, shift + 90, shift + 45),
            ("B", 0, 0, shift + 90, shift + 100, None),
        ])
        r1 = RankStep(rank=2 * replica + 1, replica=replica, position=1, step=0, start=shift, end=shift + 90, spans=[
            ("RECV_F", 1, 0, shift + 10, shift + 50, shift + 5),
            ("F", 1, 0, shift + 50, shift + 60, None),
            ("L", 1, 0, shift + 60, shift + 62, None),
            ("B", 1, 0, shift + 62, shift + 80, None),
            ("SEND_B", 1, 0, shift + 80, shift + 82, shift + 80),
        ])
        recs += [r0, r1]
    m = analyze(recs, info)
    recv_f = [s for s in m.spans if s.kind == "RECV_F"]
    assert [s.comm for s in recv_f] == [10, 10]
    recv_b = [s for s in m.spans if s.kind == "RECV_B"]
    assert [s.comm for s in recv_b] == [10, 10]  # sender posted at 80, wait ended at 90
    assert m.stages[1].fwd_ms == pytest.approx(12e-6)  # F + L
    assert m.stages[1].comm_ms == pytest.approx(12e-6)  # 10 of the receive + the 2 ns send
    assert m.step_ms == pytest.approx(100e-6)  # the replica's step, first start to last end
    assert m.stages[0].idle_ms == pytest.approx((100 - 50 - 1 - 10) * 1e-6)
    assert m.bubble == pytest.approx(((100 - 50 - 11) / 100 + (100 - 30 - 12) / 100) / 2)
    # replayed with everything measured: per action, rank 0 communicates 11/2 and spends 4/2 in no span, rank 1
    # 12/2 and 18/2; F0 47.5, F1+L 27, B1 33, B0 17.5 one after another: 125, of it compute and communication
    # 61 on rank 0 and 42 on rank 1 (the overhead is idle, as measured)
    assert m.bubble_replayed == pytest.approx(((125 - 61) / 125 + (125 - 42) / 125) / 2)
    assert m.bubble_expected == pytest.approx(((80 - 50) / 80 + (80 - 30) / 80) / 2)  # the stage costs alone: 80


def test_bad_input():
    with pytest.raises(TelemetryError, match="'pipedream'"):
        theoretical_bubble("pipedream", 2, 4)
    with pytest.raises(TelemetryError, match=r"`theoretical_bubble\('gpipe', m=0\)`: must be a positive integer"):
        theoretical_bubble("gpipe", 2, 0)
    with pytest.raises(TelemetryError, match="v=2"):
        theoretical_bubble("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="n_microbatches=2"):
        schedule_grid("1f1b", 4, 2)
    with pytest.raises(TelemetryError, match="every_n_steps.*0"):
        PipelineTelemetry(every_n_steps=0)
    with pytest.raises(TelemetryError, match="trace_step.*'3'"):
        PipelineTelemetry(trace_step="3")
    assert issubclass(TelemetryError, ValueError)


def test_refuses_a_non_pipeline_strategy(tmp_path):
    trainer = quiet_trainer(devices=1, max_steps=1, callbacks=[PipelineTelemetry()], default_root_dir=tmp_path)
    train, _ = loaders(16)
    with pytest.raises(TelemetryError, match="SingleDeviceStrategy"):
        trainer.fit(MLP(), train)


# ------------------------------------------------------------------------------------------- 2 ranks
def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_two_rank_run_logs_traces_and_measures_the_bubble(tmp_path):
    m = 4
    run_job(Job("tests.workers.run_telemetry", {"devices": 2, "runs": [
        # equal stages, 10 ms forward and backward each: the bubble should be the theory's
        {"name": "even", "schedule": "1f1b", "n_micro": m, "batch": 16, "steps": 6, "ms0": 10, "ms1": 10,
         "out": str(tmp_path), "trace_step": 3},
        # stage 1 four times slower: GPipe's bubble grows well past (p-1)/(m+p-1)
        {"name": "slow", "schedule": "gpipe", "n_micro": m, "batch": 16, "steps": 6, "ms0": 5, "ms1": 20,
         "out": str(tmp_path)},
        # the default every_n_steps follows log_every_n_steps: every exchange reaches the logger
        {"name": "every2", "schedule": "gpipe", "n_micro": m, "batch": 16, "steps": 4, "ms0": 1, "ms1": 1,
         "out": str(tmp_path), "log_every_n_steps": 2},
    ]}, ranks=2, start="forked", timeout=180))

    # Logged through Lightning's CSVLogger on rank 0, every step.
    rows = _csv_rows(tmp_path / "even" / "csv" / "version_0" / "metrics.csv")
    logged = [r for r in rows if r.get("pipeline/bubble")]
    assert len(logged) == 6
    for name in ["bubble", "bubble_theory", "bubble_expected", "bubble_replayed",
                 "comm_share"] + [f"stage_{k}/{t}_ms" for k in (0, 1) for t in ("fwd", "bwd", "comm", "idle")]:
        assert all(math.isfinite(float(r[f"pipeline/{name}"])) for r in logged), name
    assert float(logged[-1]["pipeline/bubble_theory"]) == pytest.approx(0.2)

    every2 = [r for r in _csv_rows(tmp_path / "every2" / "csv" / "version_0" / "metrics.csv")
              if r.get("pipeline/bubble")]
    assert [int(r["step"]) for r in every2] == [1, 3]  # Lightning's rows of global steps 2 and 4
    history2 = json.loads((tmp_path / "every2" / "rank0.json").read_text())["history"]
    assert [h["step"] for h in history2] == [0, 1, 2, 3]  # every step analyzed, two per log

    even = [json.loads((tmp_path / "even" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert even[0]["history"] == even[1]["history"]  # every rank computes the same numbers
    steady = even[0]["history"][1:]  # step 0 also infers shapes
    # Sleeps are lower bounds: each stage spends at least 4 x 10 ms in forward and in backward.
    assert all(h["pipeline/stage_1/fwd_ms"] >= 40 and h["pipeline/stage_0/bwd_ms"] >= 40 for h in steady)
    bubble = sum(h["pipeline/bubble"] for h in steady) / len(steady)
    assert abs(bubble - 0.2) < 0.06, bubble

    slow = json.loads((tmp_path / "slow" / "rank0.json").read_text())["history"][1:]
    measured = sum(h["pipeline/bubble"] for h in slow) / len(slow)
    expected = sum(h["pipeline/bubble_expected"] for h in slow) / len(slow)
    # Replaying GPipe with 5 ms / 20 ms stages gives 140/340 = 0.41; the theory (equal stages) says 0.2.
    assert expected == pytest.approx(140 / 340, abs=0.04)
    assert abs(measured - expected) < 0.06, (measured, expected)
    replayed = sum(h["pipeline/bubble_replayed"] for h in slow) / len(slow)
    assert abs(measured - replayed) < 0.06, (measured, replayed)
    assert measured > slow[0]["pipeline/bubble_theory"] + 0.12
    assert all(h["pipeline/stage_0/idle_ms"] > 3 * h["pipeline/stage_1/idle_ms"] for h in slow)  # the fast stage waits

    # Pictures of step 3, written by rank 0 into the logger's directory.
    trace_path, png_path = even[0]["trace_paths"]
    assert Path(trace_path).parent == Path(even[0]["log_dir"])
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert tracks == {"rank 0", "rank 1"}
    for rank in (0, 1):
        compute = sorted((e for e in events if e["ph"] == "X" and e["pid"] == rank
                          and e["cat"] in ("forward", "backward")), key=lambda e: e["ts"])
        assert len(compute) == 2 * m
        assert [e["name"] for e in compute] == [str(a) for a in schedule_actions("1f1b", 2, m)[rank]]
        waits = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] in ("send", "recv")]
        assert len(waits) == 2 * m  # one send and one receive per micro-batch on each of 2 stages
    with Image.open(png_path) as img:
        img.verify()
    with Image.open(png_path) as img:
        assert img.format == "PNG" and img.size[0] > 600
        assert len(set(img.convert("RGB").getdata())) > 8  # drawn, not blank
