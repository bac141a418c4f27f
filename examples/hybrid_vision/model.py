"""The hybrid vision model: a CNN encoder, a Transformer encoder block and a linear classifier.

It is an ordinary LightningModule whose three top-level children are the pipeline units, in
order: ``encoder`` (stage 0), ``transformer`` (stage 1) and ``classifier`` (undecorated, so it
becomes stage 2). The decorators carry the field report's precisions for the first two stages
(fp16 encoder, fp8 Transformer); the classifier runs in the Trainer's ``precision`` (bf16-mixed in
that plan). :func:`mixed_plan` spells out all three stages, :func:`fp32_plan` gives the same cut
in full precision for correctness checks.

Shapes, for a batch of B images of side S (8, or 16 when upsampled) and a second convolution of
stride s (2 by default):

    (B, 1, S, S) --encoder--> (B, T, D) --transformer--> (B, T, D) --classifier--> (B, 10)

with T = (S / s)^2 tokens of width D. Every boundary tensor is floating point. The model has no
BatchNorm and no dropout, so cutting a batch into micro-batches leaves the numerics unchanged.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpp import StagePlan, StageSpec, stage

NUM_CLASSES = 10
GROUPS = 8
"""GroupNorm groups of the encoder (no BatchNorm: micro-batching must not change the numerics)."""
ENCODER_PRECISION = "16-mixed"
TRANSFORMER_PRECISION = "fp8"
CLASSIFIER_PRECISION = "bf16-mixed"
"""The classifier is undecorated: it runs in the Trainer's ``precision`` unless a plan says otherwise."""


class HybridConfigError(ValueError):
    """A model setting that cannot work; the message names the value and the fix."""


@stage(0, device="cpu", precision=ENCODER_PRECISION)
class VisionEncoder(nn.Module):
    """Two 3x3 convolutions that turn an image into a sequence of tokens.

    Args:
        image_size: Side of the square input images.
        channels: Width of the first convolution.
        dim: Token width D (channels of the second convolution).
        stride: Stride of the second convolution; the token grid is ``image_size // stride`` square.
    """

    def __init__(self, image_size: int = 8, channels: int = 32, dim: int = 64, stride: int = 2) -> None:
        super().__init__()
        if image_size % stride:
            raise HybridConfigError(
                f"`VisionEncoder(image_size={image_size!r}, stride={stride!r})`: the image side must be "
                f"divisible by the stride so that the token grid is square; use stride 1 or 2 with an even side."
            )
        for name, value in (("channels", channels), ("dim", dim)):
            if value % GROUPS:
                raise HybridConfigError(
                    f"`VisionEncoder({name}={value!r})` must be a multiple of {GROUPS} (GroupNorm uses "
                    f"{GROUPS} groups); use e.g. {name}={max(GROUPS, value - value % GROUPS)}."
                )
        grid = image_size // stride
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(GROUPS, channels)
        self.conv2 = nn.Conv2d(channels, dim, 3, stride=stride, padding=1)
        self.norm2 = nn.GroupNorm(GROUPS, dim)
        self.pos = nn.Parameter(torch.zeros(1, grid * grid, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(self.conv1(x)))  # (B, C, S, S)
        x = F.gelu(self.norm2(self.conv2(x)))  # (B, D, G, G)
        # contiguous: torch pipelining sizes its receive buffers from this output's strides, and
        # gloo refuses to receive into a non-contiguous (transposed) buffer.
        return x.flatten(2).transpose(1, 2).contiguous() + self.pos  # (B, T, D)


@stage(1, device="cpu", precision=TRANSFORMER_PRECISION)
class TransformerBlock(nn.Module):
    """A pre-norm Transformer encoder block: self-attention then an MLP, each with a residual.

    Attention is written with ``nn.Linear`` projections (not ``nn.MultiheadAttention``) so every
    matrix multiply of the block is an ``nn.Linear`` that a precision backend can swap.

    Args:
        dim: Token width D.
        heads: Attention heads; must divide ``dim``.
        mlp_ratio: Hidden width of the MLP as a multiple of ``dim``.
    """

    def __init__(self, dim: int = 64, heads: int = 4, mlp_ratio: int = 4) -> None:
        super().__init__()
        if dim % heads:
            raise HybridConfigError(
                f"`TransformerBlock(dim={dim!r}, heads={heads!r})`: heads must divide dim; "
                f"use e.g. heads={math.gcd(dim, heads)}."
            )
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, D/H)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))  # (B, T, D)


