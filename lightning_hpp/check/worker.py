"""One side of a check from factories: ``python -m lightning_hpp.check.worker '<json spec>'``.

Builds the module and the data from their factories (``"pkg.module:name"`` or ``"path/file.py:name"``, called
without arguments, after ``seed_everything(seed)``), a Trainer with the spec's keyword arguments on ``devices``
CPU processes — Lightning's DDP for the reference, HPPStrategy (``pp_degree``, the spec's strategy options) for the
pipeline — with a :class:`~lightning_hpp.check.record.CheckRecorder`, and fits ``steps`` steps. Lightning's
launcher starts the other ranks by running this module again.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L


def load(ref: str) -> Any:
    """The object ``ref`` names: ``"pkg.module:name"`` or ``"path/to/file.py:name"``.

    Raises:
        ValueError: ``ref`` has no ``:name``, or names nothing.
    """
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"{ref!r}: name the object as 'package.module:name' or 'path/to/file.py:name'")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, Path(where).resolve())
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(Path(where).stem, module)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"{ref!r}: {where} has no {name!r}")
    return getattr(module, name)


def main(spec: dict[str, Any]) -> None:
    from lightning_hpp import HPPStrategy
    from lightning_hpp.check.record import CheckRecorder

    L.seed_everything(spec["seed"], verbose=False)
    model = load(spec["model"])()
    data = load(spec["data"])() if spec.get("data") else None
    strategy = HPPStrategy(pp_degree=spec["pp"], **spec["strategy"]) if spec["hpp"] else "ddp"
    kwargs = {"accelerator": "cpu", "enable_progress_bar": False, **spec["trainer"], "devices": spec["devices"],
              "strategy": strategy, "max_steps": spec["steps"]}
    trainer = L.Trainer(**kwargs, callbacks=[CheckRecorder(spec["records"])])
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model, datamodule=data)
    elif isinstance(data, (tuple, list)):
        trainer.fit(model, *data)
    else:
        trainer.fit(model, data)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
