"""What the conformance scenarios run on: the layouts, one context per scenario and layout, and what
every rank records.

A scenario is a function of a :class:`Ctx`; it builds its own model and Trainer(s) through the context,
which gives the same code HPPStrategy and ``devices`` on the pipeline layouts and Lightning's default
strategy on one process (``Trainer(accelerator="cpu", devices=1)``) for the reference, with the data in
the order each of them draws it:

* training: Lightning shuffles a distributed job's training loader with a ``DistributedSampler`` seeded
  with ``PL_GLOBAL_SEED`` (0), even one built with ``shuffle=False``; HPPStrategy shards it over the
  dp replicas only. The replicas' loaders have batch ``GLOBAL_BATCH // dp``, and the union of one
  step's replica batches is the next batch of ``DistributedSampler(num_replicas=1, rank=0,
  shuffle=True, seed=0)`` with batch ``GLOBAL_BATCH``, what the reference reads. Replica ``r``'s batch
  is the reference batch's rows ``r::dp``.
* validation / test: Lightning gives the loader a non-shuffling ``DistributedSampler`` over the dp
  replicas (replica ``r`` reads samples ``r::dp``), batch ``GLOBAL_BATCH // dp``: the union of the
  replicas' batch ``k`` is the reference's batch ``k`` (batch ``GLOBAL_BATCH``, in order), again rows
  ``r::dp`` of it for replica ``r``.
* predict: Lightning's ``UnrepeatedDistributedSamplerWrapper`` over the replicas (no padding): replica
  ``r`` predicts samples ``r::dp`` in order (:func:`replica_loader` builds that in the reference).

Every rank records (:func:`snapshot`) the Trainer's ``callback_metrics`` / ``logged_metrics`` /
``progress_bar_metrics``, ``global_step``, ``current_epoch``, its module's state (a pipeline rank holds
only its stages), learning rates, what the :class:`MemoryLogger` received and, per step and per
validation, what :class:`Recorder` saw.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, DistributedSampler, Subset

from tests.harness.zoo import make_dataset

GLOBAL_BATCH = 8
TRAIN_SIZE = 96
EVAL_SIZE = 48
STAGES = (["layers.0-1"], ["layers.2-4"])
"""The pp=2 cut of :class:`tests.conformance.scenarios.Net`: ``Linear(8, 16), Tanh`` |
``Linear(16, 16), Tanh, Linear(16, 4)``."""


@dataclass(frozen=True)
class Layout:
    name: str
    devices: int
    pp: int
    dp: int
    hpp: bool


REF = Layout("ref", devices=1, pp=1, dp=1, hpp=False)
PP2 = Layout("pp2", devices=2, pp=2, dp=1, hpp=True)
PP2DP2 = Layout("pp2dp2", devices=4, pp=2, dp=2, hpp=True)
SINGLE = Layout("single", devices=1, pp=1, dp=1, hpp=True)  # HPPStrategy() on one process, no plan
LAYOUTS = {layout.name: layout for layout in (REF, PP2, PP2DP2, SINGLE)}
PIPELINES = ("pp2", "pp2dp2")


def rank() -> int:
    """This process's global rank (one node: Lightning sets ``LOCAL_RANK`` in the processes it starts)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def replica_of(layout: Layout, global_rank: int) -> int:
    """The data-parallel replica of a rank: ranks are laid out pipeline-outer, ``rank = position × dp + replica``."""
    return global_rank % layout.dp


# ---------------------------------------------------------------------------------------------- recording
def floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def learning_rates(trainer: L.Trainer) -> list[float]:
    return [float(g["lr"]) for opt in trainer.optimizers for g in opt.param_groups]


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call, on every rank (no ``rank_zero_only``: each rank's view is compared)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.records.append((step, floats(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Recorder(Callback):
    """Per training batch: the step's loss (what ``on_train_batch_end`` is handed), ``callback_metrics`` and the
    learning rates; per validation run: ``callback_metrics`` once its epoch-end hooks have logged; per epoch: the LRs;
    the global step training started from."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        self.steps: list[dict] = []
        self.validations: list[dict] = []
        self.epochs: list[dict] = []

    def on_train_start(self, trainer, pl_module):  # after a checkpoint was restored: the step a resumed fit starts from
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.steps.append({"global_step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                           "loss": float(loss), "callback": floats(trainer.callback_metrics),
                           "lr": learning_rates(trainer)})

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations.append({"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                                     "fn": str(trainer.state.fn.value), "callback": floats(trainer.callback_metrics)})

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append({"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                            "lr": learning_rates(trainer)})


def _callback(trainer: L.Trainer, kind: type) -> Any:
    return next((cb for cb in trainer.callbacks if isinstance(cb, kind)), None)


def snapshot(trainer: L.Trainer, model: L.LightningModule, **extra: Any) -> dict[str, Any]:
    """What this rank's Trainer and module hold now (module state: this rank's stages only under a pipeline)."""
    rec = _callback(trainer, Recorder)
    logger = trainer.logger if isinstance(trainer.logger, MemoryLogger) else None
    out = {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "should_stop": trainer.should_stop,
        "callback": floats(trainer.callback_metrics),
        "logged": floats(trainer.logged_metrics),
        "progress": floats(trainer.progress_bar_metrics),
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "lr": learning_rates(trainer),
        "start_step": rec.start_step if rec else None,
        "steps": rec.steps if rec else [],
        "validations": rec.validations if rec else [],
        "epochs": rec.epochs if rec else [],
        "logger": logger.records if logger else [],
    }
    out.update(extra)
    return out


def checkpoint_state(cb: ModelCheckpoint) -> dict[str, Any]:
    """A ModelCheckpoint's decisions, with file names instead of paths (each layout writes its own directory)."""

    def name(path: str) -> str:
        return os.path.basename(str(path).rstrip("/")) if path else ""

    score = cb.best_model_score
    return {
        "best_model_score": None if score is None else float(score),
        "best_model_path": name(cb.best_model_path),
        "best_k_models": {name(k): float(v) for k, v in cb.best_k_models.items()},
        "kth_value": float(cb.kth_value),
        "last_model_path": name(cb.last_model_path),
        "files": sorted(os.listdir(cb.dirpath)) if cb.dirpath and os.path.isdir(cb.dirpath) else [],
    }


