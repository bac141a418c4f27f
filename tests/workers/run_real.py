"""Train a real model (tests.real_models) under HPPStrategy, for one or more configurations in one launch.

Every rank saves, per configuration, to OUT/<name>/rank{r}.pt: the parameters it holds, the loss
logged at every step (as rank 0's loggers see it), the plan and the frontend.
Usage: python -m tests.workers.run_real '<json: {"devices": N, "runs": [config, ...]}>'
"""

import json
import os
import sys

import lightning as L
import torch

from lightning_hpp import HPPStrategy, StagePlan
from tests.real_models import LMWrapper, loader


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def run(cfg: dict, devices: int) -> None:
    L.seed_everything(0)
    model = LMWrapper(cfg["model"], **cfg.get("model_kw", {}))
    plan = StagePlan.split_at(cfg["points"]) if cfg.get("points") else None
    strategy = HPPStrategy(plan=plan, schedule=cfg["schedule"], n_microbatches=cfg["n_micro"], pp_degree=cfg.get("pp"),
                           frontend=cfg.get("frontend", "auto"), timeout=120)
    losses = StepLosses()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=cfg["steps"], logger=False,
                        callbacks=[losses], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=cfg.get("limit_val_batches", 0),
                        default_root_dir=cfg["out"])
    train = loader(cfg["model"], cfg["batch"], n=cfg.get("n", 32))
    val = loader(cfg["model"], cfg["batch"], n=16) if cfg.get("limit_val_batches") else None
    trainer.fit(model, train, val)
    out = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": losses.losses,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "stage_ids": strategy.stage_ids,
        "plan": strategy.plan.to_dict(),
    }
    os.makedirs(cfg["out"], exist_ok=True)
    torch.save(out, os.path.join(cfg["out"], f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    for cfg in spec["runs"]:
        run(cfg, spec["devices"])
