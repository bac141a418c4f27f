"""Sharded checkpoints under HPPStrategy: exact mid-epoch resume, resharding, kill -9 recovery, S3."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lightning_hpp.checkpoint import export_to_lightning_ckpt, list_checkpoints
from tests.launch import ROOT, run_script
from tests.models import MLP
from tests.s3_server import FAKE_SECRET_KEY, s3_env  # noqa: F401 - fixture

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
            assert torch.equal(x["optim"][k]["momentum_buffer"], y["optim"][k]["momentum_buffer"]), f"rank {r}: momentum of {k}"


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """The runs of this module that need no S3 server, in two launches instead of seven.

    1. 4 ranks (pp=2 x dp=2) save a checkpoint at step 4 (``saved``, into ``ckpt4``);
    2. 2 ranks, one configuration after another, each with its own Trainer and model: the
       uninterrupted references (``full``: 12 steps, ``full8``: 8 steps); ``ckpt4`` loaded by 2 stages
       on 2 ranks (``dp1``); and, last, 5 steps that end with an asynchronous step-5 checkpoint
       (``first``, into ``ckpt``). Every resume below is a new job reading what an earlier job wrote.
    """
    out = tmp_path_factory.mktemp("resume")
    ckpt4 = str(out / "ckpt4")
    run_script("tests.workers.run_resume", {"stages": TWO, "pp": 2, "devices": 4, "steps": 4, "batch": 8, "tag": "saved", "out": str(out), "ckpt_dir": ckpt4, "every": 4})
    runs = [
        {"stages": TWO, "steps": 12, "tag": "full", "out": str(out)},
        {"stages": TWO, "steps": 8, "tag": "full8", "out": str(out)},
        {"stages": TWO, "devices": 2, "steps": 4, "tag": "dp1", "out": str(out), "ckpt_dir": ckpt4, "resume": "auto"},
        # stops after 5 of the 8 batches of epoch 0; the step-5 checkpoint is written asynchronously
        {"stages": TWO, "steps": 5, "tag": "first", "out": str(out), "ckpt_dir": str(out / "ckpt"), "every": 5, "async_save": True},
    ]
    run_script("tests.workers.run_resume", {"runs": runs})
    return out


def test_mid_epoch_resume_with_async_save_is_bitwise_exact_and_exports(shared, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(shared / "ckpt", ckpt)  # what the 5-step job of `shared` left
    assert [c.step for c in list_checkpoints(ckpt)] == [5]
    run_script("tests.workers.run_resume", {"stages": TWO, "steps": 12, "tag": "resumed", "out": str(tmp_path), "ckpt_dir": ckpt, "every": 5, "resume": "auto", "keep_last": 1})
    assert _load(tmp_path, "resumed", 0)["resumed_from"].endswith("step-5")
    for r in (0, 1):
        shutil.copy(shared / f"full_rank{r}.pt", tmp_path)
    _assert_bitwise(tmp_path, "full", "resumed")
    # keep_last=1 kept the newest (step-10) and the checkpoint the run resumed from (step-5)
    assert [c.step for c in list_checkpoints(ckpt)] == [5, 10]

    # export: one plain Lightning .ckpt that the module loads without HPPStrategy
    export_to_lightning_ckpt(str(Path(ckpt) / "step-5"), str(tmp_path / "model.ckpt"))
    restored = MLP.load_from_checkpoint(str(tmp_path / "model.ckpt"))
    first = {**_load(shared, "first", 0)["state"], **_load(shared, "first", 1)["state"]}
    for k, v in restored.state_dict().items():
        assert torch.equal(v, first[k])


def test_checkpoint_loads_under_other_cuts_and_dp_degrees(shared):
    # saved by pp=2 x dp=2 (4 ranks) ...
    saved = {**_load(shared, "saved", 0)["state"], **_load(shared, "saved", 2)["state"]}
    saved_optim = {**_load(shared, "saved", 0)["optim"], **_load(shared, "saved", 2)["optim"]}
    # ... loaded by 3 stages on 3 ranks (dp=1), and by 2 stages on 2 ranks (dp=1, in `shared`); max_steps is already reached
    run_script("tests.workers.run_resume", {"stages": THREE, "devices": 3, "steps": 4, "tag": "three", "out": str(shared), "ckpt_dir": str(shared / "ckpt4"), "resume": "auto"})
    for tag, devices in (("three", 3), ("dp1", 2)):
        got, optim = {}, {}
        for r in range(devices):
            out = _load(shared, tag, r)
            assert out["global_step"] == 4
            assert out["resumed_from"].endswith("step-4"), (tag, out["resumed_from"])
            got.update(out["state"])
            optim.update(out["optim"])
        assert sorted(got) == sorted(saved)
        for k in saved:
            assert torch.equal(got[k], saved[k]), f"{tag}: {k}"
        for k in saved_optim:
            assert torch.equal(optim[k]["momentum_buffer"], saved_optim[k]["momentum_buffer"]), f"{tag}: momentum of {k}"


def test_kill_9_under_torchrun_restarts_resumes_and_matches(shared, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for r in (0, 1):
        shutil.copy(shared / f"full_rank{r}.pt", tmp_path)  # the uninterrupted 12-step run
    cfg = {"stages": TWO, "steps": 12, "tag": "elastic", "out": str(tmp_path), "ckpt_dir": ckpt, "every": 2, "resume": "auto", "kill_at": 5, "kill_rank": 1}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{find_free_network_port()}", "-m", "tests.workers.run_resume", json.dumps(cfg)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    killed_at = float((tmp_path / "killed_at").read_text())
    first = json.loads((tmp_path / "first_step_after_restart").read_text())
    # the restarted job resumed from the step-4 checkpoint (the kill came after step 5) ...
    assert first["global_step"] == 5
    assert _load(tmp_path, "elastic", 0)["resumed_from"].endswith("step-4")
    # ... and ended bitwise equal to the uninterrupted run
    _assert_bitwise(tmp_path, "full", "elastic")
    recovery = first["time"] - killed_at
    print(f"recovery time (kill -9 -> first resumed step): {recovery:.1f} s")
    (tmp_path / "recovery_seconds").write_text(f"{recovery:.2f}")
    assert recovery < 120


def test_s3_model_checkpoint_and_last_resume_without_leaking_secrets(shared, tmp_path, s3_env):  # noqa: F811
    root = s3_env.root
    for r in (0, 1):
        shutil.copy(shared / f"full8_rank{r}.pt", tmp_path / f"full_rank{r}.pt")  # the uninterrupted 8-step run
    run_script("tests.workers.run_resume", {"stages": TWO, "steps": 6, "tag": "first", "out": str(tmp_path), "mc_dirpath": root, "every": 3})
    names = sorted({k.split("/")[1] for k in s3_env.objects()})
    # top-1 kept only the newest epoch checkpoint; last.ckpt is there too
    assert names == ["epoch=0-step=6.ckpt", "last.ckpt"], names
    run_script("tests.workers.run_resume", {"stages": TWO, "steps": 8, "tag": "resumed", "out": str(tmp_path), "mc_dirpath": root, "every": 3, "ckpt_path": "last"})
    assert _load(tmp_path, "resumed", 0)["resumed_from"] == f"{root}/last.ckpt"
    _assert_bitwise(tmp_path, "full", "resumed")
    secret = FAKE_SECRET_KEY.encode()
    for key, data in s3_env.objects().items():
        assert secret not in data, key
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes(), path
