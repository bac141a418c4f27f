"""fp32 pipelines reproduce single-process training: every parameter, every schedule.

Each test checks one real multi-process job (Lightning re-launches the script per rank, gloo; the
jobs of 2, 3 and 4 ranks, shared with other modules, run side by side: tests/conftest.py), which runs
several configurations, and compares every parameter with a single-process Trainer trained on the
same data with the same global batch for the same number of optimizer steps.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.results import load_rank, merged_state
from tests.harness.trainer import quiet_trainer
from tests.reference import train_reference

pytestmark = pytest.mark.slow

FOUR = [["layers.0-1"], ["layers.2-3"], ["layers.4-5"], ["layers.6"]]
TWO = [["layers.0-3"], ["layers.4-6"]]
THREE = [["layers.0-1"], ["layers.2-3"], ["layers.4-6"]]
TOL = dict(rtol=1e-5, atol=1e-6)


def _assert_matches(reference, out_dir, ranks):
    got = merged_state(out_dir, ranks)
    ref = reference.state_dict()
    assert sorted(got) == sorted(ref)
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, **TOL, msg=lambda m: f"{name}: {m}")


def _two_rank_runs() -> list[dict]:
    runs = [
        {"name": "gpipe", "stages": TWO, "schedule": "gpipe", "n_micro": 4},
        {"name": "1f1b", "stages": TWO, "schedule": "1f1b", "n_micro": 4, "validate": True, "predict": True,
         "limit_val_batches": 1.0},
        {"name": "interleaved1f1b", "stages": FOUR, "schedule": "interleaved1f1b", "n_micro": 4},
        {"name": "interleaved_zb", "stages": FOUR, "schedule": "interleaved_zb", "n_micro": 4},
        {"name": "zbv", "stages": FOUR, "schedule": "zbv", "n_micro": 4},
        {"name": "dualpipev", "stages": FOUR, "schedule": "dualpipev", "n_micro": 4},
    ]
    for r in runs:
        r.update(steps=5, batch=16)
    return runs


def _three_rank_runs() -> list[dict]:
    return [{"name": n, "stages": THREE, "schedule": n, "n_micro": 4, "steps": 4,
             "batch": 16} for n in ("gpipe", "1f1b")]


def _four_rank_runs() -> list[dict]:
    # 4 ranks: 2 pipeline stages × 2 replicas; each replica reads batches of 8, global batch 16;
    # accumulate_grad_batches=2, so 3 optimizer steps read 6 global batches.
    runs = [
        {"name": "1f1b", "stages": TWO, "schedule": "1f1b", "n_micro": 2, "pp": 2, "accumulate": 2,
         "bias_monitor": True},
        {"name": "interleaved", "stages": FOUR, "schedule": "interleaved1f1b", "n_micro": 2, "pp": 2, "accumulate": 2},
    ]
    for r in runs:
        r.update(steps=3, batch=8)
    return runs


# This module's configurations by number of ranks, for the shared ``run_hpp`` jobs of tests/conftest.py
# (``hpp_jobs``): ``out / name`` holds each run's outputs.
def two_rank_runs(out) -> list[dict]:
    return [{**r, "out": str(out / r["name"])} for r in _two_rank_runs()]


def three_rank_runs(out) -> list[dict]:
    return [{**r, "out": str(out / r["name"])} for r in _three_rank_runs()]


def four_rank_runs(out) -> list[dict]:
    return [{**r, "out": str(out / r["name"])} for r in _four_rank_runs()]


@pytest.fixture(scope="module")
def jobs(hpp_jobs):
    """``jobs[n] / name``: the outputs of this module's run ``name`` on ``n`` ranks (tests/conftest.py)."""
    return {n: hpp_jobs.correctness / f"ranks{n}" for n in (2, 3, 4)}


def test_two_ranks_every_schedule(jobs):
    tmp_path = jobs[2]
    runs = [{**r, "out": str(tmp_path / r["name"])} for r in _two_rank_runs()]
    reference, trainer = train_reference(steps=5, batch=16)
    for r in runs:
        _assert_matches(reference, r["out"], [0, 1])
        for rank in (0, 1):
            out = load_rank(r["out"], rank)
            assert out["global_step"] == 5
            assert out["held_outputs"] == 0  # no micro-batch's output outlives its loss on the last stage
            # the step's exchange ran beside the first stage's last backward: posted before it on rank 0 (which holds
            # the first stage), on rank 1 once its gradients were sent (at its first weight pass where there is one)
            zero_bubble = r["schedule"] in ("interleaved_zb", "zbv", "dualpipev")
            assert out["exchange_posted"] == ("before the last backward" if rank == 0 else
                                              "at a weight pass" if zero_bubble else "after the schedule"), r["name"]
            # the last stage's logged loss reached every rank, rank 0 included
            want = float(trainer.callback_metrics["train_loss"])
            assert out["metrics"]["train_loss"] == pytest.approx(want, rel=1e-5)
    # interleaved placement: rank 0 holds stages 0 and 2; V placement: stages 0 and 3
    assert load_rank(tmp_path / "interleaved1f1b", 0)["stage_ids"] == [0, 2]
    assert load_rank(tmp_path / "zbv", 0)["stage_ids"] == [0, 3]

    # validation loss and predictions equal the single-process model's, on rank 0

    from tests.harness.zoo import loaders

    val = loaders(16)[1]
    ref_trainer = quiet_trainer(enable_checkpointing=None, devices=1)
    expected = ref_trainer.validate(reference, val, verbose=False)[0]
    preds = torch.cat(ref_trainer.predict(reference, val))
    for rank in (0, 1):
        out = load_rank(tmp_path / "1f1b", rank)
        got = out["validate"][0]
        assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
        assert got["val_acc"] == pytest.approx(expected["val_acc"])
        assert torch.equal(out["predict"], preds)


def test_three_stages_gpipe_and_1f1b(jobs):
    runs = [{**r, "out": str(jobs[3] / r["name"])} for r in _three_rank_runs()]
    reference, _ = train_reference(steps=4, batch=16)
    for r in runs:
        _assert_matches(reference, r["out"], [0, 1, 2])


def test_pp2_dp2_with_gradient_accumulation(jobs):
    tmp_path = jobs[4]
    runs = [{**r, "out": str(tmp_path / r["name"])} for r in _four_rank_runs()]
    reference, _ = train_reference(steps=3, batch=16, accumulate=2)
    for r in runs:
        # ranks 0,1 hold stage 0 (replicas 0,1); ranks 2,3 hold stage 1: compare both replicas
        _assert_matches(reference, r["out"], [0, 2])
        _assert_matches(reference, r["out"], [1, 3])
        assert load_rank(r["out"], 0)["global_step"] == 3
    # the gradient norms BiasMonitor compares are taken before the dp all-reduce: the two replicas of
    # stage 0 saw different data, so their local norms differ although their parameters are equal;
    # without a BiasMonitor nobody asks and they are not taken
    n0 = load_rank(tmp_path / "1f1b", 0)["step_stats"]["local_grad_norms"][0]
    n1 = load_rank(tmp_path / "1f1b", 1)["step_stats"]["local_grad_norms"][0]
    assert n0 > 0 and n1 > 0 and n0 != n1
    assert "local_grad_norms" not in load_rank(tmp_path / "interleaved", 0)["step_stats"]
