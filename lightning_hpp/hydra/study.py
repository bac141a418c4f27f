"""Study sweeps on an Optuna (>= 4) storage, resumable, with several drivers at once.

:class:`StudySweeper` is the Hydra sweeper behind ``hparams_search=optuna``, ``asha`` and ``hyperband``
(registered as ``hydra/sweeper=lightning_hpp`` by ``hydra_plugins/lightning_hpp_sweeper``). It drives
one Optuna study:

* the study (trials, parameters, intermediate values, states) lives in an SQLite file in the sweep
  directory by default, under any SQLAlchemy URL (a PostgreSQL server for drivers on several
  machines), or in an Optuna journal file (``journal:///path``, a shared file system);
* every trial is one run of :func:`lightning_hpp.hydra.train.launch_trial` (a fresh multi-process
  job); its rank 0 reports to the study at each validation and the study's pruner stops it
  (:mod:`lightning_hpp.hydra.trial`); the driver then records it COMPLETE, PRUNED or FAIL;
* while a trial runs, the driver records its heartbeat. A driver that dies leaves its trial RUNNING
  with a stale heartbeat: the next driver on the study marks it FAIL and retries it once
  (``RetryHeartbeatStaleTrialCallback``) in the same trial directory with ``ckpt_path=last``, so it resumes
  from its checkpoints when it had any; finished and pruned trials are never run again;
* ``n_trials`` is the size of the study (trials of every driver, a retry counting as its original):
  a driver counts the study and asks it for a trial under the study's ask lock
  (:func:`~lightning_hpp.hydra.storage.ask_lock`), so concurrent drivers start exactly ``n_trials``
  configurations, and running the same command again continues the study;
* every trial draws its parameters from a sampler seeded with ``seed + trial number``: trial numbers
  are handed out by the storage, one per trial, so no two drivers share a random stream, and the
  random (start-up) configurations are the same whichever driver draws them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from lightning_hpp.errors import SweepError
from lightning_hpp.hydra.space import search_space, suggest
from lightning_hpp.hydra.storage import ask_lock, check_url, default_url, open_storage, public_url
from lightning_hpp.hydra.trial import TRIAL_ENV, TrialLink, build_pruner
from lightning_hpp.validation import check_int, check_number

log = logging.getLogger(__name__)

STUDY_FILE = "study.json"
"""Written by the driver into the sweep directory: the study's name and (password hidden) storage URL."""
_DIRECTIONS = {"min": "minimize", "minimize": "minimize", "max": "maximize", "maximize": "maximize"}


@dataclass
class StudySweeperConf:
    """``hydra/sweeper=lightning_hpp``: an Optuna study with a pruner, in an RDB storage."""

    _target_: str = "hydra_plugins.lightning_hpp_sweeper.StudySweeper"
    _recursive_: bool = False
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None})
    """An Optuna sampler config. A ``seed`` is offset by the trial's number for each trial, so that every
    trial (of any driver, resumed or not) draws from a stream of its own."""
    pruner: Any = None
    """An Optuna pruner config (``SuccessiveHalvingPruner``, ``HyperbandPruner``...); null: no pruning."""
    direction: str = "minimize"
    """``minimize`` / ``maximize`` (or ``min`` / ``max``, as ``monitor_mode``)."""
    storage: Any = None
    """SQLAlchemy URL of the study database, or ``journal:///abs/path`` (Optuna's JournalStorage on a
    file); null: ``sqlite:///<sweep dir>/study.db``."""
    study_name: str = "lightning_hpp"
    n_trials: int = 20
    """Trials in the study, all drivers together (a retry counts as the trial it retries)."""
    heartbeat_interval: int = 10
    """Seconds between heartbeats of a running trial."""
    grace_period: int | None = None
    """Seconds without a heartbeat after which a running trial is failed (null: 2 x heartbeat_interval)."""
    max_retry: int = 1
    """How often a trial failed by a lost heartbeat (a killed driver or machine) is run again."""
    max_failure_rate: float = 0.5
    """Stop this driver once more than this fraction of its trials failed."""
    params: Any = None
    """The search space in Hydra's sweep grammar (``tag(log, interval(1e-5, 1e-2))``, ``choice(...)``,
    ``range(...)``; :mod:`lightning_hpp.hydra.space`)."""


