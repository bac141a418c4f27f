"""BiasGuard: stops a real multi-process fit before its first step, stays silent on a correct setup,
writes and compares fingerprints (run directory, Lightning checkpoints, resume)."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, WeightedRandomSampler

from lightning_hpp.bias.audit import HASHSEED_DIFFERS, IDENTICAL_SAMPLING, NO_SET_EPOCH
from lightning_hpp.bias.fingerprint import HASH_PROBE, CodedBiasWarning, collect_fingerprint, load_fingerprints
from lightning_hpp.bias.guard import (
    AUDIT_FILENAME,
    FINGERPRINT_FILENAME,
    PIPELINE_PEERS_DATA,
    PIPELINE_PEERS_WORKERS,
    BiasGuard,
    compare_runs,
    pipeline_peer_hazards,
)
from lightning_hpp.errors import BiasConfigError, FingerprintMismatchError
from tests.harness.launch import Job, run_jobs
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, make_dataset

WORKER = "tests.bias_workers.guard_worker"


@pytest.fixture(scope="module")
def fp() -> dict:
    return json.loads(json.dumps(collect_fingerprint(), default=str))


def fresh_hash(seed: str) -> int:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", f"print(hash({HASH_PROBE!r}))"], env=env, capture_output=True,
                         text=True, check=True)
    return int(out.stdout)


# ------------------------------------------------------------------------------ options and pure parts
@pytest.mark.parametrize("kwargs, match", [
    ({"fingerprint": "strict"}, r"fingerprint=\.\.\.\)` is 'strict'"),
    ({"audit": None}, r"audit=\.\.\.\)` is None"),
    ({"max_indices": 0}, r"max_indices=0"),
    ({"filename": "runs/fp.json"}, r"filename='runs/fp.json'"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(BiasConfigError, match=match):
        BiasGuard(**kwargs)


def test_check_resume_is_deferred_until_fit_start_and_refuses_garbage(fp):
    guard = BiasGuard(fingerprint="error")
    assert guard.check_resume({"format": 1, "ranks": [fp, fp]}) is None  # no current fingerprints yet
    assert guard._pending_saved == [fp, fp]
    with pytest.raises(BiasConfigError, match="checkpoint_metadata"):
        guard.check_resume({"weights": [1, 2]})


def test_check_resume_names_field_ranks_and_values(fp):
    guard = BiasGuard(fingerprint="error")
    guard.fingerprints = [fp, fp, fp]
    assert guard.check_resume([fp, fp, fp]) == []
    saved = [copy.deepcopy(fp) for _ in range(3)]
    for r in (1, 2):
        saved[r]["cuda_version"] = "11.7.0"
    with pytest.raises(FingerprintMismatchError, match=r"cuda_version_mismatch in ranks 1-2: 11\.7\.0 \(saved\) vs"):
        guard.check_resume(saved)
    assert [d.scope for d in guard.resume_differences] == ["ranks 1-2"]
    warn = BiasGuard(fingerprint="warn")
    warn.fingerprints = [fp, fp, fp]
    with pytest.warns(CodedBiasWarning, match="cuda_version_mismatch"):
        assert len(warn.check_resume(saved)) == 1


def test_compare_runs_after_a_world_size_change_ignores_the_device_fields(fp):
    saved = copy.deepcopy(fp)
    saved["device_name"] = "NVIDIA A100-SXM4-80GB"
    saved["torch"] = "0.0.0"
    diffs = compare_runs([saved], [fp, fp])
    assert [(d.field, d.scope) for d in diffs] == [("torch", "ranks 0-1")]
    # Same world size: a device change on one rank is reported.
    assert [(d.field, d.scope) for d in compare_runs([fp, saved], [fp, fp])] == [("device_name", "rank 1"),
                                                                                  ("torch", "rank 1")]


def test_pipeline_peer_hazards_compare_the_ranks_of_each_replica():
    def part(rank, replica, shard, stream):
        return {"rank": rank, "replica": replica, "draws": [("train dataloader", shard, stream)]}

    same = [part(0, 0, [1, 2], (5,)), part(1, 1, [3, 4], (6,)), part(2, 0, [1, 2], (5,)), part(3, 1, [3, 4], (6,))]
    assert pipeline_peer_hazards(same) == []
    bad = [part(0, 0, [1, 2], (5,)), part(1, 1, [3, 4], (6,)), part(2, 0, [9, 2], (7,)), part(3, 1, [3, 4], (6,))]
    hazards = pipeline_peer_hazards(bad)
    assert [h.code for h in hazards] == [PIPELINE_PEERS_DATA, PIPELINE_PEERS_WORKERS]
    assert all(h.ranks == (0, 2) for h in hazards)
    assert "[1, 2] (rank 0) vs [9, 2] (rank 2)" in hazards[0].message


# ------------------------------------------------------------------------------ one device, in process
def test_single_device_fit_notes_keeps_training_and_stores_loadable_fingerprints(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    guard = BiasGuard(audit="error", deterministic=False)  # whatever torch's flag says in this process
    L.seed_everything(0)
    trainer = quiet_trainer(devices=1, max_steps=2, default_root_dir=str(tmp_path), callbacks=[guard])
    w = torch.ones(64)
    w[:8] = 10.0
    loader = DataLoader(make_dataset(64), batch_size=8, sampler=WeightedRandomSampler(w, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(MLP(), loader)
    # A plain WeightedRandomSampler follows no epoch: a reproducibility note, neither a warning nor an error ...
    assert [w for w in caught if issubclass(w.category, CodedBiasWarning)] == []
    assert trainer.global_step == 2 and guard.audited_at_step == 0  # ... found before the first step
    assert [(h.code, h.severity) for h in guard.hazards] == [(NO_SET_EPOCH, "reproducibility")]
    assert json.loads((tmp_path / AUDIT_FILENAME).read_text())["hazards"][0]["severity"] == "reproducibility"
    assert load_fingerprints(str(tmp_path / FINGERPRINT_FILENAME)) == guard.fingerprints
    assert len(guard.fingerprints) == 1 and guard.stage_of_rank == [0] and guard.device_kinds == ["cpu"]
    # Checkpoints must load with torch.load(weights_only=True): the state holds plain types only.
    buf = io.BytesIO()
    torch.save(guard.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["fingerprints"] == guard.fingerprints
    assert guard.check_resume(guard.checkpoint_metadata()) == []


# ------------------------------------------------------------------------------ real 2-rank fits
@pytest.fixture(scope="module")
def guard_jobs(tmp_path_factory):
    """Both 2-rank jobs, run side by side: ``bad`` launched without PYTHONHASHSEED (its launcher sets it
    for rank 1 only, as a determinism switch can), ``good`` with PYTHONHASHSEED=0 for every rank."""
    out = tmp_path_factory.mktemp("guard")
    run_jobs([Job(WORKER, {"case": "bad", "out": str(out)}, ranks=2, env={"PYTHONHASHSEED": None}, timeout=300),
              Job(WORKER, {"case": "good", "out": str(out)}, ranks=2, env={"PYTHONHASHSEED": "0"}, timeout=300)])
    return out


@pytest.mark.slow
def test_guard_stops_a_two_rank_hpp_fit_before_the_first_step(guard_jobs):
    ranks = [json.loads((guard_jobs / f"bad_rank{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(ranks):
        assert res["env_hash_seed"] == "0"
        for case in ("fingerprint", "wrapped", "identical"):
            run = res[case]
            assert run["global_step"] == 0 and run["batches_started"] == 0 and run["params_unchanged"], (r, case)
            assert run["error"]["message"] == ranks[0][case]["error"]["message"]  # one verdict on every rank
        fp_run = res["fingerprint"]
        assert fp_run["error"]["type"] == "FingerprintMismatchError"
        assert "hash_probe_mismatch" in fp_run["error"]["message"]
        assert any(d.startswith("hash_probe_mismatch") and "(rank 0) vs" in d and "(rank 1)" in d
                   for d in fp_run["differences"])
        assert fp_run["stage_of_rank"] == [0, 1]
        # The sampler Lightning wraps (pp=2 × dp=1) follows no epoch; rank 0's hash seed differs.
        assert res["wrapped"]["error"]["type"] == "CodedBiasError"
        assert res["wrapped"]["hazards"] == [NO_SET_EPOCH, HASHSEED_DIFFERS]
        assert res["wrapped"]["audited_at_step"] == 0
        assert f"[{NO_SET_EPOCH}] (reproducibility)" in res["wrapped"]["error"]["message"]
        # Not deterministic: the same findings are notes, the run trains.
        notes = res["notes"]
        assert notes["error"] is None and notes["global_step"] == 2 and not notes["params_unchanged"]
        assert notes["hazards"] == [NO_SET_EPOCH, HASHSEED_DIFFERS]
        assert [d.split(":")[0] for d in notes["differences"]] == ["hash_probe_mismatch", "hash_randomization_mismatch"]
        # The field report's bug with use_distributed_sampler=False (pp=1 × dp=2): identical draws, skew.
        assert res["identical"]["hazards"][0] == IDENTICAL_SAMPLING and HASHSEED_DIFFERS in res["identical"]["hazards"]
        message = res["identical"]["error"]["message"]
        assert "ranks 0-1 draws the identical sequence" in message and f"[{IDENTICAL_SAMPLING}] (skew)" in message
        assert HASHSEED_DIFFERS not in message  # a note: it is not what stops this run
    # The hash seed reached the launched rank only.
    probes = [res["fingerprint"]["fingerprints"][r]["hash_probe"] for r, res in zip((0, 1), ranks)]
    assert probes[1] == fresh_hash("0") != probes[0]
    # Every finding and its severity, in the run directory.
    record = json.loads(Path(ranks[0]["notes"]["audit_path"]).read_text())
    assert [(h["code"], h["severity"]) for h in record["hazards"]] == [(NO_SET_EPOCH, "reproducibility"),
                                                                       (HASHSEED_DIFFERS, "reproducibility")]
    assert [(d["code"], d["severity"]) for d in record["fingerprint_differences"]] == [
        ("hash_probe_mismatch", "reproducibility"), ("hash_randomization_mismatch", "reproducibility")]
    assert record["deterministic"] is False
    assert json.loads(Path(ranks[0]["identical"]["audit_path"]).read_text())["hazards"][0]["severity"] == "skew"


@pytest.mark.slow
def test_guard_is_silent_on_a_correct_setup_and_checks_resume(guard_jobs):
    ranks = [json.loads((guard_jobs / f"good_rank{r}.json").read_text()) for r in (0, 1)]
    on_disk = load_fingerprints(str(guard_jobs / "hpp" / FINGERPRINT_FILENAME))
    for res in ranks:
        hpp = res["hpp"]
        assert hpp["error"] is None and hpp["hazards"] == [] and hpp["differences"] == []
        assert hpp["global_step"] == 2 and hpp["audited_at_step"] == 0
        assert hpp["fingerprints"] == on_disk and len(on_disk) == 2
        assert hpp["stage_of_rank"] == [0, 1] and hpp["device_kinds"] == ["cpu", "cpu"]
        assert hpp["resume_same"] == []
        assert "torch_mismatch in rank 1: 0.0.0 (saved) vs" in hpp["resume_altered"]
        # DDP: fingerprints travel in the Lightning checkpoint and are compared on resume.
        assert res["ddp"]["error"] is None and res["ddp"]["hazards"] == []
        assert res["resume_same"]["error"] is None and res["resume_same"]["resume_differences"] == []
        assert res["resume_same"]["global_step"] == 3 and res["resume_same"]["batches_started"] == 1
        altered = res["resume_altered"]
        assert altered["error"]["type"] == "FingerprintMismatchError" and altered["batches_started"] == 0
        assert altered["resume_differences"] == [d for d in altered["resume_differences"] if "torch_mismatch" in d]
        assert altered["resume_differences"][0].startswith("torch_mismatch in rank 1: 0.0.0 (saved) vs")
    assert ranks[0]["ddp"]["ckpt_has_fingerprints"] == 2
