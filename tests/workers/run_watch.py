"""Straggler-watch jobs: a tiny MLP on 2 ranks, one rank optionally slowed from a given step on.

The slowness is injected by a callback of this script (a sleep in the slowed rank's stage forward, or one long
sleep), which the watch knows nothing about. Every rank writes OUT/<tag>_rank{r}.json: the per-step losses, the
plan's stages and the rank grid, the watch's findings and alerts, how the fit ended.

Usage: python -m tests.workers.run_watch '<json config>'; with ``"reference": true`` one process trains with
Lightning's own single-device strategy on the same data order and writes OUT/<tag>_rank0.json.
"""

import dataclasses
import json
import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from lightning_hpp.options import CheckpointOptions, PlacementOptions
from lightning_hpp.pipeline.mesh import stages_of_position
from lightning_hpp.pipeline.view import pipeline_view
from lightning_hpp.telemetry.watch import StragglerWatch
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders


class ConstantLR(MLP):
    """The tests' MLP with a constant learning rate (its StepLR would stop training after a few steps)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SlowRank(Callback):
    """From global step ``after`` on, ``rank`` sleeps ``ms`` in every forward of its stages (``once``: one
    sleep of ``ms`` in the first forward of step ``after``)."""

    def __init__(self, rank: int, after: int, ms: float, once: bool = False) -> None:
        self.rank, self.after, self.ms, self.once = rank, after, ms, once
        self.step, self.slept = 0, False

    def on_fit_start(self, trainer, pl_module):
        view = pipeline_view(trainer)
        if trainer.global_rank != self.rank or view is None:
            return
        for sm in view.runner.stage_modules.values():
            forward = sm.forward

            def slowed(*args, _forward=forward, **kwargs):
                if self.step >= self.after and not (self.once and self.slept):
                    self.slept = True
                    time.sleep(self.ms / 1000)
                return _forward(*args, **kwargs)

            sm.forward = slowed

    def on_train_batch_start(self, trainer, *args):
        self.step = trainer.global_step


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = float(outputs["loss"] if isinstance(outputs, dict) else outputs)


def _dump(cfg: dict, rank: int, data: dict) -> None:
    os.makedirs(cfg["out"], exist_ok=True)
    with open(os.path.join(cfg["out"], f"{cfg['tag']}_rank{rank}.json"), "w") as f:
        json.dump(data, f)


def reference(cfg: dict) -> None:
    L.seed_everything(0)
    model, losses = ConstantLR(), Losses()
    trainer = quiet_trainer(devices=1, max_steps=cfg["steps"], num_sanity_val_steps=0, limit_val_batches=0,
                            callbacks=[losses])
    train, val = loaders(cfg.get("batch", 16))
    sampler = DistributedSampler(train.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(model, DataLoader(train.dataset, batch_size=cfg.get("batch", 16), sampler=sampler, drop_last=True), val)
    _dump(cfg, 0, {"losses": losses.losses})


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    model = ConstantLR()
    plan = cfg.get("plan", "auto")
    if plan != "auto":
        plan = StagePlan([StageSpec(modules=m) for m in plan])
    checkpoint = CheckpointOptions(dir=cfg.get("ckpt_dir"), resume=cfg.get("resume"))
    strategy = HPPStrategy(plan=plan, schedule=cfg.get("schedule"), n_microbatches=cfg.get("n_micro"),
                           pp_degree=cfg.get("pp", 2),
                           checkpoint=checkpoint, timeout=cfg.get("timeout", 300),
                           placement=PlacementOptions(watch=cfg.get("watch", "warn")))
    losses = Losses()
    callbacks = [losses]
    if cfg.get("slow"):
        callbacks.append(SlowRank(**cfg["slow"]))
    trainer = quiet_trainer(devices=2, num_nodes=1, strategy=strategy, max_steps=cfg["steps"],
                            enable_checkpointing=bool(cfg.get("ckpt_dir")), num_sanity_val_steps=0, limit_val_batches=0,
                            callbacks=callbacks, default_root_dir=cfg["out"])
    train, val = loaders(cfg.get("batch", 16))
    ended, error = "finished", None
    try:
        trainer.fit(model, train, val)
    except SystemExit as exc:
        ended = f"exit {exc.code}"
        raise
    except Exception as exc:
        ended, error = "error", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        watch = next((cb for cb in trainer.callbacks if isinstance(cb, StragglerWatch)), None)
        p = strategy.pipeline
        _dump(cfg, trainer.global_rank, {
            "losses": losses.losses, "ended": ended, "error": error, "global_step": trainer.global_step,
            "stages": [list(s.modules) for s in p.plan.stages] if p is not None else None,
            "grid": p.mesh.grid if p is not None else None,
            # the units each rank holds (a multi-stage schedule puts several stages, not always neighbours, on a rank)
            "units_per_rank": {str(r): sum(len(p.plan.stages[k].modules)
                                           for k in stages_of_position(
                                               pos, p.mesh.pp, p.plan.num_stages, p.runner.kind.style))
                               for pos, row in enumerate(p.mesh.grid) for r in row} if p is not None else None,
            "n_microbatches": p.n_microbatches if p is not None else None,
            "rank_speeds": p.plan.meta.get("rank_speeds") if p is not None else None,
            "resumed_from": strategy.resumed_from,
            "findings": [dataclasses.asdict(f) for f in watch.findings] if watch is not None else None,
            "alerts": [[s, sig, {str(k): v for k, v in pos.items()}] for s, sig,
                       pos in watch.alerts] if watch else None,
        })


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    reference(config) if config.get("reference") else main(config)