def configurations(trials: Sequence[Any]) -> set[int]:
    """The distinct configurations of a study: a retry is the trial it retries."""
    return {int(t.system_attrs.get("failed_trial", t.number)) for t in trials}


def stopped_rung(system_attrs: Mapping[str, Any]) -> int | None:
    """The highest rung a trial reached under (successive-halving) pruning, or None."""
    rungs = [int(k.rsplit("_", 1)[1]) for k in system_attrs if k.startswith("completed_rung_")]
    return max(rungs) if rungs else None


class StudySweeper(Sweeper):
    """Hydra sweeper: ask the study for a trial, run it, tell the study, until the study is full.

    Raises:
        SweepError: an option that cannot work (named with its value and the fix), at ``sweep()``.
    """

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    # ------------------------------------------------------------------ options
    def _checked(self) -> dict[str, Any]:
        o = {
            k: (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v)
            for k, v in self.options.items()
        }
        direction = _DIRECTIONS.get(str(o.get("direction")).lower())
        if direction is None:
            raise SweepError(
                f"`hydra.sweeper.direction={o.get('direction')!r}` is not valid; use minimize or maximize "
                f"(min / max, as `monitor_mode`)."
            )
        o["direction"] = direction
        for key, low in (("n_trials", 1), ("heartbeat_interval", 1), ("max_retry", 0)):
            check_int(o.get(key), f"hydra.sweeper.{key}", minimum=low, error=SweepError)
        check_int(o.get("grace_period"), "hydra.sweeper.grace_period", optional=True, error=SweepError,
                  hint="None (null in YAML) takes 2 x heartbeat_interval.")
        check_number(o.get("max_failure_rate"), "hydra.sweeper.max_failure_rate", minimum=0, strict=False, maximum=1,
                     error=SweepError)
        if not o.get("study_name"):
            raise SweepError("`hydra.sweeper.study_name` is empty; name the study (it is how a sweep is resumed).")
        o["storage"] = self._storage_url(o.get("storage"))
        build_pruner(o.get("pruner"))  # a bad pruner fails here, before any trial starts
        return o

    def _storage_url(self, storage: Any) -> str:
        assert self.config is not None
        return default_url(self.config.hydra.sweep.dir) if storage is None else check_url(storage)

    def _sampler(self, config: Any, number: int) -> Any:
        import hydra
        import optuna

        if config is None:
            return optuna.samplers.TPESampler(seed=None)
        config = dict(config)
        if config.get("seed") is not None:
            config["seed"] = int(config["seed"]) + number
        return hydra.utils.instantiate(config)

    # ------------------------------------------------------------------ the loop
    def sweep(self, arguments: list[str]) -> None:
        import optuna

        assert self.config is not None and self.launcher is not None
        o = self._checked()
        params = [f"{k}={v}" for k, v in (o.get("params") or {}).items()]
        space, fixed = search_space(params + list(arguments))
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        # this driver records the heartbeats of the trials it asks for itself (`_heartbeat`)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        storage = open_storage(
            o["storage"],
            heartbeat_interval=o["heartbeat_interval"],
            grace_period=o["grace_period"],
            stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=o["max_retry"]),
        )
        name = o["study_name"]
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # this driver logs each trial itself
        optuna.create_study(storage=storage, study_name=name, direction=o["direction"], load_if_exists=True)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        info = {"study_name": name, "storage": public_url(o["storage"]), "direction": o["direction"]}
        (sweep_dir / STUDY_FILE).write_text(json.dumps(info, indent=2))
        log.info("Study %r in %s: %d trial(s), pruner %s", name, info["storage"], o["n_trials"], o.get("pruner"))

        ran = failed = 0
        while True:
            study = optuna.load_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler())
            optuna.storages.fail_stale_trials(study)
            with ask_lock(storage, o["storage"], name):
                trials = study.get_trials(deepcopy=False)
                waiting = any(t.state == optuna.trial.TrialState.WAITING for t in trials)
                full = not waiting and len(configurations(trials)) >= o["n_trials"]
                # creates the trial (or takes a waiting retry) in the storage: its number is unique in the study
                asked = None if full else study.ask()
            if asked is None:
                running = [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]
                if not running:
                    break
                log.info(
                    "Study %r is full; waiting for running trial(s) %s (or their heartbeat to stop).", name, running
                )
                time.sleep(o["heartbeat_interval"])
                continue
            storage.record_heartbeat(asked._trial_id)
            study.sampler = self._sampler(o.get("sampler"), asked.number)  # this trial's own stream
            trial = optuna.trial.Trial(study, asked._trial_id)
            suggest(trial, space)
            state = self._run(storage, study, trial, fixed, o)
            ran += 1
            failed += state == "FAIL"
            if failed / ran > o["max_failure_rate"]:
                log.error(
                    "%d of the %d trial(s) this driver ran failed (max_failure_rate=%s); stopping. See the "
                    "trial.log files under %s.",
                    failed,
                    ran,
                    o["max_failure_rate"],
                    sweep_dir,
                )
                break
        self._write_results(optuna.load_study(study_name=name, storage=storage), sweep_dir)

    def _run(self, storage: Any, study: Any, trial: Any, fixed: Mapping[str, Any], o: Mapping[str, Any]) -> str:
        """Run one trial and tell the study how it ended; returns the state's name."""
        import optuna
        from optuna.trial import TrialState

        frozen = storage.get_trial(trial._trial_id)
        retry_of = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
        overrides = [f"{k}={v}" for k, v in {**trial.params, **fixed}.items()]
        if retry_of is not None and not any(_key(x) == "ckpt_path" for x in overrides):
            overrides.append("ckpt_path=last")  # its checkpoints, where it had any, are in the same trial dir
        link = TrialLink(o["storage"], study.study_name, trial._trial_id, trial.number, o.get("pruner"), os.getpid())
        log.info(
            "Study trial %d%s: %s", trial.number, f" (retry of {retry_of})" if retry_of is not None else "", overrides
        )
        job_num = trial.number if retry_of is None else retry_of  # a retry runs in its original's directory
        try:
            with _environ(TRIAL_ENV, link.to_env()), _heartbeat(storage, trial._trial_id, o["heartbeat_interval"]):
                job = self.launcher.launch([overrides], initial_job_idx=job_num)[0]
        except Exception:  # a config the trial refuses: FAIL now (an interrupt leaves it RUNNING, to be retried)
            optuna.load_study(study_name=study.study_name, storage=storage).tell(trial.number, state=TrialState.FAIL)
            raise
        run_dir = Path(job.hydra_cfg.hydra.runtime.output_dir)
        record = _read_json(run_dir / "trial.json") or {}
        fresh = optuna.load_study(study_name=study.study_name, storage=storage)
        status, value = record.get("status"), record.get("value")
        if status == "ok" and value is not None:
            fresh.tell(trial.number, values=[float(value)])
        elif status == "pruned":
            fresh.tell(trial.number, state=TrialState.PRUNED)
        else:
            fresh.tell(trial.number, state=TrialState.FAIL)
        done = storage.get_trial(trial._trial_id)
        curve = dict(done.intermediate_values)
        if retry_of is not None:  # the curve before the resume was reported by the failed trial
            before = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(fresh._study_id, retry_of))
            curve = {**before.intermediate_values, **curve}
        record.update(
            trial_number=trial.number,
            retry_of=retry_of,
            state=done.state.name,
            rung=stopped_rung(done.system_attrs),
            curve=sorted([int(s), v] for s, v in curve.items()),
            params=dict(trial.params),
        )
        (run_dir / "trial.json").write_text(json.dumps(record, indent=2))
        return done.state.name

    def _write_results(self, study: Any, sweep_dir: Path) -> None:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        counts = {s.name: sum(t.state == s for t in trials) for s in TrialState}
        result: dict[str, Any] = {"name": "lightning_hpp", "study_name": study.study_name, "states": counts}
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        if done:
            best = study.best_trial
            result.update(best_trial=best.number, best_params=best.params, best_value=best.value)
            log.info("Best trial %d: %s=%s %s", best.number, "value", best.value, best.params)
        OmegaConf.save(OmegaConf.create(result), sweep_dir / "optimization_results.yaml")


def _key(override: str) -> str:
    parsed = OverridesParser.create().parse_override(override)
    return parsed.get_key_element().lstrip("+~")


@contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def _heartbeat(storage: Any, trial_id: int, interval: float) -> Iterator[None]:
    """Record the trial's heartbeat every ``interval`` seconds while the block runs."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            try:
                storage.record_heartbeat(trial_id)
            except Exception as err:  # noqa: BLE001 - a busy database: the next beat tries again
                log.warning("heartbeat of trial id %d not recorded: %s", trial_id, err)

    thread = threading.Thread(target=beat, name="study-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