class ClassifierHead(nn.Module):
    """LayerNorm, mean over tokens, then a linear map to class logits.

    Args:
        dim: Token width D.
        num_classes: Number of classes.
    """

    def __init__(self, dim: int = 64, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))  # (B, classes)


class HybridVisionModel(L.LightningModule):
    """CNN encoder -> Transformer block -> classifier, trained with cross-entropy and AdamW.

    Args:
        image_size: Side of the input images (must match the data module's ``image_size``).
        channels: Width of the encoder's first convolution.
        dim: Token width D.
        stride: Stride of the encoder's second convolution.
        heads: Attention heads.
        mlp_ratio: MLP width multiple.
        lr: Peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        warmup_steps: Steps of linear warm-up before the cosine decay.
    """

    def __init__(
        self,
        image_size: int = 8,
        channels: int = 32,
        dim: int = 64,
        stride: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.05,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        if not lr > 0:
            raise HybridConfigError(f"`HybridVisionModel(lr={lr!r})` must be > 0, e.g. lr=3e-3.")
        self.save_hyperparameters()
        self.encoder = VisionEncoder(image_size, channels, dim, stride)
        self.transformer = TransformerBlock(dim, heads, mlp_ratio)
        self.classifier = ClassifierHead(dim, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.transformer(self.encoder(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(-1) == y).float().mean())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        # epoch-level values: averaged over the data-parallel replicas (each sees its own shard)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: torch.Tensor | tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(-1)

    def configure_optimizers(self):
        # Weight decay on matrices and kernels only. Built from the parameters this process holds,
        # so it also works when a pipeline rank keeps only its own stage.
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2 and not n.endswith("pos")]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2 or n.endswith("pos")]
        groups = [
            {"params": params, "weight_decay": wd}
            for params, wd in ((decay, self.hparams.weight_decay), (no_decay, 0.0))
            if params
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise HybridConfigError(
                f"`HybridVisionModel` decays its learning rate over the whole run, but the Trainer's run "
                f"length is {total!r}. Set `Trainer(max_epochs=...)` or `Trainer(max_steps=...)`."
            )
        schedule = WarmupCosine(self.hparams.warmup_steps, int(total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WarmupCosine:
    """Learning-rate factor: linear warm-up to 1, then cosine decay to 0 at ``total_steps``.

    Args:
        warmup_steps: Steps of linear warm-up.
        total_steps: Length of the run in optimizer steps.
    """

    def __init__(self, warmup_steps: int, total_steps: int) -> None:
        self.warmup_steps = max(0, int(warmup_steps))
        self.total_steps = max(self.warmup_steps + 1, int(total_steps))

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def unit_names() -> list[str]:
    """The model's pipeline units, in order: one per stage."""
    return ["encoder", "transformer", "classifier"]


def fp32_plan() -> StagePlan:
    """The model's three-stage cut with every stage in ``"32-true"`` (for correctness checks)."""
    return StagePlan([StageSpec(modules=[name], device="cpu", precision="32-true") for name in unit_names()])


def mixed_plan() -> StagePlan:
    """The field report's plan made explicit: fp16 encoder, fp8 Transformer, bf16 classifier.

    The same stages as the decorators give, with the classifier's precision spelled out instead of
    taken from the Trainer.
    """
    precisions = [ENCODER_PRECISION, TRANSFORMER_PRECISION, CLASSIFIER_PRECISION]
    return StagePlan(
        [StageSpec(modules=[name], device="cpu", precision=p) for name, p in zip(unit_names(), precisions)]
    )
