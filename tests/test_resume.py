"""Sharded checkpoints under HPPStrategy: exact mid-epoch resume, resharding, kill -9 recovery, S3."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lightning_hpp.checkpoint import export_to_lightning_ckpt, list_checkpoints
from tests.harness.launch import Job, run_job, run_jobs
from tests.harness.zoo import MLP
from tests.s3_server import FAKE_SECRET_KEY, UNSET_AWS, aws_variables, fresh_bucket

pytestmark = pytest.mark.slow

TWO = [["layers.0-3"], ["layers.4-6"]]
THREE = [["layers.0-1"], ["layers.2-3"], ["layers.4-6"]]


def _load(out: Path, tag: str, rank: int) -> dict:
    return torch.load(out / f"{tag}_rank{rank}.pt", weights_only=False)


def _assert_bitwise(out: Path, a: str, b: str, ranks=(0, 1)) -> None:
    for r in ranks:
        x, y = _load(out, a, r), _load(out, b, r)
        assert x["global_step"] == y["global_step"]
        assert sorted(x["state"]) == sorted(y["state"])
        for k in x["state"]:
            assert torch.equal(x["state"][k], y["state"][k]), f"rank {r}: parameter {k} differs"
        assert sorted(x["optim"]) == sorted(y["optim"])
        for k in x["optim"]:
            assert torch.equal(x["optim"][k]["momentum_buffer"],
                               y["optim"][k]["momentum_buffer"]), f"rank {r}: momentum of {k}"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The runs of this module but the torchrun one: four jobs in two rounds of two side by side (the jobs
    of a round share nothing) instead of ten jobs one after another. Every resume is a job of the second
    round reading what a job of the first wrote. Jobs of 2 ranks run their configurations one after
    another, each with its own Trainer and model.

    1. 4 ranks (pp=2 x dp=2) save a checkpoint at step 4 (``saved``, into ``ckpt4``); 2 ranks run the
       uninterrupted references (``full``: 12 steps, ``full8``: 8 steps), 5 steps that end with an
       asynchronous step-5 checkpoint (``first``, into ``ckpt``) and 6 steps with a ModelCheckpoint on S3
       (``s3_first``, every 3 steps, save_last).
    2. 3 ranks load ``ckpt4`` under 3 stages (``three``); 2 ranks load it under 2 stages (``dp1``), resume
       ``first`` with ``resume="auto"`` and ``keep_last=1`` (``resumed``, on a copy of ``ckpt``: ``ckpt_resumed``)
       and resume ``s3_first`` from S3 with ``ckpt_path="last"`` (``s3_resumed``).

    Yields (out dir, the S3Env, the S3 checkpoint names after round 1).
    """
    out = tmp_path_factory.mktemp("resume")
    ckpt4, ckpt, o = str(out / "ckpt4"), str(out / "ckpt"), str(out)
    with fresh_bucket() as s3:
        env = {**aws_variables(s3), **dict.fromkeys(UNSET_AWS)}
        root = s3.root
        run_jobs([
            Job("tests.workers.run_resume",
                {"stages": TWO, "pp": 2, "devices": 4, "steps": 4, "batch": 8, "tag": "saved", "out": o,
                 "ckpt_dir": ckpt4, "every": 4}, ranks=4, start="forked", timeout=400),
            Job("tests.workers.run_resume", {"runs": [
                {"stages": TWO, "steps": 12, "tag": "full", "out": o},
                {"stages": TWO, "steps": 8, "tag": "full8", "out": o},
                {"stages": TWO, "steps": 6, "tag": "s3_first", "out": o, "mc_dirpath": root, "every": 3},
                # stops after 5 of the 8 batches of epoch 0; the step-5 checkpoint is written asynchronously
                {"stages": TWO, "steps": 5, "tag": "first", "out": o, "ckpt_dir": ckpt, "every": 5, "async_save": True},
            ]}, ranks=2, start="forked", env=env, timeout=400),
        ])
        s3_names = sorted({k.split("/")[1] for k in s3.objects()})
        shutil.copytree(ckpt, out / "ckpt_resumed")
        run_jobs([
            Job("tests.workers.run_resume",
                {"stages": THREE, "devices": 3, "steps": 4, "tag": "three", "out": o, "ckpt_dir": ckpt4,
                 "resume": "auto"}, ranks=3, start="forked", timeout=400),
            Job("tests.workers.run_resume", {"runs": [
                {"stages": TWO, "devices": 2, "steps": 4, "tag": "dp1", "out": o, "ckpt_dir": ckpt4, "resume": "auto"},
                {"stages": TWO, "steps": 12, "tag": "resumed", "out": o, "ckpt_dir": str(out / "ckpt_resumed"),
                 "every": 5, "resume": "auto", "keep_last": 1},
                {"stages": TWO, "steps": 8, "tag": "s3_resumed", "out": o, "mc_dirpath": root, "every": 3,
                 "ckpt_path": "last"},
            ]}, ranks=2, start="forked", env=env, timeout=400),
        ])
        yield out, s3, s3_names


