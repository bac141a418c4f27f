"""Train a two-stage model whose stages take known times, under HPPStrategy with PipelineTelemetry.

Each stage holds a unit that sleeps a fixed time in its forward and in its backward, so the
stages' compute costs are known lower bounds whatever else the machine is running. Every rank
saves, per configuration, the telemetry history and the picture paths to OUT/<name>/rank{r}.json;
rank 0's CSVLogger writes OUT/<name>/csv/version_0/metrics.csv.

Usage: python -m tests.workers.run_telemetry '<json: {"devices": N, "runs": [config, ...]}>'
"""

import json
import os
import sys
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from lightning_hpp.telemetry.callback import PipelineTelemetry
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import loaders


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ms):
        time.sleep(ms / 1000)
        ctx.ms = ms
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.ms / 1000)
        return grad, None


class Sleep(nn.Module):
    """Identity that takes ``ms`` in forward and ``ms`` in backward."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms

    def forward(self, x):
        return _SleepFn.apply(x, self.ms)


class TimedMLP(L.LightningModule):
    def __init__(self, ms0: float, ms1: float):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 16), Sleep(ms0), nn.Tanh(), nn.Linear(16, 16), Sleep(ms1),
                                    nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def run(cfg: dict, devices: int) -> None:
    L.seed_everything(0)
    out = os.path.join(cfg["out"], cfg["name"])
    # HPPStrategy(telemetry=...) attaches the callback itself
    strategy = HPPStrategy(
        plan=StagePlan([StageSpec(modules=["layers.0-1"]), StageSpec(modules=["layers.2-5"])]),
        schedule=cfg["schedule"],
        n_microbatches=cfg["n_micro"],
        timeout=60,
        telemetry={"every_n_steps": cfg.get("every_n_steps"), "trace_step": cfg.get("trace_step")},
    )
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_steps=cfg["steps"],
                            logger=CSVLogger(out, name="csv", version=0),
                            log_every_n_steps=cfg.get("log_every_n_steps", 1), num_sanity_val_steps=0,
                            limit_val_batches=0, default_root_dir=out)
    train, _ = loaders(cfg["batch"])
    trainer.fit(TimedMLP(cfg["ms0"], cfg["ms1"]), train)
    telemetry = next(cb for cb in trainer.callbacks if isinstance(cb, PipelineTelemetry))
    result = {
        "history": [{"step": m.step, **m.as_log_dict()} for m in telemetry.history],
        "trace_paths": telemetry.trace_paths,
        "log_dir": trainer.log_dir,
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    for cfg in spec["runs"]:
        run(cfg, spec["devices"])
