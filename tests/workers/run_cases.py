"""Small multi-process jobs for the integration and bad-input tests.

Usage: python -m tests.workers.run_cases '<json: {"case": NAME, "out": DIR, ...}>'
or, for several bad setups tried in turn by the same processes (:mod:`tests.workers.refusals`),
python -m tests.workers.run_cases '<json: {"cases": [NAME, ...], "devices": N, "out": DIR}>'
"""

from __future__ import annotations

import functools
import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders

TWO = StagePlan([StageSpec(modules=["layers.0-3"]), StageSpec(modules=["layers.4-6"])])


class NonSequential(MLP):
    def forward(self, x):
        h = self.layers[:4](x)
        return self.layers[4:](torch.relu(h) + 1)


class IntBoundary(MLP):
    def __init__(self):
        super().__init__()
        self.layers[3] = _Bucketize()
        self.layers[4] = _FloatLinear(16, 16)


class _FloatLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x.float())


class _Bucketize(nn.Module):
    def forward(self, x):
        return (x > 0).long()


def main(cfg: dict) -> None:
    trainer, model, train, val = _build(cfg)
    trainer.fit(model, train, val)
    _report(cfg, trainer)


def main_cases(cfg: dict) -> int:
    from tests.workers.refusals import exit_status, try_case

    records = []
    for case in cfg["cases"]:
        trainer, model, train, val = _build({**cfg, "case": case})
        run = functools.partial(trainer.fit, model, train, val)
        records.append(try_case(os.path.join(cfg["out"], case), cfg["devices"], run, trainer))
    return exit_status(records)


def _build(cfg: dict) -> tuple:
    case = cfg["case"]
    L.seed_everything(0)
    devices = cfg.get("devices", 2)
    strategy_kw = dict(plan=TWO, n_microbatches=4, timeout=cfg.get("timeout", 60))
    model = {"non_sequential": NonSequential, "int_boundary": IntBoundary}.get(case, MLP)()
    batch = 16
    if case == "too_many_stages":
        strategy_kw["plan"] = StagePlan([StageSpec(modules=["layers.0-1"]), StageSpec(modules=["layers.2-3"]),
                                         StageSpec(modules=["layers.4-6"])])
    if case in ("non_sequential", "int_boundary"):  # the traced frontend would cut these; the sequential one refuses
        strategy_kw["frontend"] = "sequential"
    if case == "pp_not_divisor":
        strategy_kw["pp_degree"] = 2
    if case == "pp_exceeds_world":
        strategy_kw["pp_degree"] = 3
    if case == "device_map_rank7":
        strategy_kw["placement"] = {"device_map": "0:cpu,7:cpu"}
    if case == "batch_not_divisible":
        batch = 10
    callbacks = []
    kw: dict = dict(max_steps=6, limit_val_batches=0)
    if case == "lightning_integration":
        ckpt = ModelCheckpoint(dirpath=os.path.join(cfg["out"], "ckpt"), monitor="val_loss", mode="min", save_top_k=1)
        stop = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0, mode="min")  # stops after 2 epochs
        callbacks = [ckpt, stop]
        kw = dict(logger=CSVLogger(cfg["out"], name="csv"), max_epochs=5, log_every_n_steps=1, enable_progress_bar=True,
                  enable_checkpointing=None)
    trainer = quiet_trainer(devices=devices, strategy=HPPStrategy(**strategy_kw), callbacks=callbacks,
                            num_sanity_val_steps=0, **kw)
    train, val = loaders(batch)
    return trainer, model, train, val


def _report(cfg: dict, trainer) -> None:
    if cfg["case"] == "lightning_integration":
        ckpt, stop = trainer.checkpoint_callback, trainer.early_stopping_callback
        result = {
            "rank": trainer.global_rank,
            "epochs_run": trainer.current_epoch,
            "best_score": float(ckpt.best_model_score),
            "best_path": ckpt.best_model_path,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "stopped": stop.stopped_epoch,
            "log_dir": trainer.log_dir,
        }
        with open(os.path.join(cfg["out"], f"result{trainer.global_rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if "cases" in spec:
        sys.exit(main_cases(spec))
    main(spec)
