"""A mixed A100 + H100 cluster simulated on CPU ranks: fp8 verdicts, process groups, entry points, setup memory.

One 2-rank job (tests/workers/run_cluster.py) meets every case in turn: rank 0 an "a100" without Transformer
Engine, rank 1 an "h100" with it or without (``HPP_SIMULATED_DEVICES``), each running its real setup path.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from tests.harness.launch import Job, run_job
from tests.harness.results import load_rank, merged_state
from tests.reference import train_reference
from tests.workers import refusals
from tests.workers.run_cluster import BUCKET, TIMEOUT_S

pytestmark = pytest.mark.slow

CASES = ["fp8_te_simulated", "fp8_emulated", "fp8_no_te", "fp8_te_recompute", "fit_then_test", "setup_bytes"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    out = tmp_path_factory.mktemp("cluster")
    proc = run_job(Job("tests.workers.run_cluster", {"out": str(out), "cases": CASES}, ranks=2, timeout=600),
                   check=False)
    # two cases are refused at setup (exit status 1); a rank left waiting would have stopped the job (status 3)
    assert proc.returncode in (0, 1), proc.stderr[-6000:]
    return out


def _records(out, case: str) -> list[dict]:
    return refusals.read(out / case, 2)


def test_fp8_stage_on_the_h100_rank_sets_up_and_trains_with_the_a100_rank_beside_it(cluster):
    # today's verdict was each rank's own device for every stage: the a100 rank refused the h100's fp8 stage
    for record in _records(cluster, "fp8_te_simulated"):
        assert record["error"] is None, record
    for rank in (0, 1):
        meta = load_rank(cluster / "fp8_te_simulated", rank)["plan_meta"]
        assert meta["device_kinds"] == ["a100", "h100"]
        assert meta["precision"] == ["32-true", "fp8 (Transformer Engine, simulated: quantize-dequantize on cpu; "
                                                "not fp8 speed)"], meta
    # the stand-in for Transformer Engine is the emulation: the same numbers, bit for bit, as fp8_backend='emulate'
    got = merged_state(cluster / "fp8_te_simulated", [0, 1])
    emulated = merged_state(cluster / "fp8_emulated", [0, 1])
    for name, value in emulated.items():
        assert torch.equal(got[name], value), name
    # and fp8 was really applied: close to fp32 training, not equal to it
    reference, _ = train_reference(steps=4, batch=16)
    diff = max(float((got[k] - v).abs().max()) for k, v in reference.state_dict().items())
    assert 0 < diff < 1e-2, diff


@pytest.mark.parametrize("case, message", [
    ("fp8_no_te", "FP8Error: Stage 1 has precision 'fp8' but runs on device 'cpu' (device kind 'h100', rank 1: "
                  "simulated h100, compute capability 9.0), which cannot run fp8: transformer_engine is not installed"),
    ("fp8_te_recompute", "FP8Error: Stage 1 runs Transformer Engine (fp8) with activation checkpointing; its recompute "
                         "would advance TE's fp8 scaling state a second time"),
])
def test_fp8_refusals_are_the_same_on_every_rank_at_setup(cluster, case, message):
    records = _records(cluster, case)
    errors = {r["error"] for r in records}
    assert len(errors) == 1, records  # the a100 rank, which does not hold stage 1, says the same
    (error,) = errors
    assert error.startswith(f"lightning_hpp.errors.{message}"), error
    assert "fp8_backend='emulate'" in error
    for r in records:  # at setup, not at the first training forward on the stage's rank
        assert r["global_step"] == 0 and r["seconds"] < refusals.BOUND_S, r


def test_every_process_group_takes_the_strategy_timeout(cluster):
    # the mesh's dimensions, the flattened dp group, the step group, the async-save group: none keeps torch's
    # 30-minute default
    for rank in (0, 1):
        out = load_rank(cluster / "setup_bytes", rank)
        assert out["timeouts"] == [str(timedelta(seconds=TIMEOUT_S))], out["timeouts"]
        assert out["groups"] >= 5, out["groups"]


def test_the_stages_are_placed_on_the_device_at_every_entry_point(cluster):
    for record in _records(cluster, "fit_then_test"):
        assert record["error"] is None, record
    for rank in (0, 1):
        out = load_rank(cluster / "fit_then_test", rank)
        root = out["root_device"]
        assert out["devices_at"] == {"fit": [root], "test": [root]}, out["devices_at"]
        # after fit's teardown (Lightning's moves the module to the CPU), test's setup placed it again
        assert ("test", root) in out["moves"], out["moves"]


def test_setup_holds_one_broadcast_bucket_on_the_device_at_a_time(cluster):
    for rank in (0, 1):
        out = load_rank(cluster / "setup_bytes", rank)
        assert out["largest_tensor"] <= BUCKET < out["model_bytes"] / 3, out
        assert out["staged_total"] == out["model_bytes"], out  # every tensor crossed the device once
        # one bucket staged at a time (the whole model at once before); the collective's work object may still
        # hold the previous bucket for a moment while the next is staged (gloo's worker thread frees it)
        assert out["staged_peak"] <= 2 * BUCKET < out["model_bytes"], out
