"""The trial side of a study: report the monitored metric at every validation, stop every rank on a prune.

A sweep driver (:mod:`lightning_hpp.hydra.study`) starts every trial as a fresh multi-process run and
hands it its study trial in the environment variable :data:`TRIAL_ENV` (a :class:`TrialLink` as JSON;
the storage URL may hold a password, so it travels in the environment, never in a config or a log).
When that variable is set, :func:`lightning_hpp.hydra.train.build` adds a :class:`StudyReporter`:

* global rank 0 connects to the study, reports ``monitor`` at each validation (step: the optimizer
  step, i.e. the batches trained so far, like Determined's budget in batches) and asks the study's
  pruner whether to stop;
* the decision is broadcast from rank 0, so every rank sets ``trainer.should_stop`` at the same
  validation and leaves ``fit`` together;
* the result (pruned or not, where, the reported curve) goes to ``result.json`` for the driver.

:func:`follow_driver` makes every process of a trial die with the process that started it, so a
driver killed with SIGKILL (or a rank 0 killed that way) leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_hpp.errors import SweepError, TrainConfigError

log = logging.getLogger(__name__)

TRIAL_ENV = "HPP_STUDY_TRIAL"
"""The environment variable through which the sweep driver hands a trial to its processes."""

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class TrialLink:
    """Which study trial a run is, and how to reach the study."""

    storage: str
    """The study's SQLAlchemy URL (``sqlite:///...``, ``postgresql://...``)."""
    study_name: str
    trial_id: int
    """The trial's id in the storage (unique across studies)."""
    number: int
    """The trial's number in its study."""
    pruner: dict[str, Any] | None = None
    """The pruner as a ``_target_`` config; None: report only, never prune."""
    driver_pid: int | None = None
    """The sweep driver's pid: the parent of the trial's rank 0."""

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TrialLink | None:
        """The link in :data:`TRIAL_ENV`, or None when this run is not a study trial.

        Raises:
            SweepError: the variable is set but is not a link.
        """
        text = environ.get(TRIAL_ENV)
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as err:
            raise SweepError(
                f"`{TRIAL_ENV}` is set but is not a study trial ({err}); it is set by the sweep driver "
                f"(`hparams_search=asha`) for its trials only. Unset it to run on its own."
            ) from None


def follow_driver(link: TrialLink | None) -> None:
    """Make this process of a trial die (SIGKILL) when the process that started it dies.

    Rank 0 of a trial is started by the sweep driver, ranks 1.. by rank 0 (Lightning's launcher); each
    rank asks the kernel for a SIGKILL when its parent exits, so killing the driver ends the whole trial.
    Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere a no-op.
    """
    if link is None or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        log.warning("prctl(PR_SET_PDEATHSIG) is unavailable; this trial outlives its sweep driver.")
        return
    rank_zero = all(int(os.environ.get(v, "0") or 0) == 0 for v in ("RANK", "LOCAL_RANK", "NODE_RANK"))
    expected = link.driver_pid if rank_zero and link.driver_pid else parent
    if os.getppid() != expected:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def build_pruner(config: Mapping[str, Any] | None) -> Any:
    """Instantiate a pruner config (``None``: Optuna's ``NopPruner``)."""
    import hydra
    import optuna

    if config is None:
        return optuna.pruners.NopPruner()
    pruner = hydra.utils.instantiate(dict(config))
    if not isinstance(pruner, optuna.pruners.BasePruner):
        raise SweepError(
            f"`hydra.sweeper.pruner` built {type(pruner).__name__} ({config!r}); it must build an Optuna pruner, "
            f"e.g. `_target_: optuna.pruners.SuccessiveHalvingPruner`, or be null (no pruning)."
        )
    return pruner


class StudyReporter(Callback):
    """Lightning callback of a study trial: rank 0 reports ``monitor``, a prune stops every rank.

    Args:
        link: The study trial this run is.
        monitor: The metric reported at every validation (the sweep's ``optimized_metric``).
    """

    def __init__(self, link: TrialLink, monitor: str) -> None:
        self.link = link
        self.monitor = monitor
        self.curve: list[tuple[int, float]] = []
        self.pruned_at_step: int | None = None
        self.start_step: int | None = None
        self._trial: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        error = None
        if trainer.is_global_zero:
            try:
                self._trial = self._connect()
            except Exception as err:  # noqa: BLE001 - every rank must learn of it, or ranks 1.. wait in a collective
                error = f"{type(err).__name__}: {err}"
        error = trainer.strategy.broadcast(error, src=0)
        if error is not None:
            raise SweepError(
                f"Trial {self.link.number} of study {self.link.study_name!r} could not reach its study: {error}. "
                f"Check that the storage the sweep was started with (`hydra.sweeper.storage`) is reachable from "
                f"this machine."
            )

    def _connect(self) -> Any:
        import optuna

        from lightning_hpp.hydra.storage import open_storage

        storage = open_storage(self.link.storage)
        study = optuna.load_study(
            study_name=self.link.study_name,
            storage=storage,
            pruner=build_pruner(self.link.pruner),
            sampler=optuna.samplers.RandomSampler(),  # nothing is sampled here; it keeps Trial() cheap
        )
        return optuna.trial.Trial(study, self.link.trial_id)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start_step = int(trainer.global_step)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        decision: tuple[str, str | None] | None = None
        if trainer.is_global_zero:
            decision = self._report(trainer)
        kind, message = trainer.strategy.broadcast(decision, src=0)
        if kind == "error":
            raise TrainConfigError(message)
        if kind == "prune":
            self.pruned_at_step = int(trainer.global_step)
            trainer.should_stop = True

    def _report(self, trainer: Any) -> tuple[str, str | None]:
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return "error", (
                f"The sweep reports `optimized_metric={self.monitor!r}` at every validation, but the model did "
                f"not log it (logged: {sorted(trainer.callback_metrics)}). Set `monitor=` to a metric that "
                f"`validation_step` logs."
            )
        value, step = float(value), int(trainer.global_step)
        self._trial.report(value if math.isfinite(value) else math.nan, step)
        self.curve.append((step, value))
        if self._trial.should_prune():
            log.info("trial %d pruned at step %d (%s=%.6g)", self.link.number, step, self.monitor, value)
            return "prune", None
        return "go", None

    def state(self) -> dict[str, Any]:
        """What ``result.json`` records about the trial's reports."""
        return {
            "trial_number": self.link.number,
            "pruned": self.pruned_at_step is not None,
            "pruned_at_step": self.pruned_at_step,
            "start_step": self.start_step,
            "curve": [list(p) for p in self.curve],
        }
