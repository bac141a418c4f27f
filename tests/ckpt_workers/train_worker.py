"""A 2-stage HPPStrategy fit with checkpoints: what every rank saw, loaded and was told.

Usage: python -m tests.ckpt_workers.train_worker '<json config>'

Config: ``out``, ``tag``, ``steps``; optional ``dir``, ``every``, ``resume``, ``keep_last``,
``new_run``, ``ckpt_path``, ``num_workers``. Rank r writes ``OUT/<tag>_rank<r>.pt``: the
parameters, the sum of the inputs of every batch it trained on (by global step), the checkpoint it
resumed from and the checkpoint warnings it emitted.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from lightning_hpp.options import CheckpointOptions
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, make_dataset

STAGES = [["layers.0-3"], ["layers.4-6"]]


class _Batches(Callback):
    """The sum of each batch's inputs, by the global step it trains."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen[trainer.global_step + 1] = float(batch[0].double().sum())


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(cfg: dict) -> None:
    L.seed_everything(0)
    lines = _Lines()
    logging.getLogger("lightning_hpp").addHandler(lines)
    checkpoint = CheckpointOptions(
        dir=cfg.get("dir"),
        every_n_steps=cfg.get("every") if cfg.get("dir") else None,
        keep_last=cfg.get("keep_last"),
        resume=cfg.get("resume"),
        **({"new_run": cfg["new_run"]} if "new_run" in cfg else {}),
    )
    strategy = HPPStrategy(
        plan=StagePlan([StageSpec(modules=m) for m in STAGES]),
        schedule="1f1b",
        n_microbatches=4,
        checkpoint=checkpoint,
        timeout=60,
    )
    batches = _Batches()
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=cfg["steps"],
                            enable_checkpointing=bool(cfg.get("dir")), num_sanity_val_steps=0, limit_val_batches=0,
                            callbacks=[batches], default_root_dir=cfg["out"])
    workers = cfg.get("num_workers", 0)
    train = DataLoader(
        make_dataset(128),
        batch_size=16,
        drop_last=True,
        num_workers=workers,
        persistent_workers=False,
        multiprocessing_context="fork" if workers else None,
    )
    model = MLP()
    trainer.fit(model, train, ckpt_path=cfg.get("ckpt_path"))
    out = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "seen": batches.seen,
        "global_step": trainer.global_step,
        "resumed_from": strategy.resumed_from,
        "warnings": lines.lines,
    }
    torch.save(out, os.path.join(cfg["out"], f"{cfg['tag']}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
