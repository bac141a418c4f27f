"""What one rank records of a run, for :mod:`lightning_hpp.check` to compare with one process.

:class:`CheckRecorder` is an ordinary Lightning callback: added to any Trainer (``Trainer(callbacks=[...])``, or
``--trainer.callbacks+=lightning_hpp.check.CheckRecorder`` on a LightningCLI command line) it records, on its rank,
every hook the module, the data module and the callbacks receive (:mod:`.hooks`), per training batch the loss
``on_train_batch_end`` is handed and the Trainer's metrics, per validation its metrics, and at the end the
parameters the rank holds and (global rank zero, where loggers write) the files the run wrote; ``teardown`` saves it
to ``<out>/rank<global rank>.pt``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from lightning_hpp.check.hooks import HookLog, callback_hooks, datamodule_hooks, describe, module_hooks, record_hooks

OWN_FILES = ("stage_plan.json", "fingerprints.json", "bias_audit.json")
"""Files HPPStrategy writes beside a run's own (the resolved plan, the coded-bias reports): not compared."""


def floats(metrics: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float, torch.Tensor)) and torch.as_tensor(v).numel() == 1
    }


class CheckRecorder(Callback):
    """Records this rank's view of a run (see the module docstring).

    Args:
        out: The directory the record is saved in (one file per rank).
        root: The directory whose files the run writes (default: the working directory).
    """

    def __init__(self, out: str, root: str | None = None) -> None:
        self.out = out
        self.root = root
        self.hooks = HookLog()
        self.steps: list[dict] = []
        self.validations: list[dict] = []
        self._wrapped: set[int] = set()
        record_hooks(self, "callback", [h for h in callback_hooks() if h not in ("setup", "teardown")], self.hooks)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for obj, owner, names in (
            (pl_module, "module", module_hooks()),
            (trainer.datamodule, "datamodule", datamodule_hooks()),
        ):
            if obj is not None and id(obj) not in self._wrapped:
                record_hooks(obj, owner, names, self.hooks)
                self._wrapped.add(id(obj))
        self.hooks.append(("callback", "setup", {"stage": stage}, 0))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "batch_idx": batch_idx,
                "loss": None if loss is None else float(loss),
                "outputs": describe(outputs),
                "callback": floats(trainer.callback_metrics),
            }
        )

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.validations.append({"global_step": trainer.global_step, "callback": floats(trainer.callback_metrics)})

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.hooks.append(("callback", "teardown", {"stage": stage}, 0))
        record = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "callback": floats(trainer.callback_metrics),
            "logged": floats(trainer.logged_metrics),
            "progress": floats(trainer.progress_bar_metrics),
            "hooks": list(self.hooks),
            "steps": self.steps,
            "validations": self.validations,
            "state": {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()},
            # loggers write on global rank zero, whose teardown reads the files at the point one process does
            "files": written_files(Path(self.root or os.getcwd())) if trainer.is_global_zero else None,
        }
        Path(self.out).mkdir(parents=True, exist_ok=True)
        torch.save(record, Path(self.out) / f"rank{trainer.global_rank}.pt")


def written_files(root: Path) -> dict[str, Any]:
    """What a run wrote under ``root``, by relative path: a CSV file's rows, any other file or a checkpoint (a
    ``.ckpt`` file, or directory under HPPStrategy) by its presence; HPPStrategy's own reports left out."""
    import csv

    found: dict[str, Any] = {}
    if not root.is_dir():
        return found
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.endswith(".ckpt") for part in rel.parts[:-1]) or path.name in OWN_FILES or path.suffix == ".pt":
            continue
        if path.suffix == ".csv":
            with open(path) as f:
                found[str(rel)] = [{k: _number(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
        elif path.is_file() or path.suffix == ".ckpt":
            found[str(rel)] = "present"
    return found


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text
