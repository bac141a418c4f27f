"""examples/hf_causal_lm end to end: a transformers Llama in 2 stages (bf16-mixed -> fp32), traced frontend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.launch import ROOT, Job, run_job

pytestmark = pytest.mark.slow

STEPS = 40


def test_hf_causal_lm_example_trains_on_the_traced_frontend(tmp_path):
    proc = run_job(Job("examples/hf_causal_lm/train.py", ["--steps", str(STEPS), "--out", str(tmp_path)], ranks=2,
                       script=True, env={"PYTHONHASHSEED": "0"}, timeout=300), check=False)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert f"{ROOT}/lightning_hpp/" not in proc.stderr, proc.stderr[-6000:]  # no warnings of the package's own
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["frontend"] == "traced"
    assert report["cut_points"] == ["model.model.layers.2"]
    assert report["precisions"] == ["bf16-mixed", "32-true"]
    assert report["steps"] == STEPS
    assert report["loss_end"] < 0.7 * report["loss_start"], report  # the counting pattern is being learnt
    plan = json.loads(Path(report["stage_plan"]).read_text())
    assert plan["meta"]["frontend"] == "traced"
