"""A two-stage digits classifier: stage 0 embeds the 64 pixels, stage 1 classifies."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpp import stage

NUM_CLASSES = 10


@stage(0)
class Encoder(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.fc = nn.Linear(64, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))  # (B, hidden)


@stage(1)
class Head(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))  # (B, 10)


class DigitsClassifier(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = Head()
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


@torch.no_grad()
def accuracy(
    state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, classes: tuple[int, ...]
) -> tuple[float, float]:
    """Accuracy of a full state dict on ``(x, y)``, overall and on the samples whose label is in ``classes``."""
    with torch.random.fork_rng(devices=[]):  # building the model must not advance this rank's RNG
        model = DigitsClassifier()
    model.load_state_dict(state)
    pred = model(x).argmax(1)
    rare = torch.isin(y, torch.tensor(classes))
    return float((pred == y).float().mean()), float((pred[rare] == y[rare]).float().mean())
