"""The test model as a LightningModule (same parameter names as ``common.TinyNet``)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from tests.ckpt_workers.common import build_units


class TinyLM(L.LightningModule):
    def __init__(self, width: int = 8, n_blocks: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        build_units(self, width, n_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)
