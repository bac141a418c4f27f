"""Single-process fp32 references that the pipeline runs are compared against."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader, DistributedSampler

from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders


def train_reference(steps: int, batch: int, accumulate: int = 1, depth: int = 4):
    """Train tests.harness.zoo.MLP in one process with global batch ``batch``; returns (model, trainer)."""
    L.seed_everything(0)
    model = MLP(depth=depth)
    trainer = quiet_trainer(devices=1, max_steps=steps, accumulate_grad_batches=accumulate, num_sanity_val_steps=0,
                            limit_val_batches=0)
    train, val = loaders(batch)
    # Lightning gives distributed jobs a shuffling DistributedSampler seeded with PL_GLOBAL_SEED; with
    # replicas over dp only, the union of one step's replica batches is this sampler's next batch.
    sampler = DistributedSampler(train.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    train = DataLoader(train.dataset, batch_size=batch, sampler=sampler, drop_last=True)
    trainer.fit(model, train, val)
    return model, trainer
