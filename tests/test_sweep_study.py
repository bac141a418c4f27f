"""ASHA sweeps on a real study database, for real: one 4-trial sweep of 2-rank HPPStrategy runs whose
driver is killed (SIGKILL) in the middle of a trial and started again with the same command.

The scenario runs once (a module fixture); one test checks the pruning, the other the resume.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from lightning_hpp.hydra.storage import open_storage
from lightning_hpp.hydra.study import configurations
from tests.harness.launch import Job, Running, finish, processes_mentioning, start

N_TRIALS = 4
MAX_STEPS = 6  # validations at steps 2, 4, 6
KILLED = 1  # the trial that is running when the driver is killed
pytestmark = pytest.mark.slow


def _driver(args: list[str], timeout: float, env: dict[str, str] | None = None) -> Job:
    """The sweep's driver, ``python -m lightning_hpp.hydra.train <args>``: a job of its own process group."""
    return Job("lightning_hpp.hydra.train", args, start="plain", env=env or {}, timeout=timeout)


def _command(sweep: Path) -> list[str]:
    return [
        "-m", "hparams_search=asha", "experiment=mlp_sweep",
        f"trainer.max_steps={MAX_STEPS}", "trainer.val_check_interval=2", "strategy.timeout=60",
        f"hydra.sweep.dir={sweep}",
        f"hydra.sweeper.n_trials={N_TRIALS}", "hydra.sweeper.pruner.min_resource=1",
        "hydra.sweeper.heartbeat_interval=1", "hydra.sweeper.grace_period=2",
        # every trial checkpoints every step into its own directory, so a retried trial can resume
        "+strategy.checkpoint.dir=${paths.output_dir}/ckpt", "+strategy.checkpoint.every_n_steps=1",
    ]  # fmt: skip


