"""Train transformers language models in 2 pipeline stages with ``ModelCheckpoint(save_last=True)``, for the
export tests (tests/test_export.py): one launch, one configuration after another.

Every rank saves, per configuration, ``OUT/<name>/rank{r}.pt``: its stages' parameters as trained (``state``)
and the global step; the checkpoint callback writes ``OUT/<name>/ckpt/last.ckpt`` (a sharded directory).
Usage: python -m tests.workers.run_export '<json: {"runs": [config, ...]}>'

Config keys: ``name``, ``out``, ``kind`` and ``tie`` (:class:`ExportLM`'s arguments), ``points`` (cut points),
``steps``.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.harness.trainer import quiet_trainer
from tests.harness.zoo.real import LMWrapper, loader


class ExportLM(LMWrapper):
    """:class:`~tests.harness.zoo.real.LMWrapper` whose hyper-parameters are saved, so that
    ``ExportLM.load_from_checkpoint(path)`` and ``--module tests.workers.run_export:ExportLM`` rebuild it:
    ``kind="gpt2"`` (embedding and LM head tied) or ``"llama"`` (tied or not, ``tie``)."""

    def __init__(self, kind: str = "gpt2", tie: bool = True) -> None:
        super().__init__(kind, **({"layers": 2, "tie": tie} if kind == "llama" else {}))
        self.save_hyperparameters()


def run(cfg: dict) -> None:
    from lightning_hpp import HPPStrategy, StagePlan

    L.seed_everything(0)
    model = ExportLM(cfg["kind"], tie=cfg.get("tie", True))
    strategy = HPPStrategy(plan=StagePlan.split_at(cfg["points"]), schedule="1f1b", n_microbatches=2, timeout=120)
    checkpoints = ModelCheckpoint(dirpath=os.path.join(cfg["out"], "ckpt"), save_last=True)
    trainer = quiet_trainer(enable_checkpointing=None, devices=2, strategy=strategy, max_steps=cfg["steps"],
                            callbacks=[checkpoints], num_sanity_val_steps=0, limit_val_batches=0,
                            default_root_dir=cfg["out"])
    trainer.fit(model, loader(cfg["kind"], 4, n=16))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    os.makedirs(cfg["out"], exist_ok=True)
    torch.save({"state": state, "global_step": trainer.global_step},
               os.path.join(cfg["out"], f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    for config in json.loads(sys.argv[1])["runs"]:
        run(config)
