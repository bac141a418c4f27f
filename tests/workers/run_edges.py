"""Setups that used to be refused or to crash where Lightning works, run one after another in one launch.

Each case trains (or validates) tests.harness.zoo-style modules on 2 ranks and saves, per rank, what it holds,
its logged values and the warnings Lightning raised to OUT/<case>/rank{r}.pt.
Usage: python -m tests.workers.run_edges '<json: {"out": dir}>'
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_hpp import HPPStrategy, StagePlan
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, make_dataset


class SyncDistVal(MLP):
    """Validation values logged with ``sync_dist=True``, as Lightning asks distributed users to."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)


class Containers(L.LightningModule):
    """Two top-level ``nn.Sequential`` containers of units: cutting at ``b`` cuts before ``b.0``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.b(self.a(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BatchNormNet(L.LightningModule):
    """BatchNorm in the second stage: its running statistics are updated by every micro-batch's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.b(self.a(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


CASES = {
    # sync_dist=True values replayed with the user's flag: Lightning asks for it no more
    "sync_dist": dict(model=SyncDistVal, plan=["layers.4"], schedule="1f1b", n_micro=4, batch=16, steps=4, val_batch=16,
                      limit_val_batches=2),
    # values logged without sync_dist on one replica: already the job's, so Lightning has nothing to ask for either
    "unsynced": dict(model=MLP, plan=["layers.4"], schedule="1f1b", n_micro=4, batch=16, steps=4, val_batch=16,
                     limit_val_batches=2),
    # a cut at a container of units
    "container": dict(model=Containers, plan=["b"], schedule="1f1b", n_micro=4, batch=16, steps=4),
    # dualpipev, 4 stages, m=4; the validation set's last batch of 30 splits into 3 micro-batches only
    "dualpipev": dict(model=MLP, depth=6, plan=["layers.2", "layers.4", "layers.6"], schedule="dualpipev", n_micro=4,
                      batch=16, steps=2, val_batch=34, limit_val_batches=2, val_n=64),
    # the traced frontend on batches of n_microbatches samples (one-sample micro-batches), validated on batches of 8
    "traced_one_sample": dict(model=MLP, plan=["layers.4"], schedule="1f1b", n_micro=4, batch=4, steps=3, val_batch=8,
                              limit_val_batches=2, frontend="traced"),
    # a traced bf16-true stage with BatchNorm: the cast replaces the buffers; the module's statistics must still move
    "traced_bn_bf16": dict(model=BatchNormNet, plan=["b"], schedule="1f1b", n_micro=4, batch=16, steps=3,
                           frontend="traced",
                           precision=["32-true", "bf16-true"]),
}


def run(case: str, out: str) -> None:
    cfg = CASES[case]
    L.seed_everything(0)
    model = cfg["model"](depth=cfg["depth"]) if "depth" in cfg else cfg["model"]()
    stage_fields = {"precision": cfg["precision"]} if "precision" in cfg else {}
    strategy = HPPStrategy(plan=StagePlan.split_at(cfg["plan"], **stage_fields), schedule=cfg["schedule"],
                           n_microbatches=cfg["n_micro"],
                           frontend=cfg.get("frontend", "auto"), timeout=120)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=cfg["steps"], num_sanity_val_steps=0,
                            limit_val_batches=cfg.get("limit_val_batches", 0), default_root_dir=os.path.join(out, case))
    train = DataLoader(make_dataset(128), batch_size=cfg["batch"], drop_last=True)
    val = DataLoader(make_dataset(cfg.get("val_n", 64), seed=1), batch_size=cfg.get("val_batch", 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, val)
        validated = trainer.validate(model, val, verbose=False) if cfg.get("limit_val_batches") else []
    os.makedirs(os.path.join(out, case), exist_ok=True)
    torch.save({
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "validated": validated,
        "stage_ids": trainer.strategy.stage_ids,
        "plan": trainer.strategy.plan.to_dict(),
        "warnings": [str(w.message) for w in caught],
        "stage_state": {k: v.detach().clone() for sm in trainer.strategy.pipeline.runner.stage_modules.values()
                        for k, v in sm.state_dict().items()},
    }, os.path.join(out, case, f"rank{trainer.global_rank}.pt"))


def main() -> None:
    args = json.loads(sys.argv[1])
    for case in args.get("cases", list(CASES)):
        run(case, args["out"])


if __name__ == "__main__":
    main()
