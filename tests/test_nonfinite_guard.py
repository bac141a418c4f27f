"""The NaN/Inf guard in a real pp=2 × dp=2 job: one rank's stage turns non-finite, the step's one
exchange tells every rank, and every rank acts at that same step (no hang, no rank left behind)."""

from __future__ import annotations

import json

import pytest

from tests.harness.launch import Job, run_job

pytestmark = pytest.mark.slow


def test_one_ranks_nan_stops_every_rank_at_that_step_or_warns_where_it_is(tmp_path):
    run_job(Job("tests.workers.run_nonfinite", {"out": str(tmp_path), "poison_step": 2, "steps": 4}, ranks=4,
                start="forked",
                timeout=300))
    ranks = {p: [json.loads((tmp_path / p / f"rank{r}.json").read_text()) for r in range(4)]
             for p in ("warn", "raise", "gradient")}

    warn = ranks["warn"]
    assert all(r["error"] is None and r["global_step"] == 4 for r in warn)  # everyone trained on
    # the ranks of the poisoned replica say where, stage by stage; the other replica's ranks say nothing at that
    # step (from the next one on they see NaN of their own: warn trains on with the averaged NaN gradients)
    assert [(r["replica"], r["stage_ids"]) for r in warn] == [(0, [0]), (1, [0]), (0, [1]), (1, [1])]
    assert "forward activation leaving stage 0 (micro-batch 0, step 2)" in warn[0]["warnings"][0]
    assert "forward activation leaving stage 1 (micro-batch 0, step 2)" in warn[2]["warnings"][0]
    assert not any("step 2)" in w for w in warn[1]["warnings"] + warn[3]["warnings"])
    assert any("(micro-batch 0, step 3)" in w for w in warn[1]["warnings"])

    raised = ranks["raise"]
    for r in raised:  # every rank stops with the guard's error at the poisoned step, before its optimizer step
        assert r["error"] is not None and r["error"]["type"] == "NonFiniteError", r
        assert r["global_step"] == 2, r
        assert "nonfinite='warn'" in r["error"]["message"]
    assert "forward activation leaving stage 0 (micro-batch 0, step 2)" in raised[0]["error"]["message"]
    assert "forward activation leaving stage 1 (micro-batch 0, step 2)" in raised[2]["error"]["message"]
    for r in (raised[1], raised[3]):  # the clean replica's ranks name the positions where it happened
        assert "pipeline position(s) [0, 1] (in this or another replica) in step 2" in r["error"]["message"], r
        assert r["finite_params"]  # and took no step with the poisoned gradients

    # NaN gradients only (stage 1 of replica 0 sends them back): stage 0 finds them before its backward, and every
    # rank stops at that step, before its optimizer step
    for r in ranks["gradient"]:
        assert r["error"] is not None and r["error"]["type"] == "NonFiniteError" and r["global_step"] == 2, r
        assert r["finite_params"], r
    message = ranks["gradient"][0]["error"]["message"]
    assert "gradient arriving at stage 0 from stage 1 (micro-batch 0, step 2)" in message
    assert "pipeline position(s) [0]" in ranks["gradient"][1]["error"]["message"]
