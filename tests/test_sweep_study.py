"""ASHA sweeps on a real study database, for real: one 4-trial sweep of 2-rank HPPStrategy runs whose
driver is killed (SIGKILL) in the middle of a trial and started again with the same command.

The scenario runs once (a module fixture); one test checks the pruning, the other the resume.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_hpp.hydra.storage import open_storage
from lightning_hpp.hydra.study import configurations
from lightning_hpp.hydra.train import end_process_group
from tests.launch import processes_mentioning

ROOT = Path(__file__).resolve().parents[1]
N_TRIALS = 4
MAX_STEPS = 6  # validations at steps 2, 4, 6
KILLED = 1  # the trial that is running when the driver is killed
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


def _command(sweep: Path) -> list[str]:
    return [
        sys.executable, "-m", "lightning_hpp.hydra.train", "-m", "hparams_search=asha", "experiment=mlp_sweep",
        f"trainer.max_steps={MAX_STEPS}", "trainer.val_check_interval=2", "strategy.timeout=60", f"hydra.sweep.dir={sweep}",
        f"hydra.sweeper.n_trials={N_TRIALS}", "hydra.sweeper.pruner.min_resource=1",
        "hydra.sweeper.heartbeat_interval=1", "hydra.sweeper.grace_period=2",
        # every trial checkpoints every step into its own directory, so a retried trial can resume
        "+strategy.checkpoint.dir=${paths.output_dir}/ckpt", "+strategy.checkpoint.every_n_steps=1",
    ]  # fmt: skip


def _wait_until(condition, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the sweep exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout}s")
        time.sleep(0.05)


def _trials(sweep: Path) -> list:
    import optuna

    storage = open_storage(f"sqlite:///{sweep / 'study.db'}")
    return optuna.load_study(study_name="mlp_sweep_asha", storage=storage).get_trials()


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Start the sweep, SIGKILL its driver while trial 1 runs, check the trial died with it, run it again."""
    sweep = tmp_path_factory.mktemp("asha") / "study"
    cmd = _command(sweep)
    with open(sweep.parent / "first.log", "wb") as log:
        first = subprocess.Popen(
            cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            # trial 1 has committed its step-1 checkpoint: it is training its second step
            _wait_until(
                lambda: any((sweep / str(KILLED) / "ckpt").glob("*/metadata.json")),
                240,
                "trial 1's first checkpoint",
                first,
            )
            os.kill(first.pid, signal.SIGKILL)  # the driver only: its trial must end by itself
            first.wait(timeout=30)
            _wait_until(
                lambda: not processes_mentioning(str(sweep)), 30, "the end of every process of the killed trial"
            )
        finally:
            end_process_group(first.pid, wait=0.0, grace=2.0)
    before = {t.number: t.state.name for t in _trials(sweep)}
    done_before = {n: json.loads((sweep / str(n) / "trial.json").read_text()) for n in before if n != KILLED}
    second = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, f"exit {second.returncode}\n{second.stdout[-3000:]}\n{second.stderr[-6000:]}"
    return sweep, before, done_before, second


def _records(sweep: Path) -> dict[int, dict]:
    return {int(p.parent.name): json.loads(p.read_text()) for p in sweep.glob("*/trial.json")}


def test_asha_prunes_trials_and_every_rank_of_a_pruned_trial_exits(killed_and_resumed):
    sweep, _, _, second = killed_and_resumed
    records = _records(sweep)
    assert sorted(records) == sorted(configurations(_trials(sweep)))  # one directory per configuration
    pruned = [r for r in records.values() if r["status"] == "pruned"]
    completed = [r for r in records.values() if r["status"] == "ok"]
    assert len(pruned) >= N_TRIALS / 3 and completed, {n: r["status"] for n, r in records.items()}
    assert all(r["state"] == "PRUNED" for r in pruned) and all(r["state"] == "COMPLETE" for r in completed)
    # a completed trial reported every validation (steps 2, 4, 6) from the step it started at (the retry resumes
    # from the killed trial's newest checkpoint, at step 1 or later); a pruned one stopped at its rung
    assert all([s for s, _ in r["curve"]] == [s for s in (2, 4, 6) if s > r["study"]["start_step"]] for r in completed), [
        (r["num"], r["study"]["start_step"], r["curve"]) for r in completed]
    for r in pruned:
        steps = [s for s, _ in r["curve"]]
        assert len(steps) < min(len(c["curve"]) for c in completed if c["retry_of"] is None), r
        assert r["study"]["pruned_at_step"] == steps[-1] == r["global_step"] < MAX_STEPS
        assert r["rung"] is not None and r["rung"] >= 0
    # every rank of a pruned trial left fit together and exited on its own; nothing listens on its port
    for r in pruned:
        assert r["returncode"] == 0 and r["leftover_processes"] == 0
        assert (Path(r["run_dir"]) / "train_ddp_process_1.log").exists()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", r["master_port"]))
    assert processes_mentioning(str(sweep)) == []
    # the study agrees with the records: its intermediate values are the curves the trials reported
    study = {t.number: t for t in _trials(sweep)}
    for r in records.values():
        t = study[r["trial_number"]]
        assert t.state.name == r["state"]
        if r["retry_of"] is None:
            assert sorted([s, v] for s, v in t.intermediate_values.items()) == r["curve"]
            assert r["study"]["curve"] == r["curve"]  # what rank 0 reported is what the study holds
    # the summary: study and storage, a learning curve per trial, the rung where each stopped
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["study_name"] == "mlp_sweep_asha" and summary["storage"] == f"sqlite:///{sweep / 'study.db'}"
    rows = {int(row["trial"]): row for row in summary["trials"]}
    assert {n for n, row in rows.items() if row["status"] == "pruned"} == {r["num"] for r in pruned}
    assert all(
        rows[r["num"]]["rung"] == str(r["rung"]) and rows[r["num"]]["validations"] == str(len(r["curve"]))
        for r in pruned
    )
    png = (sweep / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert f"{len(pruned)} pruned" in second.stdout


def test_killed_driver_resumes_the_study_and_holds_each_trial_once(killed_and_resumed):
    sweep, before, done_before, second = killed_and_resumed
    # when the driver was killed, trial 0 had finished and trial 1 was running
    assert before == {0: "COMPLETE", KILLED: "RUNNING"}, before
    trials = _trials(sweep)
    by_number = {t.number: t for t in trials}
    retries = [t for t in trials if "failed_trial" in t.system_attrs]
    # the running trial was failed by its stale heartbeat and retried once, with its parameters
    assert by_number[KILLED].state.name == "FAIL" and len(retries) == 1
    retry = retries[0]
    assert retry.system_attrs["failed_trial"] == KILLED and retry.params == by_number[KILLED].params
    assert retry.state.name in ("COMPLETE", "PRUNED")
    # each configuration once: N_TRIALS distinct parameter sets, no trial run twice
    assert len(trials) == N_TRIALS + 1
    assert len({tuple(sorted(t.params.items())) for t in trials}) == N_TRIALS
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials if t.number != KILLED)
    # finished trials were not run again: their records are untouched
    for n, record in done_before.items():
        assert json.loads((sweep / str(n) / "trial.json").read_text()) == record
    assert (second.stdout + second.stderr).count("Launching 1 jobs locally") == N_TRIALS - 1
    # the retry ran in the killed trial's directory and resumed from its newest checkpoint
    record = json.loads((sweep / str(KILLED) / "trial.json").read_text())
    assert record["trial_number"] == retry.number and record["retry_of"] == KILLED
    assert "ckpt_path=last" in record["overrides"]
    log = (sweep / str(KILLED) / "trial.log").read_text()
    assert f"Restoring states from the checkpoint path at {sweep / str(KILLED) / 'ckpt'}" in log
    assert record["study"]["start_step"] >= 1  # it did not start from step 0
    assert record["global_step"] == (MAX_STEPS if record["status"] == "ok" else record["study"]["pruned_at_step"])


def test_storage_url_password_hidden_and_bad_links_refused(tmp_path):
    from lightning_hpp.errors import SweepError
    from lightning_hpp.hydra.storage import check_url, default_url, public_url
    from lightning_hpp.hydra.trial import TRIAL_ENV, TrialLink

    assert public_url("postgresql://hpp:s3cret@db-host:5432/hpp") == "postgresql://hpp:***@db-host:5432/hpp"
    assert default_url(tmp_path / "sweep") == f"sqlite:///{tmp_path / 'sweep' / 'study.db'}"
    with pytest.raises(SweepError, match=r"`hydra.sweeper.storage='db-host/hpp'` is not an SQLAlchemy URL"):
        check_url("db-host/hpp")
    link = TrialLink("sqlite:///x.db", "s", trial_id=3, number=2, pruner=None, driver_pid=1)
    assert TrialLink.from_env({TRIAL_ENV: link.to_env()}) == link and TrialLink.from_env({}) is None
    with pytest.raises(SweepError, match=f"`{TRIAL_ENV}` is set but is not a study trial"):
        TrialLink.from_env({TRIAL_ENV: '{"storage": 1}'})
