"""Train tests.models.MLP under HPPStrategy; every rank saves what it holds to OUT/rank{r}.pt.

Usage: python -m tests.workers.run_hpp '<json config>'
"""

import json
import os
import sys

import lightning as L
import torch

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from tests.models import MLP, loaders


def main(cfg: dict) -> None:
    L.seed_everything(0)
    model = MLP(depth=cfg.get("depth", 4))
    plan = StagePlan([StageSpec(modules=m) for m in cfg["stages"]])
    strategy = HPPStrategy(plan=plan, schedule=cfg["schedule"], n_microbatches=cfg["n_micro"], pp_degree=cfg.get("pp"), timeout=cfg.get("timeout", 60))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy=strategy,
        max_steps=cfg["steps"],
        accumulate_grad_batches=cfg.get("accumulate", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=cfg.get("limit_val_batches", 0),
        default_root_dir=cfg["out"],
    )
    train, val = loaders(cfg["batch"])
    trainer.fit(model, train, val)
    out = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items() if "layers" in k},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
    }
    if cfg.get("validate"):
        res = trainer.validate(model, val, verbose=False)
        out["validate"] = res
    if cfg.get("predict"):
        pred = trainer.predict(model, val)
        out["predict"] = torch.cat(pred)
    torch.save(out, os.path.join(cfg["out"], f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
