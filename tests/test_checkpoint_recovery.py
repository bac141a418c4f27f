"""Resume past damaged checkpoints under HPPStrategy: real ranks, a real Trainer, kill-free.

One module fixture runs the jobs once (2 pipeline ranks, 1F1B, dataloaders with 2 workers):

* ``ref``: 15 steps (8 batches an epoch), a checkpoint every 5 steps: step-5, step-10, step-15;
* then step-15 gets a flipped byte inside a tensor shard and step-10 a same-size garbage ``.metadata``;
* ``fallback``: ``resume="auto"``, ``keep_last=1``: must skip both and resume from step-5 (5 of the 8
  batches of epoch 0 done), then train the rest of epoch 0 and 2 batches of epoch 1;
* ``fresh``: ``resume=None`` into the same directory: must be refused.

Each test asserts one finding against the uninterrupted run (``ref``), never against copied numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_hpp.checkpoint import list_checkpoints
from lightning_hpp.checkpoint.discovery import CORRUPT_DIR
from tests.ckpt_workers.damage import digest, flip_tensor_byte, garbage_index
from tests.harness.launch import Job, run_job
from tests.harness.results import rank_results

pytestmark = pytest.mark.slow

WORKER = "tests.ckpt_workers.train_worker"


@pytest.fixture(scope="module")
def selection(tmp_path_factory: pytest.TempPathFactory):
    """The 2 plain gloo ranks of the selection test, started (in a thread) before the jobs of :func:`runs`,
    beside the first of them: they share nothing. ``selection()`` waits for them: (their dir, their results)."""
    from concurrent.futures import ThreadPoolExecutor

    out = tmp_path_factory.mktemp("selection")
    (out / "config.json").write_text(json.dumps({"roots": [str(out / "a"), str(out / "b")]}))
    pool = ThreadPoolExecutor(1)
    job = Job(Path(__file__).parent / "ckpt_workers" / "select_worker.py", str(out), ranks=2, start="per_rank",
              script=True, cwd=out, timeout=120)
    future = pool.submit(lambda: (run_job(job), rank_results(out, 2))[1])
    yield lambda: (out, future.result())
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, selection) -> dict:
    out = tmp_path_factory.mktemp("recovery")
    ckpt = out / "ckpt"
    base = {"out": str(out), "steps": 15, "num_workers": 2}
    run_job(Job(WORKER, {**base, "tag": "ref", "dir": str(ckpt), "every": 5}, ranks=2, start="forked"))
    selection()  # done by now (or shortly): its ranks do not run beside the jobs below
    flip_tensor_byte(ckpt / "step-15")
    garbage_index(ckpt / "step-10")
    damaged = {"step-15": digest(ckpt / "step-15"), "step-10": digest(ckpt / "step-10")}
    run_job(Job(WORKER, {**base, "tag": "fallback", "dir": str(ckpt), "every": 5, "resume": "auto", "keep_last": 1},
                ranks=2, start="forked"))
    after_fallback = sorted(p.name for p in ckpt.iterdir())
    fresh = run_job(Job(WORKER, {**base, "tag": "fresh", "dir": str(ckpt), "every": 5}, ranks=2, start="forked"),
                    check=False)
    return {"out": out, "ckpt": ckpt, "damaged": damaged, "after_fallback": after_fallback, "fresh": fresh}


def _load(out: Path, tag: str, rank: int) -> dict:
    return torch.load(out / f"{tag}_rank{rank}.pt", weights_only=False)


def _assert_same_training(out: Path, tag: str, first_step: int) -> None:
    for rank in (0, 1):
        ref, got = _load(out, "ref", rank), _load(out, tag, rank)
        assert got["global_step"] == ref["global_step"] == 15
        expected = {s: v for s, v in ref["seen"].items() if s >= first_step}
        assert got["seen"] == expected, f"rank {rank}: batches trained after the resume differ from the full run"
        for name, value in ref["state"].items():
            assert torch.equal(got["state"][name], value), f"rank {rank}: {name} differs from the full run"


def test_mid_epoch_resume_with_dataloader_workers_trains_each_batch_once(runs: dict) -> None:
    # the loader's workers prefetch at iterator creation: the resumed run must still train batches 6..8 of
    # epoch 0, then epoch 1 from its first batch, in the order the uninterrupted run did
    seen = _load(runs["out"], "fallback", 0)["seen"]
    assert sorted(seen) == list(range(6, 16))
    _assert_same_training(runs["out"], "fallback", first_step=6)


def test_flipped_tensor_byte_and_garbage_index_fall_back_to_the_valid_checkpoint(runs: dict) -> None:
    out, ckpt = runs["out"], runs["ckpt"]
    for rank in (0, 1):
        assert _load(out, "fallback", rank)["resumed_from"] == str(ckpt / "step-5")
    _assert_same_training(out, "fallback", first_step=6)
    lines = _load(out, "fallback", 0)["warnings"]
    skipped = [line for line in lines if line.startswith("Skipping checkpoint")]
    assert len(skipped) == 2, lines  # one line per damaged checkpoint, said once (by rank 0)
    assert f"'{ckpt / 'step-15'}'" in skipped[0] and "__" in skipped[0] and "sha256" in skipped[0]
    assert f"'{ckpt / 'step-10'}'" in skipped[1] and "'.metadata' fails its sha256" in skipped[1]
    assert "Falling back to" in skipped[1] and f"'{ckpt / 'step-5'}'" in skipped[1]
    assert not _load(out, "fallback", 1)["warnings"]


def test_damaged_checkpoints_are_kept_aside_not_deleted_by_retention(runs: dict) -> None:
    ckpt = runs["ckpt"]
    # keep_last=1 deleted the run's own step-10 but kept step-5 (resumed from) and the newest, step-15
    assert [c.step for c in list_checkpoints(str(ckpt))] == [5, 15]
    assert runs["after_fallback"] == [CORRUPT_DIR, "step-15", "step-5"]
    for name, files in runs["damaged"].items():
        assert digest(ckpt / CORRUPT_DIR / name) == files, f"{name}: the damaged files were not kept byte for byte"


def test_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(runs: dict) -> None:
    fresh = runs["fresh"]
    assert fresh.returncode != 0
    text = fresh.stdout + fresh.stderr
    assert "holds 2 checkpoint(s) of another run" in text and "new_run=True" in text, text[-3000:]
    assert sorted(p.name for p in runs["ckpt"].iterdir()) == runs["after_fallback"]  # nothing written


def test_ranks_follow_rank_0s_choice_and_fall_back_together_on_damage_one_rank_found(selection) -> None:
    """Rank 1 sees another directory (a different listing) and alone hashes the damaged file."""
    tmp_path, results = selection()
    a = tmp_path / "a"
    for r in results:
        assert r["chosen"] == str(a / "step-2"), r
        assert r["values_ok"], r
    assert (a / CORRUPT_DIR / "step-3").is_dir() and not (a / "step-3").exists()
    line = next(w for w in results[0]["warnings"] if w.startswith("Skipping checkpoint"))
    # rank 0 never hashed rank 1's shard (it would have reported the damage itself, first)
    assert "(found by rank 1)" in line and "'__1_0.distcp' fails its sha256" in line, line
    assert not results[1]["warnings"]
    assert (tmp_path / "b" / "step-9").is_dir()  # rank 1's own listing was not used