# ---------------------------------------------------------------------------------------------- context
@dataclass
class Ctx:
    """One scenario on one layout: its directory, and the Trainer, strategy and loaders of that layout."""

    layout: Layout
    out: Path

    @property
    def hpp(self) -> bool:
        return self.layout.hpp

    @property
    def dp(self) -> int:
        return self.layout.dp

    def path(self, name: str) -> str:
        """A path inside this scenario's directory of this layout (the same on every rank of the job)."""
        return str(self.out / name)

    def strategy(self, **kwargs: Any) -> Any:
        """HPPStrategy over :data:`STAGES` (1F1B, 2 micro-batches) on the pipeline layouts; with no plan on
        ``single``."""
        from lightning_hpp import HPPStrategy, StagePlan, StageSpec

        if self.layout.pp == 1:
            return HPPStrategy(**{"timeout": 60, **kwargs})
        base = {"plan": StagePlan([StageSpec(modules=m) for m in STAGES]), "schedule": "1f1b", "n_microbatches": 2,
                "pp_degree": self.layout.pp, "timeout": 60}
        return HPPStrategy(**{**base, **kwargs})

    def trainer(self, *, callbacks: tuple | list = (), strategy: Any = None, **kwargs: Any) -> L.Trainer:
        """A Trainer of this layout with a :class:`Recorder` and a :class:`MemoryLogger` (or the ``logger`` given);
        ``strategy`` only replaces the default HPPStrategy (the reference always runs Lightning's default strategy)."""
        base: dict[str, Any] = {
            "accelerator": "cpu", "devices": self.layout.devices, "max_epochs": 2, "num_sanity_val_steps": 0,
            "log_every_n_steps": 1, "enable_progress_bar": False, "enable_model_summary": False,
            "enable_checkpointing": any(isinstance(cb, ModelCheckpoint) for cb in callbacks),
            "default_root_dir": str(self.out),
        }
        base.update(kwargs)
        if self.hpp:
            base["strategy"] = strategy if strategy is not None else self.strategy()
        logger = base.pop("logger", None) or MemoryLogger()
        return L.Trainer(callbacks=[Recorder(), *callbacks], logger=logger, **base)

    def train_loader(self, n: int = TRAIN_SIZE, drop_last: bool = True, **kwargs: Any) -> DataLoader:
        ds = make_dataset(n)
        if self.hpp:  # Lightning injects the shuffling DistributedSampler, HPPStrategy shards it over dp
            return DataLoader(ds, batch_size=GLOBAL_BATCH // self.dp, drop_last=drop_last, **kwargs)
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=drop_last, **kwargs)

    def eval_loader(self, n: int = EVAL_SIZE, seed: int = 1) -> DataLoader:
        return DataLoader(make_dataset(n, seed=seed), batch_size=GLOBAL_BATCH // self.dp)


def replica_loader(dp: int, replica: int, n: int = EVAL_SIZE, seed: int = 1) -> DataLoader:
    """What replica ``replica`` of ``dp`` predicts (Lightning's unrepeated sampler: samples ``replica::dp``, in
    order)."""
    ds = make_dataset(n, seed=seed)
    return DataLoader(Subset(ds, range(replica, n, dp)), batch_size=GLOBAL_BATCH // dp)


def seeded(cls: type, **kwargs: Any) -> L.LightningModule:
    """``seed_everything(0)`` (also ``PL_GLOBAL_SEED``, the samplers' seed), then the model."""
    L.seed_everything(0, verbose=False)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Scenario:
    name: str
    fn: Callable[[Ctx], dict]
    layouts: tuple[str, ...]
    """The HPPStrategy layouts it runs on (its reference always runs)."""


SCENARIOS: dict[str, Scenario] = {}


def scenario(*layouts: str) -> Callable[[Callable[[Ctx], dict]], Callable[[Ctx], dict]]:
    """Register a scenario for ``layouts`` (default: both pipeline layouts)."""

    def register(fn: Callable[[Ctx], dict]) -> Callable[[Ctx], dict]:
        SCENARIOS[fn.__name__] = Scenario(fn.__name__, fn, layouts or PIPELINES)
        return fn

    return register


def result_path(root: Path, name: str, layout: str, global_rank: int) -> Path:
    return Path(root) / name / layout / f"rank{global_rank}.pt"


def run_layout(layout_name: str, root: Path, only: list[str] | None = None) -> None:
    """Run every scenario of ``layout_name`` one after another (each its own Trainer and model) and save what
    this rank recorded; a scenario that raises records its error and the next one runs."""
    layout = LAYOUTS[layout_name]
    for s in SCENARIOS.values():
        if (only and s.name not in only) or (layout.hpp and layout.name not in s.layouts):
            continue
        ctx = Ctx(layout, Path(root) / s.name / layout.name)
        ctx.out.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        try:
            result = s.fn(ctx)
        except Exception as e:  # noqa: BLE001 - recorded for the test to report, the job goes on
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result["seconds"] = time.monotonic() - start
        torch.save(result, result_path(root, s.name, layout.name, rank()))
