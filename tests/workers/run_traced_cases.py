"""Bad real-model inputs for the traced frontend: each must stop every rank at setup.

Usage: python -m tests.workers.run_traced_cases '<json: {"case": NAME}>'
or, for several cases tried in turn by the same processes (:mod:`tests.workers.refusals`),
python -m tests.workers.run_traced_cases '<json: {"cases": [NAME, ...], "out": DIR}>'
"""

from __future__ import annotations

import functools
import json
import os
import sys

import lightning as L
import torch

from lightning_hpp import HPPStrategy, StagePlan
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo.real import LMWrapper, loader


class TwoCalls(LMWrapper):
    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        logits = self(ids, attention_mask=mask)
        again = self(ids)  # a second forward in one step
        loss = torch.nn.functional.cross_entropy((logits + again).reshape(-1, logits.size(-1)), labels.reshape(-1))
        self.log("train/loss", loss)
        return loss


class DataDependent(LMWrapper):
    def forward(self, x, attention_mask=None):
        logits = super().forward(x, attention_mask=attention_mask)
        if logits.mean() > 0:  # control flow on a tensor value
            logits = logits * 2
        return logits


def main(cfg: dict) -> None:
    trainer, model = _build(cfg)
    trainer.fit(model, loader("gpt2", 8))
    print("TRAINED")


def main_cases(cfg: dict) -> int:
    from tests.workers.refusals import exit_status, try_case

    records = []
    for case in cfg["cases"]:
        trainer, model = _build({**cfg, "case": case})
        run = functools.partial(_fit_and_say, trainer, model, case)
        records.append(try_case(os.path.join(cfg["out"], case), 2, run, trainer))
    return exit_status(records)


def _fit_and_say(trainer, model, case: str) -> None:
    trainer.fit(model, loader("gpt2", 8))
    print(f"TRAINED {case}")


def _build(cfg: dict) -> tuple:
    L.seed_everything(0)
    model = {"second_call": TwoCalls, "data_dependent": DataDependent}[cfg["case"]]("gpt2")
    strategy = HPPStrategy(plan=StagePlan.split_at(["model.transformer.h.2"]), n_microbatches=4,
                           timeout=cfg.get("timeout", 60))
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2, num_sanity_val_steps=0, limit_val_batches=0)
    return trainer, model


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if "cases" in spec:
        sys.exit(main_cases(spec))
    main(spec)