def test_mid_epoch_resume_with_async_save_is_bitwise_exact_and_exports(shared):
    out, _, _ = shared
    assert [c.step for c in list_checkpoints(str(out / "ckpt"))] == [5]  # what the 5-step job left
    assert _load(out, "resumed", 0)["resumed_from"].endswith("step-5")
    _assert_bitwise(out, "full", "resumed")
    # keep_last=1 kept the newest (step-10) and the checkpoint the run resumed from (step-5)
    ckpt = str(out / "ckpt_resumed")
    assert [c.step for c in list_checkpoints(ckpt)] == [5, 10]

    # export: one plain Lightning .ckpt that the module loads without HPPStrategy
    export_to_lightning_ckpt(str(Path(ckpt) / "step-5"), str(out / "model.ckpt"))
    restored = MLP.load_from_checkpoint(str(out / "model.ckpt"))
    first = {**_load(out, "first", 0)["state"], **_load(out, "first", 1)["state"]}
    for k, v in restored.state_dict().items():
        assert torch.equal(v, first[k])


def test_checkpoint_loads_under_other_cuts_and_dp_degrees(shared):
    out, _, _ = shared
    # saved by pp=2 x dp=2 (4 ranks) ...
    saved = {**_load(out, "saved", 0)["state"], **_load(out, "saved", 2)["state"]}
    saved_optim = {**_load(out, "saved", 0)["optim"], **_load(out, "saved", 2)["optim"]}
    # ... loaded by 3 stages on 3 ranks (dp=1), and by 2 stages on 2 ranks (dp=1); max_steps is already reached
    for tag, devices in (("three", 3), ("dp1", 2)):
        got, optim = {}, {}
        for r in range(devices):
            loaded = _load(out, tag, r)
            assert loaded["global_step"] == 4
            assert loaded["resumed_from"].endswith("step-4"), (tag, loaded["resumed_from"])
            got.update(loaded["state"])
            optim.update(loaded["optim"])
        assert sorted(got) == sorted(saved)
        for k in saved:
            assert torch.equal(got[k], saved[k]), f"{tag}: {k}"
        for k in saved_optim:
            assert torch.equal(optim[k]["momentum_buffer"],
                               saved_optim[k]["momentum_buffer"]), f"{tag}: momentum of {k}"


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "lightning_hpp.torchrun"])
def test_kill_9_under_torchrun_restarts_resumes_and_matches(shared, tmp_path, launcher):
    """torchrun execs fresh workers; ``lightning_hpp.torchrun`` forks them from a forkserver that imported
    Lightning once, so the restarted workers (and the first ones) find it imported before the script runs."""
    ckpt = str(tmp_path / "ckpt")
    for r in (0, 1):
        shutil.copy(shared[0] / f"full_rank{r}.pt", tmp_path)  # the uninterrupted 12-step run
    cfg = {"stages": TWO, "steps": 12, "tag": "elastic", "out": str(tmp_path), "ckpt_dir": ckpt, "every": 2,
           "resume": "auto", "kill_at": 5, "kill_rank": 1}
    proc = run_job(Job((sys.executable, "-m", launcher, "--nproc-per-node", "2", "--max-restarts", "1",
                        "--monitor-interval", "0.5", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{find_free_network_port()}", "-m", "tests.workers.run_resume"),
                       cfg, ranks=2, script=True, timeout=400), check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    killed_at = float((tmp_path / "killed_at").read_text())
    first = json.loads((tmp_path / "first_step_after_restart").read_text())
    # the restarted job resumed from the step-4 checkpoint (the kill came after step 5) ...
    assert first["global_step"] == 5
    assert first["preloaded"] is (launcher == "lightning_hpp.torchrun")
    # per-worker state read at import is the worker's own: torchrun's OMP_NUM_THREADS=1, Lightning's rank-zero
    # messages on rank 0 only (once per attempt)
    assert first["threads"] == int(os.environ.get("OMP_NUM_THREADS", "1"))
    assert (proc.stdout + proc.stderr).count("GPU available") == 2, proc.stderr[-3000:]
    assert _load(tmp_path, "elastic", 0)["resumed_from"].endswith("step-4")
    # ... and ended bitwise equal to the uninterrupted run
    _assert_bitwise(tmp_path, "full", "elastic")
    recovery = first["time"] - killed_at
    print(f"recovery time under {launcher} (kill -9 -> first resumed step): {recovery:.1f} s")
    (tmp_path / "recovery_seconds").write_text(f"{recovery:.2f}")
    assert recovery < 120


def test_s3_model_checkpoint_and_last_resume_without_leaking_secrets(shared):
    out, s3_env, names = shared
    root = s3_env.root
    # after the 6-step job: top-1 kept only the newest epoch checkpoint; last.ckpt is there too
    assert names == ["epoch=0-step=6.ckpt", "last.ckpt"], names
    assert _load(out, "s3_resumed", 0)["resumed_from"] == f"{root}/last.ckpt"
    _assert_bitwise(out, "full8", "s3_resumed")
    secret = FAKE_SECRET_KEY.encode()
    for key, data in s3_env.objects().items():
        assert secret not in data, key
    for path in out.rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes(), path
