"""A 2-rank HPPStrategy job with secrets planted in its hyperparameters, a CSV and a TensorBoard
logger, and (optionally) a rank that raises in ``training_step`` at a given step.

Usage: python -m tests.workers.run_errors '<json: {"out": DIR, "raise_rank": R or -1, "raise_step": K, "timeout": S}>'
with :data:`PLANTED_ENV` in the environment.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_hpp import HPPStrategy
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders
from tests.workers.run_cases import TWO

PLANTED_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIAPLANTED0KEY0ID0X",
    "AWS_SECRET_ACCESS_KEY": "planted-Secret-Access-Key-9f8e7d6c",
}
"""AWS keys the job finds in its environment (and puts into its storage options)."""

PLANTED_HPARAMS = {
    "api_key": "planted-api-key-1a2b",
    "wandb_token": "planted-wandb-3c4d",
    "db_password": "planted-pass-5e6f",
    "client_secret": "planted-client-7a8b",
}
"""Four hyperparameters with secret-looking names."""


class SecretHparams(MLP):
    def __init__(
        self,
        api_key: str,
        wandb_token: str,
        db_password: str,
        client_secret: str,
        storage_options: dict,
        raise_rank: int,
        raise_step: int,
        lr: float = 0.1,
    ):
        super().__init__(lr=lr)
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.hparams.raise_rank and self.global_step == self.hparams.raise_step:
            raise RuntimeError(f"boom on rank {self.global_rank} at step {self.global_step}")
        return super().training_step(batch, batch_idx)


def main(cfg: dict) -> None:
    L.seed_everything(0)
    storage = {
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
    }
    model = SecretHparams(
        **PLANTED_HPARAMS, storage_options=storage, raise_rank=cfg["raise_rank"], raise_step=cfg.get("raise_step", 0)
    )
    loggers = [CSVLogger(cfg["out"], name="csv"), TensorBoardLogger(cfg["out"], name="tb")]
    strategy = HPPStrategy(plan=TWO, n_microbatches=4, timeout=cfg["timeout"])
    trainer = quiet_trainer(devices=2, strategy=strategy, logger=loggers, max_steps=4, limit_val_batches=0,
                            log_every_n_steps=1)
    train, _ = loaders(16)
    trainer.fit(model, train)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
