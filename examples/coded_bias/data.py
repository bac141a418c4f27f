"""The data of the coded-bias example: class-imbalanced digits and the three ways to sample them.

The training split of scikit-learn's digits (bundled with the package, no download) keeps every
image of the digits 0-4 but only 10% of the digits 5-9, so a plain sampler would show the rare
digits ten times less often. Class-balancing weights (``1 / count of the sample's class``) make a
weighted sampler draw every digit about equally often; that is what ``WeightedRandomSampler`` is
for, and where the field report's bug lives.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Sampler, TensorDataset, WeightedRandomSampler

from lightning_hpp.bias.samplers import DistributedWeightedSampler
from lightning_hpp.examples_data.digits import PIXEL_MAX, load_digits_arrays, split_indices

RARE_CLASSES = (5, 6, 7, 8, 9)
RARE_KEEP = 0.10
"""Fraction of the rare digits' training images that are kept."""
VAL_SIZE = 384

SAMPLINGS = ("bug", "report_fix", "fix")
"""``bug``: the field report's ``WeightedRandomSampler`` without a generator and
``use_distributed_sampler=False``; ``report_fix``: its fix, a generator seeded ``seed + rank``, which
Lightning wraps in ``DistributedSamplerWrapper``; ``fix``: ``DistributedWeightedSampler``."""

LABELS = {
    "bug": "bug: WeightedRandomSampler, no generator",
    "report_fix": "report's fix: generator seed + rank",
    "fix": "fix: DistributedWeightedSampler",
}


class ExampleConfigError(ValueError):
    """An example setting that cannot work; the message names the value and the fix."""


def imbalanced_digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Training and validation sets as flat, standardised 64-pixel vectors.

    Args:
        seed: Seed of the split and of which rare images are kept.

    Returns:
        ``(train, val)``: the imbalanced training set and the stratified (balanced) validation set.
    """
    images, labels = load_digits_arrays()
    train_idx, val_idx = split_indices(labels, VAL_SIZE, seed)
    rng = np.random.default_rng(seed)
    keep = np.array([i for i in train_idx if labels[i] not in RARE_CLASSES or rng.random() < RARE_KEEP])
    x = images.reshape(len(images), -1) / PIXEL_MAX
    mean, std = x[keep].mean(), x[keep].std()
    x = torch.from_numpy((x - mean) / std).float()
    y = torch.from_numpy(labels)
    return TensorDataset(x[keep], y[keep]), TensorDataset(x[val_idx], y[val_idx])


def class_balancing_weights(labels: torch.Tensor) -> torch.Tensor:
    """One weight per sample, ``1 / (number of samples of its class)``: every class equally likely."""
    counts = torch.bincount(labels)
    return 1.0 / counts[labels].double()


def make_sampler(kind: str, weights: torch.Tensor, seed: int, dp: int, global_rank: int) -> tuple[Sampler, bool]:
    """The sampler of one configuration and the ``use_distributed_sampler`` it runs with.

    All three draw one epoch's worth of samples per data-parallel replica (``len(weights) / dp``).

    Args:
        kind: One of :data:`SAMPLINGS`.
        weights: Per-sample weights.
        seed: The run's seed.
        dp: Number of data-parallel replicas.
        global_rank: This process's global rank (what the field report's fix adds to the seed).

    Returns:
        ``(sampler, use_distributed_sampler)``.

    Raises:
        ExampleConfigError: an unknown ``kind``.
    """
    n = len(weights)
    if kind == "bug":
        return WeightedRandomSampler(weights, num_samples=n // dp), False
    if kind == "report_fix":
        g = torch.Generator().manual_seed(seed + global_rank)
        return WeightedRandomSampler(weights, num_samples=n, generator=g), True
    if kind == "fix":
        return DistributedWeightedSampler(weights, seed=seed), True
    raise ExampleConfigError(f"Unknown sampling {kind!r}; use one of {', '.join(SAMPLINGS)}.")
