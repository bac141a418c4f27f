"""Two 2-rank DDP fits on CPU with BiasMonitor: the field report's sampler bug, then the fix.

Run as ``python monitor_ddp.py OUT_DIR``; Lightning relaunches this script for rank 1. Each rank
writes ``OUT_DIR/{bug,fix}_rank{r}.json`` and rank 0's CSVLogger writes ``OUT_DIR/{bug,fix}/``.
The test imports this module for the data, the model and the weights to compute references.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from lightning_hpp.bias.fingerprint import CodedBiasWarning
from lightning_hpp.bias.monitor import BiasMonitor
from lightning_hpp.bias.samplers import DistributedWeightedSampler
from tests.harness.trainer import quiet_trainer

N = 64
BATCH = 8
EPOCHS = 4
SEED = 0


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 8, generator=g)
    y = 0.02 * (x @ torch.randn(8, 1, generator=g)) + 0.01 * torch.randn(N, 1, generator=g)
    return TensorDataset(x, y)


def weights() -> torch.Tensor:
    w = torch.ones(N)
    w[:8] = 10.0  # a few heavily weighted samples, as in the field report
    return w


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        # Start at zero: small, comparable gradients, so the field report's thresholds apply.
        torch.nn.init.zeros_(self.net.weight)
        torch.nn.init.zeros_(self.net.bias)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _Probe(L.Callback):
    """Records which sampler the train loader really uses after Lightning processed it."""

    def __init__(self) -> None:
        self.sampler = None
        self.wrapped = None

    def on_train_start(self, trainer, pl_module):
        sampler = trainer.train_dataloader.batch_sampler.sampler
        self.sampler = type(sampler).__qualname__
        self.wrapped = isinstance(sampler, DistributedSamplerWrapper)
        self.is_dws = isinstance(sampler, DistributedWeightedSampler)


STAGE_NORMS = {0: (1.0, 1.5), 1: (2.0, 2.0)}
"""Local gradient norms the contract strategy reports: stage -> (dp rank 0, dp rank 1)."""


class ContractStrategy(DDPStrategy):
    """DDP that implements :class:`~lightning_hpp.pipeline.view.PipelineView` (one stage, no pipeline
    of its own), with known stage norms."""

    plan = mesh = runner = device_kind = None
    stage_ids: list = []
    schedule, n_microbatches = "1f1b", 1

    def __init__(self) -> None:
        super().__init__()
        self.dp_group = None
        self.step_stats: dict = {}

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        norms = {stage: values[self.dp_rank] for stage, values in STAGE_NORMS.items()}
        self.step_stats.update(loss=float(loss), local_grad_norms=norms)
        return loss


def fit(name: str, out: Path, sampler, use_distributed_sampler: bool, strategy="ddp", epochs=EPOCHS) -> None:
    L.seed_everything(SEED)
    monitor, probe = BiasMonitor(), _Probe()
    trainer = quiet_trainer(devices=2, strategy=strategy, max_epochs=epochs,
                            use_distributed_sampler=use_distributed_sampler,
                            logger=CSVLogger(out, name=name, version=0), callbacks=[monitor, probe],
                            log_every_n_steps=1)
    loader = DataLoader(data(), batch_size=BATCH, sampler=sampler)
    sampler_cls = type(sampler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(), loader)
    result = {
        "history": monitor.history,
        "alarms": monitor.alarms,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, CodedBiasWarning)],
        "norm_source": monitor.norm_source,
        "sampler": probe.sampler,
        "wrapped": probe.wrapped,
        "is_dws": probe.is_dws,
        "sampler_class_restored": type(sampler) is sampler_cls,
    }
    (out / f"{name}_rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    out = Path(sys.argv[1])
    # The field report's bug: no generator, use_distributed_sampler=False -> same sequence everywhere.
    fit("bug", out, WeightedRandomSampler(weights(), N), use_distributed_sampler=False)
    # The fix, with Lightning's default use_distributed_sampler=True.
    fit("fix", out, DistributedWeightedSampler(weights(), seed=SEED), use_distributed_sampler=True)
    # The pipeline strategy's contract: dp attributes and per-step stats on the strategy.
    fit("contract", out, DistributedWeightedSampler(weights(), seed=SEED), use_distributed_sampler=True,
        strategy=ContractStrategy(), epochs=4)


if __name__ == "__main__":
    main()
