"""``lightning-hpp-check`` on a user's module: "equal" where HPPStrategy keeps Lightning's behaviour (the LightningCLI
example, as its users run it), and every planted difference found on the ranks it is on (tests/check_targets.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_hpp.check import Target, check
from lightning_hpp.check.cli import main
from tests.harness.launch import ROOT

pytestmark = pytest.mark.slow


def test_the_lightning_cli_example_is_equal_to_ddp_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    report = check(Target(script="examples/cli/train.py", config=("examples/cli/config.yaml",)), layouts=("pp2",),
                   steps=3, out=str(tmp_path))
    assert report.equal, report.text
    assert report.text == "pp2: equal to the reference on every rank"


def test_planted_differences_are_found_on_the_ranks_they_are_on(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    target = Target(model="tests.check_targets:Planted", data="tests.check_targets:data",
                    trainer={"max_epochs": 1, "logger": False}, strategy={"n_microbatches": 2})
    report = check(target, layouts=("pp2dp2",), steps=4, out=str(tmp_path))
    assert not report.equal
    found = set(report.found["pp2dp2"])
    # the last stage's ranks (2, 3) log what the first stage's (0, 1) do not: the hook's effect reached them only
    for rank in range(4):
        missing = any(w == f"pp2dp2 rank {rank}" and what == "callback_metrics" and "'last_layer_norm'" in how
                      and "keys ['seen'," in how for w, what, how in found)
        assert missing == (rank in (0, 1)), report.text
    # the dropped key, in what on_train_batch_end is handed, on every rank
    for rank in range(4):
        dropped = (f"pp2dp2 rank {rank}", "training batches[0]['outputs']", "keys ['loss'] (reference ['acc', 'loss'])")
        assert dropped in found, report.text
        assert any(w == f"pp2dp2 rank {rank}" and what == "hook calls" and "on_train_batch_end(outputs)" in how
                   for w, what, how in found), report.text
    # nothing else differs: every other difference is one of the two planted ones
    assert all("['loss'] (reference ['acc', 'loss'])" in how or "last_layer_norm" in how for _, _,
               how in found), report.text


def test_bad_inputs_are_refused_with_the_fix(capsys):
    assert main(["--layouts", "pp9", "module", "tests.check_targets:Same"]) == 2
    assert "unknown layout(s) ['pp9']" in capsys.readouterr().err
    assert main(["module", "tests.check_targets"]) == 2
    assert "name the object as 'package.module:name'" in capsys.readouterr().err


def test_the_command_is_installed():
    out = subprocess.run([sys.executable, "-m", "lightning_hpp.check.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "lightning-hpp-check" in out.stdout
