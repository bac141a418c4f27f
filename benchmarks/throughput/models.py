"""The two benchmark models, as LightningModules whose units every strategy cuts the same way.

* :class:`ParamMLP` — parameter-heavy: ``blocks`` of ``Linear(h, h) + ReLU`` and a classifier head
  (preset ``cpu``: ``h=1792``, 8 blocks, 25.7M parameters).
* :class:`TinyLM` — a small decoder-only transformer language model over bytes (pre-norm blocks,
  causal attention; preset ``cpu``: ``d=128``, 4 blocks, 64 tokens, 0.9M parameters).

Pipeline units are ``embed`` (LM only), ``blocks.0`` … ``blocks.{n-1}`` and ``head``;
:func:`split` gives the unit lists of 2 or 4 balanced stages, used by HPPStrategy and by the raw
torch pipelining runs alike. Data is random and made from a seed: every strategy sees the same
samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class Size:
    """Model and batch sizes of one benchmark model."""

    width: int
    blocks: int
    batch: int
    seq: int = 0
    vocab: int = 0


SIZES = {
    "mlp": {
        "tiny": Size(width=256, blocks=4, batch=16),
        "cpu": Size(width=1792, blocks=8, batch=64),
        "gpu": Size(width=4096, blocks=8, batch=256),
    },
    "lm": {
        "tiny": Size(width=64, blocks=4, batch=16, seq=16, vocab=64),
        "cpu": Size(width=128, blocks=4, batch=32, seq=64, vocab=256),
        "gpu": Size(width=512, blocks=8, batch=64, seq=256, vocab=256),
        # logits (batch x seq x vocab: 268 MB a step in fp32) far above everything else a stage holds
        "vocab": Size(width=64, blocks=4, batch=16, seq=128, vocab=32768),
    },
}
"""Size presets: ``tiny`` (a smoke run), ``cpu`` (the default, minutes on 2 cores), ``gpu``; the LM's
``vocab``, whose peak memory is its last stage's logits."""


class _Base(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr

    def units(self) -> list[nn.Module]:
        """The pipeline units in order (what HPPStrategy finds)."""
        first = [self.embed] if hasattr(self, "embed") else []
        return first + list(self.blocks) + [self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units():
            x = unit(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class logits ``(B, C)`` and token logits ``(B, T, V)`` alike."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


class ParamMLP(_Base):
    def __init__(self, size: Size, classes: int = 10, lr: float = 1e-3) -> None:
        super().__init__(lr)
        torch.manual_seed(0)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(size.width, size.width), nn.ReLU()) for _ in range(size.blocks)]
        )
        self.head = nn.Linear(size.width, classes)


class Embed(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]  # (B, T, d)


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, d/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))  # (B, T, V)


class TinyLM(_Base):
    def __init__(self, size: Size, lr: float = 1e-3) -> None:
        super().__init__(lr)
        torch.manual_seed(0)
        self.embed = Embed(size.vocab, size.seq, size.width)
        self.blocks = nn.Sequential(*[Block(size.width) for _ in range(size.blocks)])
        self.head = Head(size.width, size.vocab)


def build(name: str, size: Size) -> _Base:
    """A fresh model (same initial weights every call)."""
    return ParamMLP(size) if name == "mlp" else TinyLM(size)


def dataset(name: str, size: Size, n_batches: int) -> TensorDataset:
    """``n_batches`` global batches of random samples, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    n = n_batches * size.batch
    if name == "mlp":
        return TensorDataset(torch.randn(n, size.width, generator=g), torch.randint(0, 10, (n,), generator=g))
    tokens = torch.randint(0, size.vocab, (n, size.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def split(name: str, size: Size, n_stages: int) -> list[list[str]]:
    """Unit names of ``n_stages`` stages with (nearly) equal numbers of blocks each."""
    per = size.blocks / n_stages
    if per != int(per):
        raise ValueError(
            f"{size.blocks} blocks do not split into {n_stages} equal stages; use a block count divisible by "
            f"{n_stages}."
        )
    stages = [[f"blocks.{i}" for i in range(math.floor(k * per), math.floor((k + 1) * per))] for k in range(n_stages)]
    if name == "lm":
        stages[0].insert(0, "embed")
    stages[-1].append("head")
    return stages


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
