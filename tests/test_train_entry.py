"""The entry point for real: a multi-process run with S3 checkpoints, a 2x2 multirun, an Optuna
search, and the errors it gives for bad input (with a non-zero exit)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from lightning_hpp.checkpoint import export_to_lightning_ckpt
from lightning_hpp.hydra.train import end_process_group, main
from lightning_hpp.hydra.trial_process import group_members
from tests.harness.launch import ROOT, Job, finish, processes_mentioning, start
from tests.harness.zoo import MLP, make_dataset
from tests.s3_server import UNSET_AWS, aws_variables, fresh_bucket

SECRET = "hpp-Entry-Secret-5d2b8e41c7"
pytestmark = pytest.mark.slow


def _start(*args: str, cwd: Path = ROOT, exe: tuple[str, ...] | None = None, env: dict[str, str | None] | None = None,
           logs: Path | None = None):
    """Start the entry point (a job of tests.harness.launch: a session of its own), its output under ``logs``."""
    job = Job(exe or "lightning_hpp.hydra.train", list(args), start="plain", script=exe is not None, cwd=cwd,
              env=env or {}, timeout=600)
    return start(job, logs)


CONSOLE = Path(sys.executable).with_name("lightning-hpp-train")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The runs of the entry point of this module, side by side (they share nothing): a single
    2-rank run checkpointing to S3, the 2x2 multirun, the 2-trial Optuna search, a 2-step run, and (when
    the console script is installed) a sweep whose trial fails. Yields (root dir, {name: finished process}, S3Env)."""
    root = tmp_path_factory.mktemp("entry")
    with fresh_bucket() as s3:
        (root / "single").mkdir()
        single_env = {**aws_variables(s3), "AWS_SECRET_ACCESS_KEY": SECRET, "HPP_S3_BUCKET": s3.bucket}
        for name in UNSET_AWS:
            single_env.pop(name, None)
        started = {
            # moto accepts any key; this one must leak nowhere
            "single": _start("experiment=mlp_tiny", "checkpoint=s3", "strategy.timeout=60",
                             f"hydra.run.dir={root / 'single' / 'run'}",
                             cwd=root / "single", env=single_env, logs=root / "single_log"),
            "sweep": _start("-m", "experiment=mlp_tiny", "model.optimizer.lr=0.05,0.2",
                            "plan.stages.1.clip_norm=0.05,1.0",
                            "strategy.timeout=60", f"hydra.sweep.dir={root / 'sweep'}", logs=root / "sweep_log"),
            "optuna": _start("hparams_search=optuna", "experiment=mlp_tiny", "hydra.sweeper.n_trials=2",
                             "strategy.timeout=60",
                             f"hydra.sweep.dir={root / 'optuna'}", logs=root / "optuna_log"),
            # the quickest run, as a user types it (PYTHONHASHSEED unset): it must end quietly
            "quiet": _start("experiment=mlp_tiny", "trainer.max_steps=2", f"hydra.run.dir={root / 'quiet'}",
                            env={"PYTHONHASHSEED": None}, logs=root / "quiet_log"),
        }
        if CONSOLE.exists():
            started["console"] = _start("-m", "experiment=mlp_tiny", "plan=hybrid", f"hydra.sweep.dir={root / 'bad'}",
                                        exe=(str(CONSOLE),), logs=root / "console_log")
        deadline = time.monotonic() + 600
        yield root, {name: finish(proc, deadline) for name, proc in started.items()}, s3


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def _val_loss_reference(state: dict) -> float:
    """Single-process fp32 validation loss of the tiny MLP with the given weights (2 batches of 16)."""
    model = MLP(seed=0)
    model.load_state_dict(state, strict=True)
    x, y = make_dataset(64, seed=1).tensors
    with torch.no_grad():
        losses = [F.cross_entropy(model(x[i : i + 16]), y[i : i + 16]) for i in (0, 16)]
    return float(torch.stack(losses).mean())