def _wait_until(condition, timeout: float, what: str, proc: Running | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            done = finish(proc)
            pytest.fail(f"the sweep exited with {done.returncode} before {what}\n{(done.stdout + done.stderr)[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout}s")
        time.sleep(0.05)


def _study(sweep: Path):
    import optuna

    storage = open_storage(f"sqlite:///{sweep / 'study.db'}")
    return optuna.load_study(study_name="mlp_sweep_asha", storage=storage)


def _trials(sweep: Path) -> list:
    return _study(sweep).get_trials()


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Start the sweep, SIGKILL its driver while trial 1 runs, check the trial died with it, run it again."""
    sweep = tmp_path_factory.mktemp("asha") / "study"
    cmd = _command(sweep)
    first = start(_driver(cmd, 600), sweep.parent / "first_logs")
    try:
        # trial 1 has committed its step-1 checkpoint: it is training its second step
        _wait_until(
            lambda: any((sweep / str(KILLED) / "ckpt").glob("*/metadata.json")),
            240,
            "trial 1's first checkpoint",
            first,
        )
        os.kill(first.pid, signal.SIGKILL)  # the driver only: its trial must end by itself
        finish(first, deadline=time.monotonic() + 30)
        _wait_until(
            lambda: not processes_mentioning(str(sweep)), 30, "the end of every process of the killed trial"
        )
    finally:
        first.kill()
    before = {t.number: t.state.name for t in _trials(sweep)}
    done_before = {n: json.loads((sweep / str(n) / "trial.json").read_text()) for n in before if n != KILLED}
    second = finish(start(_driver(cmd, 600), sweep.parent / "second_logs"))
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
    assert all([s for s, _ in r["curve"]] == [s for s in (2, 4, 6) if s > r["study"]["start_step"]]
               for r in completed), [(r["num"], r["study"]["start_step"], r["curve"]) for r in completed]
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
    # the pruned trials are the worse ones: at the rung where each stopped, its value (the one it reported at
    # the step it was pruned) is strictly worse than another trial's at that rung (ASHA keeps the best
    # 1/reduction_factor of the values reported at a rung, and the first trial at a rung always goes on)
    better = (lambda a, b: a < b) if _study(sweep).direction.name == "MINIMIZE" else (lambda a, b: a > b)
    at_rung: dict[int, dict[int, float]] = {}
    for t in study.values():
        for key, value in t.system_attrs.items():
            if key.startswith("completed_rung_"):
                at_rung.setdefault(int(key.removeprefix("completed_rung_")), {})[t.number] = value
    for r in pruned:
        number, rung = r["trial_number"], r["rung"]
        mine = at_rung[rung][number]
        assert mine == study[number].intermediate_values[r["study"]["pruned_at_step"]], (r["num"], at_rung)
        assert any(better(v, mine) for n, v in at_rung[rung].items() if n != number), (r["num"], rung, at_rung)
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


def test_optuna_dashboard_serves_the_study_over_http(killed_and_resumed, tmp_path):
    """The README's one command, ``optuna-dashboard sqlite:///<sweep dir>/study.db``, on the study above:
    its HTTP API on 127.0.0.1 lists the study and every trial with the state the study holds."""
    import urllib.request

    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    sweep = killed_and_resumed[0]
    exe = Path(sys.executable).with_name("optuna-dashboard")
    assert exe.exists(), "optuna-dashboard is installed by scripts/setup.sh (the hydra and dev extras)"
    port = find_free_network_port()
    dashboard = start(Job((str(exe),), [f"sqlite:///{sweep / 'study.db'}", "--host", "127.0.0.1", "--port", str(port)],
                          start="plain", script=True, timeout=120), tmp_path / "dashboard")
    try:
        def get(path: str) -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
                return json.loads(response.read())

        deadline = time.monotonic() + 60
        while True:
            try:
                studies = get("/api/studies")["study_summaries"]
                break
            except OSError:
                if dashboard.poll() is not None or time.monotonic() > deadline:
                    dashboard.kill()
                    done = finish(dashboard)
                    pytest.fail(f"optuna-dashboard did not answer: {(done.stdout + done.stderr)[-3000:]}")
                time.sleep(0.2)
        (study,) = [s for s in studies if s["study_name"] == "mlp_sweep_asha"]
        served = {t["number"]: t for t in get(f"/api/studies/{study['study_id']}")["trials"]}
        held = {t.number: t for t in _trials(sweep)}
        assert {n: t["state"].upper() for n, t in served.items()} == {n: t.state.name for n, t in held.items()}
        assert all(len(served[n]["params"]) == len(t.params) == 2 for n, t in held.items())
    finally:
        dashboard.kill()


def test_search_space_from_hydra_sweep_overrides():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from lightning_hpp.errors import SweepError
    from lightning_hpp.hydra.space import search_space

    space, fixed = search_space([
        "a=tag(log, interval(1e-5, 1e-2))", "b=interval(0.1, 5.0)", "c=int(interval(1, 8))", "d=range(1, 9, 2)",
        "e=range(0.0, 1.0, 0.25)", "f=choice(sgd, adam)", "g=1,2", "h=0.5", "b=0.3",
    ])  # fmt: skip
    assert space == {
        "a": FloatDistribution(1e-5, 1e-2, log=True),
        "c": IntDistribution(1, 8),
        "d": IntDistribution(1, 7, step=2),
        "e": FloatDistribution(0.0, 0.75, step=0.25),
        "f": CategoricalDistribution(["sgd", "adam"]),
        "g": CategoricalDistribution([1, 2]),
    }  # b's range is replaced by the fixed value given after it
    assert fixed == {"h": "0.5", "b": "0.3"}
    with pytest.raises(SweepError, match="increasing ranges only"):
        search_space(["x=range(5, 1, -1)"])


def test_journal_storage_heartbeats_fail_a_stale_trial_and_retry_it_once(tmp_path):
    """``journal:///path``: Optuna's JournalStorage, with the heartbeats Optuna keeps for RDB storages only."""
    import optuna

    from lightning_hpp.hydra.storage import ask_lock

    url = f"journal://{tmp_path / 'study.log'}"
    callback = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)
    storage = open_storage(url, heartbeat_interval=1, grace_period=1, stale_trial_callback=callback)
    study = optuna.create_study(study_name="j", storage=storage)
    with ask_lock(storage, url, "j") as locked:
        assert locked and (tmp_path / "study.log.ask.lock").exists()
        trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    storage.record_heartbeat(trial._trial_id)
    optuna.storages.fail_stale_trials(study)
    assert study.trials[0].state.name == "RUNNING"  # a fresh heartbeat: not stale
    time.sleep(1.5)  # the driver died: no heartbeat for longer than grace_period
    optuna.storages.fail_stale_trials(study)
    # another driver, on the same file, sees the failure and the waiting retry with the same parameters
    other = optuna.load_study(study_name="j", storage=open_storage(url))
    states = [t.state.name for t in other.trials]
    assert states == ["FAIL", "WAITING"] and other.trials[1].params == other.trials[0].params
    assert other.trials[1].system_attrs["failed_trial"] == 0
    retry = study.ask()  # taken by one driver, recorded running: a fresh start is no stale heartbeat
    optuna.storages.fail_stale_trials(study)
    assert retry.number == 1 and [t.state.name for t in other.trials] == ["FAIL", "RUNNING"]


