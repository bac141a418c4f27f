"""Lightning features under HPPStrategy: loggers, progress bar, ModelCheckpoint, EarlyStopping,
the stage plan file, and multi-node launch through torchrun."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.harness.launch import Job, run_jobs
from tests.harness.runs import Runs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Both jobs of this module side by side (they share nothing): the Lightning-launched 2-rank fit with
    loggers and callbacks, and the two torchrun node agents (``tests.workers.run_hpp``, one process each).
    Returns (integration dir, its finished process, torchrun dir, the agents' outputs)."""
    root = tmp_path_factory.mktemp("integration")
    fit_dir, torchrun_dir = root / "fit", root / "torchrun"
    fit_dir.mkdir()
    torchrun_dir.mkdir()
    port = find_free_network_port()
    runs = Runs.of(1, "hpp", [{"name": "tr", "stages": [["layers.0-3"], ["layers.4-6"]], "schedule": "1f1b",
                                "n_micro": 4, "steps": 4, "batch": 16, "num_nodes": 2, "out": str(torchrun_dir)}])
    agents = [Job((sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank",
                   str(n), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "tests.workers.run_hpp"),
                  runs, script=True, timeout=480) for n in (0, 1)]
    fit, *agents = run_jobs([Job("tests.workers.run_cases", {"case": "lightning_integration", "devices": 2,
                                                             "out": str(fit_dir)}, ranks=2), *agents], check=False)
    fit.check()
    outs = [a.stdout + a.stderr for a in agents]
    return fit_dir, fit, torchrun_dir, (agents, outs)


def test_last_stage_metrics_reach_rank0_loggers_and_callbacks(jobs):
    tmp_path, proc, _, _ = jobs
    r0 = json.loads((tmp_path / "result0.json").read_text())
    r1 = json.loads((tmp_path / "result1.json").read_text())
    # EarlyStopping saw the real val_loss (min_delta=10 means no epoch improves enough) on both ranks
    assert r0["stopped"] == r1["stopped"] == 1
    # ModelCheckpoint(monitor="val_loss") on rank 0 tracked the last stage's value
    assert r0["best_score"] == pytest.approx(r1["best_score"])
    assert os.path.exists(r0["best_path"])
    # the checkpoint is sharded (each rank wrote its stage) and exports to one plain .ckpt with both stages
    from lightning_hpp.checkpoint import export_to_lightning_ckpt

    export_to_lightning_ckpt(r0["best_path"], str(tmp_path / "best.ckpt"))
    ckpt = torch.load(tmp_path / "best.ckpt", weights_only=True)
    assert {k for k in ckpt["state_dict"]} == {f"layers.{i}.{p}" for i in (0, 2, 4, 6) for p in ("weight", "bias")}
    # CSV logger on rank 0 has the train loss of every step and the val loss of every epoch
    metrics = list(csv.DictReader(open(Path(r0["log_dir"]) / "metrics.csv")))
    train = [float(m["train_loss"]) for m in metrics if m.get("train_loss")]
    val = [float(m["val_loss"]) for m in metrics if m.get("val_loss")]
    assert len(train) == 2 * 8 and all(0 < v < 10 for v in train)
    assert len(val) == 2 and val[-1] == pytest.approx(r0["val_loss"])
    # the progress bar ran on rank 0 and showed the last stage's loss
    import re

    assert re.search(r"train_loss[=:] ?\d\.\d+", proc.stderr + proc.stdout)
    plan = json.loads((Path(r0["log_dir"]) / "stage_plan.json").read_text())
    assert [s["modules"] for s in plan["stages"]] == [["layers.0", "layers.1", "layers.2", "layers.3"],
                                                      ["layers.4", "layers.5", "layers.6"]]
    assert plan["meta"]["schedule"] == "1f1b" and plan["meta"]["pp_degree"] == 2


def test_two_node_torchrun_matches_single_process(jobs):
    """Two torchrun node agents on loopback (--nnodes 2, one process each) train 2 stages."""
    from tests.harness.results import merged_state
    from tests.reference import train_reference

    _, _, tmp_path, (procs, outs) = jobs
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    reference, _ = train_reference(steps=4, batch=16)
    got = merged_state(tmp_path, [0, 1])
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
