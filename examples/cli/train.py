"""Train with LightningCLI: HPPStrategy and its option sections from a YAML file and the command line.

    python examples/cli/train.py fit --config examples/cli/config.yaml
    python examples/cli/train.py fit --config examples/cli/config.yaml \\
        --trainer.strategy.checkpoint.dir=/tmp/digits-ckpt --trainer.strategy.n_microbatches=4
    python examples/cli/train.py fit --trainer.accelerator=cpu --trainer.devices=2 \\
        --trainer.strategy=lightning_hpp.HPPStrategy --trainer.strategy.plan=stage_plan.json \\
        --trainer.strategy.checkpoint.dir=/tmp/digits-ckpt --trainer.strategy.bias.audit=error

Every ``HPPStrategy`` argument is a ``--trainer.strategy.<name>`` flag, and every field of a section one
level further down (``--trainer.strategy.checkpoint.keep_last=2``, ``--trainer.strategy.bias.audit=error``).
Flags after ``--config`` change the fields they name and keep the YAML's others; a
``--trainer.strategy=lightning_hpp.HPPStrategy`` flag there would start the strategy's arguments afresh.
``python examples/cli/train.py fit --config examples/cli/config.yaml --print_config`` prints the whole
configuration, defaults included.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn

from lightning_hpp.examples_data import DigitsDataModule


class DigitsMLP(L.LightningModule):
    """An MLP over the 8x8 digits images; ``layers`` is an ``nn.Sequential``, so its items are the
    pipeline units (``layers.0`` ... ``layers.5`` for ``depth=3``) that the stage plan cuts.

    Args:
        hidden: Width of the hidden layers.
        depth: Number of linear layers.
        lr: SGD learning rate (momentum 0.9).
        seed: Seed of the initial weights.
    """

    def __init__(self, hidden: int = 64, depth: int = 3, lr: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        widths = [64] + [hidden] * (depth - 1)
        mods: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(widths[:-1], widths[1:]):
            mods += [nn.Linear(a, b), nn.Tanh()]
        mods.append(nn.Linear(widths[-1], 10))
        self.layers = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)  # (B, 1, 8, 8) -> (B, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(DigitsMLP, DigitsDataModule, args=args)


if __name__ == "__main__":
    main()