def test_single_run_s3_checkpoint_snapshot_without_secrets(jobs, tmp_path, monkeypatch):
    root, procs, s3_env = jobs
    for name in UNSET_AWS:
        monkeypatch.delenv(name, raising=False)
    for name, value in aws_variables(s3_env).items():
        monkeypatch.setenv(name, value)
    run = root / "single" / "run"
    proc = procs["single"]
    _ok(proc)

    result = json.loads((run / "result.json").read_text())
    assert result["global_step"] == 6 and result["metric"] == "val_loss"
    assert (run / "train_ddp_process_1.log").exists()  # rank 1 was a process of its own

    # The last checkpoint is on S3, sharded by stage; consolidated into one .ckpt, the whole
    # model recomputes in one process the validation loss that the pipeline run reported.
    objects = s3_env.objects()
    assert "checkpoints/run/last.ckpt/metadata.json" in objects, sorted(objects)
    export_to_lightning_ckpt(f"s3://{s3_env.bucket}/checkpoints/run/last.ckpt", str(tmp_path / "last.ckpt"))
    state = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert not torch.equal(state["layers.0.weight"], MLP(seed=0).layers[0].weight)
    assert math.isclose(_val_loss_reference(state), result["value"], rel_tol=1e-5)

    snap = run / "snapshot"
    config = yaml.safe_load((snap / "config.yaml").read_text())
    assert config["checkpoint"]["dirpath"] == f"s3://{s3_env.bucket}/checkpoints/run"
    assert config["model"]["optimizer"]["lr"] == 0.1 and config["trainer"]["devices"] == 2
    plan = json.loads((snap / "stage_plan.json").read_text())
    assert [s["modules"] for s in plan["stages"]] == [[f"layers.{i}" for i in range(4)],
                                                      [f"layers.{i}" for i in range(4, 7)]]
    info = json.loads((snap / "snapshot.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert info["code"]["cwd"]["root"] is None  # tmp_path is not a git tree; the package's is recorded
    assert info["code"]["lightning_hpp"]["commit"] == head
    assert info["overrides"] == ["experiment=mlp_tiny", "checkpoint=s3", "strategy.timeout=60"]
    assert info["fingerprint"]["torch"] == torch.__version__
    assert f"torch=={torch.__version__}" in (snap / "packages.txt").read_text().splitlines()

    files = [p for p in run.rglob("*") if p.is_file()]
    assert {".hydra", "snapshot", "csv"} <= {p.relative_to(run).parts[0] for p in files}
    leaks = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    leaks += [key for key, data in objects.items() if SECRET.encode() in data]
    assert not leaks, f"the secret was written to {leaks}"


def test_sweep_2x2_trials_are_separate_multiprocess_runs(jobs):
    root, procs, _ = jobs
    sweep, proc = root / "sweep", procs["sweep"]
    _ok(proc)
    trials = [json.loads((sweep / str(i) / "trial.json").read_text()) for i in range(4)]
    assert not (sweep / "4").exists()
    assert {tuple(t["overrides"][1:3]) for t in trials} == {
        (f"model.optimizer.lr={lr}",
         f"plan.stages.1.clip_norm={clip}") for lr in ("0.05", "0.2") for clip in ("0.05", "1.0")
    }
    assert all(t["status"] == "ok" and t["returncode"] == 0 and t["leftover_processes"] == 0 for t in trials)
    values = [t["value"] for t in trials]
    assert len(set(values)) == 4 and all(math.isfinite(v) for v in values)
    for i, t in enumerate(trials):
        trial_dir = sweep / str(i)
        assert json.loads((trial_dir / "result.json").read_text())["value"] == t["value"]
        config = yaml.safe_load((trial_dir / "snapshot" / "config.yaml").read_text())
        lr, clip = (float(o.split("=")[1]) for o in t["overrides"][1:3])
        assert config["model"]["optimizer"]["lr"] == lr and config["plan"]["stages"][1]["clip_norm"] == clip
        plan = json.loads((trial_dir / "snapshot" / "stage_plan.json").read_text())
        assert [s["clip_norm"] for s in plan["stages"]] == [None, clip]  # what the strategy was given
        assert (trial_dir / "train_ddp_process_1.log").exists()
        assert json.loads((trial_dir / "csv" / "stage_plan.json").read_text())["meta"]["pp_degree"] == 2
    # one after another, each with its own port; nothing left running or listening
    for a, b in zip(trials, trials[1:]):
        assert a["ended_at"] <= b["started_at"]
    assert len({t["master_port"] for t in trials}) == 4
    assert processes_mentioning(str(sweep)) == []
    for t in trials:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", t["master_port"]))

    md = (sweep / "summary.md").read_text().splitlines()
    rows = [line.split("|") for line in md if line.startswith("| ") and not line.startswith("| rank")]
    assert [int(r[2]) for r in rows] == sorted(range(4), key=lambda i: values[i])
    assert [float(r[6]) for r in rows] == pytest.approx(sorted(values), rel=1e-5)
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert "4/4 trial(s) completed" in proc.stdout


def test_optuna_search_two_trials(jobs):
    root, procs, _ = jobs
    sweep, proc = root / "optuna", procs["optuna"]
    _ok(proc)
    trials = [json.loads((sweep / str(i) / "trial.json").read_text()) for i in range(2)]
    assert not (sweep / "2").exists()
    for i, t in enumerate(trials):
        params = dict(o.split("=", 1) for o in t["overrides"])
        lr, clip = float(params["model.optimizer.lr"]), float(params["plan.stages.1.clip_norm"])
        assert 1e-5 <= lr <= 1e-2 and 0.1 <= clip <= 5.0 and t["status"] == "ok"
        plan = json.loads((sweep / str(i) / "snapshot" / "stage_plan.json").read_text())
        assert plan["stages"][1]["clip_norm"] == pytest.approx(clip) and plan["stages"][0]["clip_norm"] is None
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = min(trials, key=lambda t: t["value"])
    assert results["best_value"] == pytest.approx(best["value"])
    best_lr = float(dict(o.split("=", 1) for o in best["overrides"])["model.optimizer.lr"])
    assert results["best_params"]["model.optimizer.lr"] == pytest.approx(best_lr)
    assert "2/2 trial(s) completed" in (sweep / "summary.md").read_text()


def test_a_finished_run_prints_progress_and_summary_only(jobs):
    """``experiment=mlp_tiny trainer.max_steps=2`` with PYTHONHASHSEED unset: the entry point restarts
    itself with PYTHONHASHSEED=0 (every rank hashes alike, so the bias guards have nothing to note),
    EarlyStopping waits for a validation, no harmless warning is repeated per rank, nothing aborts."""
    root, procs, _ = jobs
    proc = procs["quiet"]
    _ok(proc)
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in proc.stderr
    for noise in ("terminate called", "Error executing job", "BiasGuard note", "pin_memory", "LeafSpec",
                  "Traceback", "Warning"):
        assert noise not in proc.stderr, f"{noise!r} in\n{proc.stderr}"
    assert "WARNING" not in proc.stdout and "ERROR" not in proc.stdout, proc.stdout
    info = json.loads((root / "quiet" / "snapshot" / "snapshot.json").read_text())
    assert info["fingerprint"]["env"]["PYTHONHASHSEED"] == "0"
    assert json.loads((root / "quiet" / "result.json").read_text())["global_step"] == 2


def test_console_script_sweep_whose_trials_all_fail_exits_nonzero(jobs):
    if not CONSOLE.exists():
        pytest.skip("the console script is not installed (pip install -e .)")
    root, procs, _ = jobs
    sweep, proc = root / "bad", procs["console"]
    assert proc.returncode == 1
    trial = json.loads((sweep / "0" / "trial.json").read_text())
    assert trial["status"] == "failed" and trial["returncode"] == 1
    assert trial["error"].startswith("TrainConfigError: The plan `plan=hybrid` does not fit the model `MLP`")
    assert "'encoder' is not a unit of the model" in trial["error"]
    assert "None of the 1 trial(s) completed" in proc.stderr
    assert "| - | 0 | failed |" in (sweep / "summary.md").read_text()
    assert not (sweep / "0" / "snapshot").exists() and not (sweep / "summary.png").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["optimiser=adam"], "Could not override 'optimiser'"),
        (["model=resnet"], "Could not find 'model/resnet'"),
        (["trainer.max_stepz=3"], "Key 'max_stepz' is not in struct"),
        (["experiment=mlp_tiny", "plan=hybrid"], "does not fit the model `MLP`"),
        (["experiment=mlp_tiny", "checkpoint=s3"], "the environment has no S3 credentials"),
    ],
    ids=["unknown-group", "unknown-option", "unknown-key", "plan-mismatch", "s3-no-credentials"],
)
def test_bad_input_exits_nonzero_with_a_clear_error(args, expected, tmp_path, monkeypatch, capfd):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HPP_S3_BUCKET", "bucket")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lightning-hpp-train", *args, f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code not in (0, None)
    err = capfd.readouterr().err
    assert expected in err
    if args[0] == "model=resnet":
        assert "Available options in 'model'" in err and "hybrid_vision" in err
    assert not (tmp_path / "run" / "snapshot").exists()


def test_end_process_group_kills_what_ignores_sigterm():
    proc = subprocess.Popen(["sh", "-c", 'trap "" TERM; sleep 60 & sleep 60 & wait'], start_new_session=True)
    deadline = time.monotonic() + 20
    while len(group_members(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(proc.pid)) == 3
    start = time.monotonic()
    assert end_process_group(proc.pid, wait=0.0, grace=0.5) == 3
    assert time.monotonic() - start >= 0.5  # SIGTERM was ignored, SIGKILL came after the grace period
    assert group_members(proc.pid) == []
    assert proc.wait(timeout=10) == -9
