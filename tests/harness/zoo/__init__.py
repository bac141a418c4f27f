"""The model zoo of the tests: the tiny LightningModules and data they share (real third-party models: zoo.real)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(n: int = 128, dim: int = 8, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w).argmax(dim=1)
    return TensorDataset(x, y)


class MLP(L.LightningModule):
    """``layers`` is an nn.Sequential, so every layer is a pipeline unit (layers.0 ... layers.N)."""

    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 4, depth: int = 4, lr: float = 0.1,
                 seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        mods: list[nn.Module] = [nn.Linear(dim, hidden), nn.Tanh()]
        for _ in range(depth - 2):
            mods += [nn.Linear(hidden, hidden), nn.Tanh()]
        mods.append(nn.Linear(hidden, classes))
        self.layers = nn.Sequential(*mods)
        self.lr = lr

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("val_loss", loss)
        self.log("val_acc", (logits.argmax(1) == y).float().mean())
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, _ = batch
        return self(x).argmax(1)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": sched}


def loaders(batch_size: int, n: int = 128, shuffle: bool = False):
    ds = make_dataset(n)
    train = DataLoader(ds, batch_size=batch_size, shuffle=shuffle, drop_last=True)
    val = DataLoader(make_dataset(64, seed=1), batch_size=batch_size)
    return train, val


class Wide(L.LightningModule):
    """A chain whose GEMM sizes fp8 runs (multiples of 16): units ``layers.0`` ... ``layers.4``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))

    def forward(self, x):
        return self.layers(x)
