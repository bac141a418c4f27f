"""Correct setups stay quiet, skew stops the run: HPPStrategy pp=2 × dp=2 with both guard policies "error",
launched with PYTHONHASHSEED unset (one 4-rank job, tests/bias_workers/catalogue_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_hpp.bias.audit import (
    HASHSEED_UNSET,
    NO_SET_EPOCH,
    PIPELINE_PEERS_DATA,
    REPRODUCIBILITY,
    SKEW,
    WRAPPED_RANK_DEPENDENT,
)
from tests.harness.launch import Job, run_job

pytestmark = pytest.mark.slow

WORKER = "tests.bias_workers.catalogue_worker"
RANKS = range(4)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("catalogue")
    proc = run_job(Job(WORKER, {"out": str(out)}, ranks=4, env={"PYTHONHASHSEED": None}, timeout=420), check=False)
    log = proc.stdout + proc.stderr  # the ranks' messages, wherever each went
    assert proc.returncode == 0, log[-6000:]
    results = {
        case: [json.loads((out / f"{case}_rank{r}.json").read_text()) for r in RANKS]
        for case in ("wrs", "dws", "skew", "deterministic")
    }
    return out, log, results


def test_correct_setups_train_with_notes_and_no_warning_of_ours(job):
    _, log, results = job
    for case, steps, codes in (("wrs", 16, [NO_SET_EPOCH, HASHSEED_UNSET]), ("dws", 2, [HASHSEED_UNSET])):
        for res in results[case]:
            assert res["error"] is None and res["global_step"] == steps, (case, res["error"])
            assert res["hazards"] == [[c, REPRODUCIBILITY] for c in codes], case
            assert res["differences"] == [["hash_probe_mismatch", REPRODUCIBILITY]], case
            assert res["alarms"] == [] and res["measured_steps"] == steps, case
    # Pipeline peers (ranks 0 and 2, 1 and 3) load the same batches in both epochs, replicas different ones,
    # though stage 0's dropout consumes torch's global RNG and stage 1 does not.
    for case in ("wrs", "dws"):
        seen = [res["seen"] for res in results[case]]
        assert seen[0] == seen[2] and seen[1] == seen[3] and seen[0] != seen[1], case
    # What the job printed (every rank's stdout and stderr): notes, never a warning of ours. A warning
    # names its source file; ours live in lightning_hpp/bias/ (and Lightning's own would name the metric).
    assert "lightning_hpp/bias/" not in log and "lightning_hpp" + "\\bias" not in log
    assert "'bias/" not in log  # e.g. Lightning asking for sync_dist on the monitor's epoch metrics
    assert f"BiasGuard note (data-loading audit): [{HASHSEED_UNSET}] (reproducibility)" in log
    assert f"BiasGuard note (data-loading audit): [{NO_SET_EPOCH}] (reproducibility)" in log
    assert "BiasGuard note (environment fingerprint across ranks): hash_probe_mismatch" in log
    # The record in the run directory has every finding with its severity.
    record = json.loads(Path(results["wrs"][0]["audit_path"]).read_text())
    assert [(h["code"], h["severity"]) for h in record["hazards"]] == [
        (NO_SET_EPOCH, REPRODUCIBILITY),
        (HASHSEED_UNSET, REPRODUCIBILITY),
    ]


def test_skew_stops_every_rank_before_the_first_step(job):
    _, _, results = job
    messages = set()
    for res in results["skew"]:
        assert res["error"]["type"] == "CodedBiasError" and res["global_step"] == 0
        assert [c for c, s in res["hazards"] if s == SKEW] == [WRAPPED_RANK_DEPENDENT, PIPELINE_PEERS_DATA]
        messages.add(res["error"]["message"])
    (message,) = messages  # one verdict on every rank
    assert f"[{WRAPPED_RANK_DEPENDENT}] (skew)" in message and f"[{PIPELINE_PEERS_DATA}] (skew)" in message
    assert NO_SET_EPOCH not in message and HASHSEED_UNSET not in message  # notes do not stop a run


def test_a_deterministic_run_is_stopped_by_the_reproducibility_findings(job):
    _, _, results = job
    for res in results["deterministic"]:
        assert res["error"]["type"] == "FingerprintMismatchError" and res["global_step"] == 0
        assert "hash_probe_mismatch" in res["error"]["message"] and "[reproducibility]" in res["error"]["message"]
    # The launching process says why its own hash seed cannot follow.
    assert any("started without it" in w for w in results["deterministic"][0]["recorded_warnings"])
