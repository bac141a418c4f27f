"""A 2-stage run whose ``ModelCheckpoint`` writes to S3 through a fault proxy that lives in rank 0's process.

Each time the callback saves, the ListObjectsV2 requests of its ``file_exists`` lookup (rank 0 only, while
the other ranks wait for its answer) are answered with ``failures`` injected 500s first. The environment
turns botocore's own per-request retries off (``AWS_MAX_ATTEMPTS=1``), so any retry is the strategy's.

Usage: python -m tests.workers.run_s3_faults '<json: {"moto_port", "root", "out", "failures", "steps", "every"}>'
Rank 0 writes OUT/result.json: the proxy's counts, the steps trained and the checkpoint kept.
"""

import json
import os
import sys

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders
from tests.s3_server import FaultProxy

LIST_V2 = "list-type=2"


class _FailListsBeforeSaves(Callback):
    """Arms the proxy just before ``ModelCheckpoint`` (Lightning runs checkpoint callbacks last) saves."""

    def __init__(self, proxy: FaultProxy | None, every: int, failures: int) -> None:
        self.proxy, self.every, self.failures, self.armed = proxy, every, failures, 0

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.proxy is not None and trainer.global_step % self.every == 0:
            self.proxy.fail_next(self.failures, "500", methods=("GET",), path_part=LIST_V2)
            self.armed += 1


def main(cfg: dict) -> None:
    proxy = None
    if "LOCAL_RANK" not in os.environ:  # the launching process, rank 0: the other ranks inherit the endpoint
        proxy = FaultProxy(cfg["moto_port"])
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
    L.seed_everything(0)
    every = cfg["every"]
    arm = _FailListsBeforeSaves(proxy, every, cfg["failures"])
    checkpoint = ModelCheckpoint(dirpath=cfg["root"], every_n_train_steps=every, save_top_k=1)
    strategy = HPPStrategy(plan=StagePlan([StageSpec(modules=["layers.0-3"]), StageSpec(modules=["layers.4-6"])]),
                           n_microbatches=2, timeout=60)
    trainer = quiet_trainer(enable_checkpointing=None, devices=2, strategy=strategy, max_steps=cfg["steps"],
                            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[arm, checkpoint],
                            default_root_dir=cfg["out"])
    train, val = loaders(8)
    trainer.fit(MLP(), train, val)
    if trainer.global_rank == 0:
        result = {"global_step": trainer.global_step, "best_model_path": checkpoint.best_model_path, "armed": arm.armed,
                  "faults": proxy.faults, "matched": proxy.matched}
        with open(os.path.join(cfg["out"], "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