# ------------------------------------------------------------------ two drivers on one PostgreSQL study
PG_SECRET = "hpp-Pg-Secret-8e1f4c2a9d"
PG_TRIALS = 3


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    """A real PostgreSQL server (PyPI's pgserver, installed by scripts/setup.sh) in a temporary directory,
    with a role whose password must leak nowhere. Yields the SQLAlchemy URL."""
    from sqlalchemy.engine import make_url

    try:
        import pgserver
    except ImportError as err:
        pytest.skip(f"pgserver is not installed ({err}); `pip install -e .[dev]` (scripts/setup.sh) installs it")
    try:
        server = pgserver.get_server(tmp_path_factory.mktemp("pg") / "data", cleanup_mode="delete")
        server.psql(f"CREATE ROLE hpp LOGIN CREATEDB PASSWORD '{PG_SECRET}'; CREATE DATABASE hpp OWNER hpp;")
    except Exception as err:  # noqa: BLE001 - whatever keeps the server from starting here
        pytest.skip(f"pgserver's PostgreSQL server could not start on this machine: {type(err).__name__}: {err}")
    host = make_url(server.get_uri()).query["host"]
    yield f"postgresql+psycopg2://hpp:{PG_SECRET}@/hpp?host={host}"
    server.cleanup()


def test_drivers_that_start_at_once_on_a_new_database_all_open_the_study(postgres):
    """Optuna creates its tables when a storage opens: drivers starting together on a new database
    raced to create them, and all but one failed (duplicate key in pg_type). Each of 3 new databases
    is opened by 4 drivers at once (threads released together); every one opens the study."""
    import threading

    import optuna
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    server = create_engine(postgres, isolation_level="AUTOCOMMIT")
    failures: list[BaseException] = []

    def driver(url: str, start: threading.Barrier) -> None:
        start.wait()
        try:
            optuna.create_study(storage=open_storage(url, heartbeat_interval=1), study_name="s", load_if_exists=True)
        except BaseException as err:  # noqa: BLE001 - collected and asserted on below
            failures.append(err)

    for i in range(3):
        with server.connect() as connection:
            connection.execute(text(f"CREATE DATABASE race{i}"))
        url = make_url(postgres).set(database=f"race{i}").render_as_string(hide_password=False)
        start = threading.Barrier(4)
        threads = [threading.Thread(target=driver, args=(url, start)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    server.dispose()
    assert not failures, repr(failures[0])


def _trial_of(driver_pid: int, sweep: Path) -> int | None:
    """The number of the trial directory whose rank 0 the driver ``driver_pid`` started, if any."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != driver_pid:
                continue
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(f"hydra.run.dir={sweep}/"):
                return int(arg.rsplit("/", 1)[1])
    return None


@pytest.fixture(scope="module")
def two_drivers(postgres, tmp_path_factory):
    """Two drivers start the same ASHA command on one PostgreSQL study at once; the first is killed with
    SIGKILL once its trial has a checkpoint; the second finishes the study."""
    root = tmp_path_factory.mktemp("pg_sweep")
    sweep = root / "study"
    cmd = [
        "-m", "hparams_search=asha", "experiment=mlp_sweep",
        # a loaded machine can take minutes to start a rank: the rendezvous waits as long as by default
        "trainer.max_steps=4", "trainer.val_check_interval=2", "strategy.timeout=300", f"hydra.sweep.dir={sweep}",
        f"hydra.sweeper.n_trials={PG_TRIALS}", "hydra.sweeper.pruner.min_resource=1",
        "hydra.sweeper.heartbeat_interval=1", "hydra.sweeper.grace_period=3",
        "hydra.sweeper.storage=${oc.env:HPP_STUDY_STORAGE}",  # the password stays in the environment
        "+strategy.checkpoint.dir=${paths.output_dir}/ckpt", "+strategy.checkpoint.every_n_steps=1",
    ]  # fmt: skip
    drivers = [start(_driver(cmd, 900, {"HPP_STUDY_STORAGE": postgres}), root / f"driver{i}") for i in range(2)]
    victim, survivor = drivers
    try:
        killed: list[int] = []

        def victim_checkpointed() -> bool:
            n = _trial_of(victim.pid, sweep)
            if n is not None and any((sweep / str(n) / "ckpt").glob("*/metadata.json")):
                killed.append(n)
                return True
            return False

        _wait_until(victim_checkpointed, 300, "a checkpoint of the first driver's trial", victim)
        os.kill(victim.pid, signal.SIGKILL)
        ended = [finish(victim, deadline=time.monotonic() + 30)]
        _wait_until(lambda: not processes_mentioning(f"hydra.run.dir={sweep / str(killed[0])}"), 30,
                    "the end of every process of the killed driver's trial")  # fmt: skip
        ended.append(finish(survivor, deadline=time.monotonic() + 600))
    finally:
        for proc in drivers:
            proc.kill()
    for i, done in enumerate(ended):  # each driver's output, as a user redirecting it would keep it
        (root / f"driver{i}.log").write_text(done.stdout + done.stderr)
    return sweep, root, killed[0], ended[1].returncode, postgres


def test_two_drivers_on_postgresql_share_one_study_and_retry_the_killed_drivers_trial(two_drivers):
    import optuna

    from lightning_hpp.hydra.storage import public_url

    sweep, root, killed, returncode, url = two_drivers
    assert returncode == 0, (root / "driver1.log").read_text()[-6000:]
    trials = optuna.load_study(study_name="mlp_sweep_asha", storage=open_storage(url)).get_trials()
    by_number = {t.number: t for t in trials}
    fresh = [t for t in trials if "failed_trial" not in t.system_attrs]
    retries = [t for t in trials if "failed_trial" in t.system_attrs]
    # exactly n_trials configurations, each drawn once, each finished; the killed one failed and was retried once
    assert len(fresh) == PG_TRIALS and len({tuple(sorted(t.params.items())) for t in fresh}) == PG_TRIALS
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in trials) == PG_TRIALS
    assert by_number[killed].state.name == "FAIL" and [t.state.name for t in trials].count("FAIL") == 1
    (retry,) = retries
    assert retry.system_attrs["failed_trial"] == killed and retry.params == by_number[killed].params
    assert retry.state.name in ("COMPLETE", "PRUNED")
    # the retry ran in the killed trial's directory and resumed from its checkpoint
    record = json.loads((sweep / str(killed) / "trial.json").read_text())
    assert record["retry_of"] == killed and "ckpt_path=last" in record["overrides"]
    assert record["study"]["start_step"] >= 1
    log = (sweep / str(killed) / "trial.log").read_text()
    assert f"Restoring states from the checkpoint path at {sweep / str(killed) / 'ckpt'}" in log
    # each trial drew from its own stream, seed + trial number: what a fresh sampler with that seed draws
    for t in fresh:
        alone = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=1234 + t.number, n_startup_trials=10,
                                                                       constant_liar=True)).ask()  # fmt: skip
        drawn = {"model.optimizer.lr": alone.suggest_float("model.optimizer.lr", 1e-5, 1e-2, log=True),
                 "plan.stages.1.clip_norm": alone.suggest_float("plan.stages.1.clip_norm", 0.1, 5.0)}  # fmt: skip
        assert t.params == pytest.approx(drawn), t.number
    # the summary names the storage with its password hidden; the password is in no file the sweep wrote
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["storage"] == public_url(url)
    assert summary["storage"].startswith("postgresql+psycopg2://hpp:***@/hpp?")
    assert summary["study_name"] == "mlp_sweep_asha"
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {"summary.json", "study.json", "trial.log", "config.yaml", "snapshot.json",
            "driver1.log"} <= {p.name for p in files}
    leaks = [str(p) for p in files if PG_SECRET.encode() in p.read_bytes()]
    assert not leaks, f"the database password was written to {leaks}"
    assert processes_mentioning(str(sweep)) == []
