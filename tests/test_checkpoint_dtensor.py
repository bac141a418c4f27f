"""Checkpoints of sharded stages (FSDP2 / tensor-parallel DTensors) through torch.distributed.checkpoint.

One 2-rank gloo job (``tests/ckpt_workers/dtensor_worker.py``) trains a ``fully_shard`` model, saves it
(synchronously and with ``async_save``) through the strategy's own save and load functions, loads it
under the same layout, a tensor-parallel one and a replicated one, through the S3 store too (a local moto
server), and resumes past a damaged shard.
Each test asserts one finding against values recomputed here, never against copied numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lightning_hpp.checkpoint import checkpoint_url
from lightning_hpp.checkpoint.lightning_state import load_lightning_checkpoint
from lightning_hpp.checkpoint.dcp_index import read_index
from lightning_hpp.checkpoint.discovery import CORRUPT_DIR
from tests.ckpt_workers import dtensor_worker as worker
from tests.ckpt_workers.common import TinyNet
from tests.harness.launch import Job, run_job
from tests.harness.results import rank_results
from tests.s3_server import UNSET_AWS, aws_variables, fresh_bucket

WORKER = Path(__file__).parent / "ckpt_workers" / "dtensor_worker.py"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("dtensor")
    root = out / "ckpt"
    with fresh_bucket() as s3:
        (out / "config.json").write_text(json.dumps({"root": str(root), "s3_root": s3.root}))
        env = {**aws_variables(s3), **dict.fromkeys(UNSET_AWS)}
        run_job(Job(WORKER, str(out), ranks=2, start="per_rank", script=True, cwd=out, env=env, timeout=600))
        ranks = rank_results(out, 2)
        s3_objects = sorted(s3.objects())
    return {"out": out, "root": root, "ranks": ranks, "full": torch.load(out / "full-state.pt", weights_only=True),
            "s3_objects": s3_objects}


def _reference_losses(steps: int) -> list[float]:
    """The same training in one process, unsharded."""
    torch.set_num_threads(1)
    model, opt = worker.plain_model(seed=0)
    return [worker.train_step(model, opt, s) for s in range(1, steps + 1)]


def test_fsdp_training_matches_one_process(job: dict) -> None:
    ref = _reference_losses(4)
    for r in job["ranks"]:
        assert r["losses"] == pytest.approx(ref, abs=1e-5)


def test_each_rank_writes_only_its_own_shards(job: dict) -> None:
    # step-2 was renamed nothing; step-3 went to corrupt/ in the fallback part of the job
    for url in (job["root"] / "step-2", job["root"] / CORRUPT_DIR / "step-3"):
        index = read_index(str(url))
        embed = index.state_dict_metadata["model/embed.weight"]
        assert list(embed.size) == [8, 6]  # the global shape, in two row halves
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in embed.chunks) == [((0, 0), (4, 6)), ((4, 0), (4, 6))]
        files = {}
        for where, info in index.storage_data.items():
            if where.fqn.startswith(("model/",
                                     "optim/0/")) and where.offset is not None and where.fqn.endswith("weight"):
                files.setdefault(where.fqn, set()).add((tuple(where.offset)[0] > 0, info.relative_path))
            if where.fqn.startswith(
                "optim/0/") and where.fqn.endswith(("exp_avg", "exp_avg_sq")) and where.offset is not None:
                files.setdefault(where.fqn, set()).add((tuple(where.offset)[0] > 0, info.relative_path))
        assert files["model/embed.weight"] == {(False, "__0_0.distcp"), (True, "__1_0.distcp")}
        assert files["optim/0/blocks.1.weight/exp_avg"] == {(False, "__0_0.distcp"), (True, "__1_0.distcp")}
    for r in job["ranks"]:
        assert r["control_gathers"] > 0  # what the count would show had any DTensor been gathered
        assert r["save_gathers"] == 0 and r["load_gathers"] == 0  # no DTensor was gathered to save or load
        assert {s["path"] for s in r["shards"]} == {".metadata", "__0_0.distcp", "__1_0.distcp"}


def test_same_layout_resume_is_exact(job: dict) -> None:
    for r in job["ranks"]:
        assert r["same_layout"] == [], r["same_layout"]
        assert r["global_step"] == 3
        # the async save holds the step-3 state although step 4 ran while it was written
        assert r["async_step"] == 3
        assert r["resumed_step"] == [] and r["resumed_loss"] == r["losses"][3]


def test_loads_into_tensor_parallel_and_replicated_layouts(job: dict) -> None:
    for r in job["ranks"]:
        assert r["tp_placements"] == ["(Replicate(),)", "(Shard(dim=0),)", "(Shard(dim=1),)"]
        assert r["tp"] == [], r["tp"]
        assert r["replicated"] == [], r["replicated"]


def test_damaged_shard_falls_back_to_the_previous_checkpoint_on_every_rank(job: dict) -> None:
    root = job["root"]
    for r in job["ranks"]:
        assert r["fallback_url"] == str(root / "step-2")
        assert r["fallback"] == [], r["fallback"]
    (line,) = [w for w in job["ranks"][0]["fallback_warnings"] if w.startswith("Skipping checkpoint")]
    assert "'__1_0.distcp' fails its sha256" in line and "(found by rank 1)" in line, line
    assert not job["ranks"][1]["fallback_warnings"]
    assert (root / CORRUPT_DIR / "step-3").is_dir() and not (root / "step-3").exists()


def test_sharded_checkpoint_loads_whole_into_one_process(job: dict) -> None:
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    ckpt = load_lightning_checkpoint(checkpoint_url(str(job["root"]), 2), model, [opt], global_rank=0, position=0)
    model.load_state_dict(ckpt["state_dict"])
    opt.load_state_dict(ckpt["optimizer_states"][0])
    assert worker.differences(worker.full_state(model, opt), job["full"]["step2"]) == []
    assert isinstance(model.embed, nn.Linear) and ckpt["loops"] == {"fit_loop": {"step": 2}}


def test_sharded_stages_save_to_s3_and_load_from_there_into_another_layout(job: dict) -> None:
    step4 = [k.split("/", 2)[2] for k in job["s3_objects"] if k.startswith("run/step-4/")]
    assert sorted(step4) == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
    for r in job["ranks"]:
        assert r["s3_tp"] == [], r["s3_tp"]
