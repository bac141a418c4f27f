"""How the losses of a training step's micro-batches make the step's loss.

By default each micro-batch counts equally: the step's loss is the mean of the micro-batches' losses, and
each micro-batch's backward starts from ``1 / n_microbatches``. That is one process's loss for a loss
averaged over samples (every micro-batch holds as many samples), and it is what the pipeline does unless
told otherwise.

A loss averaged over something else (the batch's tokens, with padding or ``ignore_index`` left out) is not the
mean of the micro-batches' means when micro-batches hold different numbers of tokens. With
``HPPStrategy(loss_weight=fn)`` the user says over how many units each (micro-)batch's loss averages
(``fn(batch)``, e.g. ``(batch["labels"] != -100).sum()``), and :class:`LossWeights` weighs the micro-batches by
them: the step's loss is ``Σ w_i loss_i / Σ w_i`` and micro-batch ``i``'s backward starts from
``w_i · dp / W``, where ``W`` sums the weights of every replica's micro-batches (one all-reduce of one value
over the last stage's data-parallel group). Once the replicas' gradients are averaged, the gradient is that
of the mean over the whole global batch's units, as one process computes it on that batch (as
Megatron-Core's per-token loss and torchtitan's global token count do). Plain DDP averages the replicas' own
means instead; with equal token counts the two agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_hpp._dist import group_device
from lightning_hpp.errors import PlanError


def _count(value: Any, fn: Callable[..., Any], device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64, device=device)
    raise PlanError(
        f"`HPPStrategy(loss_weight={getattr(fn, '__name__', fn)!r})` returned {value!r} for a micro-batch; it must "
        f"give the number of units (tokens) the step's loss averages over in that batch: a number or a one-element "
        f"tensor, e.g. `lambda batch: (batch['labels'] != -100).sum()`.")


class LossWeights:
    """The micro-batches of a training step weighted by ``weight(micro_batch)``.

    Args:
        weight: ``batch -> number of units`` (a number or a one-element tensor) the step's loss averages over.
        dp_group: The data-parallel group of the last stage (its replicas); ``dp`` its size.
    """

    def __init__(self, weight: Callable[[Any], Any], dp_group: Any = None, dp: int = 1) -> None:
        if not callable(weight):
            raise PlanError(f"`HPPStrategy(loss_weight={weight!r})` must be a function of a batch giving the number "
                            f"of units (tokens) its loss averages over, e.g. "
                            f"`lambda batch: (batch['labels'] != -100).sum()`.")
        self.weight, self.dp_group, self.dp = weight, dp_group, dp
        self._weights: torch.Tensor | None = None
        self._seeds: torch.Tensor | None = None

    def start(self, microbatches: list[Any], scale: float, device: torch.device) -> None:
        """Weigh one step's micro-batches (collective over the data-parallel group when ``dp > 1``).

        ``scale`` multiplies every backward's start (the fp16 loss scale over the accumulation steps)."""
        weights = torch.stack([_count(self.weight(mb), self.weight, device) for mb in microbatches])
        total = weights.sum()
        if self.dp > 1:
            comm = group_device(self.dp_group)
            moved = total.to(comm)
            dist.all_reduce(moved, group=self.dp_group)
            total = moved.to(device)
        self._weights = weights
        self._seeds = (weights * (scale * self.dp) / total).float()

    def seed(self, loss: torch.Tensor, microbatch: int) -> torch.Tensor:
        """The gradient micro-batch ``microbatch``'s backward starts from, in the loss's dtype and shape."""
        assert self._seeds is not None, "LossWeights.seed before start"
        grad = self._seeds[microbatch].to(loss.dtype)
        return grad if loss.dim() == 0 else grad.reshape(loss.shape)

    def combine(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The step's loss: the micro-batches' losses weighted, over this replica's units."""
        assert self._weights is not None, "LossWeights.combine before start"
        stacked = torch.stack([x.double().reshape(()) for x in losses])
        return ((stacked * self._weights).sum() / self._weights.sum()).float()


def step_loss(losses: list[torch.Tensor], weights: LossWeights | None) -> torch.Tensor:
    """The step's loss from its micro-batches' losses: their mean, or weighted by ``weights``."""
    if weights is None:
        return torch.stack([x.float() for x in losses]).mean()
    return weights.combine(losses)
