"""Modules the checker (lightning_hpp.check) is tried on, each with its data: one that runs under a pipeline as in
one process, and one with two differences planted: an epoch-end hook whose effect reaches only the ranks that hold
the last stage, and a step that drops a key of its returned dict under a pipeline."""

from __future__ import annotations

import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_hpp.model.units import RemoteUnit
from tests.harness.zoo import MLP, make_dataset


class Same(MLP):
    """An MLP whose steps return a dict and collect outputs for its epoch end, as many scripts do."""

    def __init__(self) -> None:
        super().__init__(depth=3)
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.seen.append(logits.argmax(1))
        return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}

    def on_train_epoch_end(self):
        self.log("seen", float(len(self.seen)), sync_dist=True)
        self.seen.clear()


class Planted(Same):
    """Two differences a pipeline brings out: the last stage's ranks log a value the others do not (a hook reading a
    layer only those hold), and the step drops its ``acc`` key where the first layer is not held."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if isinstance(self.layers[0], RemoteUnit):
            del out["acc"]
        return out

    def on_train_epoch_end(self):
        if not isinstance(self.layers[-1], RemoteUnit):
            self.log("last_layer_norm", self.layers[-1].weight.norm())
        super().on_train_epoch_end()


def data():
    return DataLoader(make_dataset(64), batch_size=8,
                      drop_last=True), DataLoader(make_dataset(16, seed=1), batch_size=8)
