"""Logged values under HPPStrategy equal what single-process Lightning logs for the same batches:
``reduce_fx`` over micro-batches and over replicas, a torchmetrics metric synced on the last
stages only, and every collective's tensors on their group's device (pp=2 × dp=2, one launch)."""

from __future__ import annotations

import json

import lightning as L
import pytest
from torch.utils.data import DataLoader, DistributedSampler

from tests.harness.launch import Job, run_job
from tests.harness.zoo import loaders

pytestmark = pytest.mark.slow

STEP_KEYS = ("loss_sync", "ysum_step", "logit_max", "logit_min_step", "count", "acc")
FINAL_KEYS = ("ysum_epoch", "logit_min_epoch", "val_loss", "val_ysum", "val_max")


def _reference() -> tuple[list[dict[str, float]], dict[str, float]]:
    """One process, the global batch (16 = 2 replicas × 8), the order Lightning's samplers give the replicas."""
    from tests.workers.run_logging import LoggedMLP, StepMetrics, trainer_kwargs

    L.seed_everything(0)
    metrics = StepMetrics()
    trainer = L.Trainer(callbacks=[metrics], **trainer_kwargs(1, None))
    train, val = loaders(16)
    sampler = DistributedSampler(train.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(LoggedMLP(), DataLoader(train.dataset, batch_size=16, sampler=sampler, drop_last=True), val)
    return metrics.steps, {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_logged_values_reduce_fx_metrics_and_collective_devices(tmp_path):
    run_job(Job("tests.workers.run_logging", {"out": str(tmp_path), "devices": 4}, ranks=4, start="forked",
                timeout=300))
    ranks = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(4)]
    ref_steps, ref_final = _reference()
    for rank, got in enumerate(ranks):  # every rank logs what one process logs, not only rank 0
        assert len(got["steps"]) == len(ref_steps) == 6
        for step, (mine, ref) in enumerate(zip(got["steps"], ref_steps)):
            for key in STEP_KEYS:
                assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), f"rank {rank}, step {step}: {key}"
        for key in FINAL_KEYS:
            assert got["final"][key] == pytest.approx(ref_final[key], rel=1e-5, abs=1e-6), f"rank {rank}: {key}"
    got = ranks[0]
    # the sums really add both replicas' micro-batches: 16 samples per step
    assert all(s["count"] == 16 for s in got["steps"])
    # without sync_dist each rank logs its own replica's value, as under DDP: ranks 0 and 1 are replicas 0 and 1
    for step, ref in enumerate(ref_steps):
        replicas = [ranks[0]["steps"][step]["loss"], ranks[1]["steps"][step]["loss"]]
        assert replicas[0] != replicas[1]
        assert sum(replicas) / 2 == pytest.approx(ref["loss"], rel=1e-5)
    # a replayed key Lightning already took in the same hook skips its `log` (the values above are the check)
    for r in ranks:
        assert r["replays"]["short"] >= 3 * r["replays"]["whole"] > 0, r["replays"]
    # every rank ran the whole fit with every collective checked, and the check refuses what it must
    for r in ranks:
        assert r["checked"]["tensors"] > 0 and r["checked"]["objects"] > 0
        assert r["refused"] == ["host tensor", "host number", "cpu copy", "object device"]
        assert r["placed_sum"] == 2.0
        assert "reduce_fx=<built-in method median" in r["custom_fx_error"]
