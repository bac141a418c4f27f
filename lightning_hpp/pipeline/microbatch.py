"""Splitting a batch into micro-batches along dim 0 of every tensor it holds.

Batches may be tensors and the containers Lightning moves to the device (mappings, tuples and
named tuples, lists, non-frozen dataclasses, subclasses of each kept as such) nested in any way;
non-tensor leaves (strings, numbers, None) are given to every micro-batch unchanged. The split is into equal contiguous
chunks,
the same cut torch pipelining makes of the first stage's input, so micro-batch ``i`` of the batch
and micro-batch ``i`` of the pipeline input hold the same samples.

The batch is walked with Lightning's ``apply_to_collection`` (as Lightning walks it to move it to the
device), not torch pipelining's ``split_args_kwargs_into_chunks``: that one, through ``torch.utils._pytree``,
keeps a dict, list or tuple subclass whole in every micro-batch and silently makes fewer chunks of a small batch.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_hpp.errors import MicroBatchError


def _tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found


def batch_size_of(batch: Any) -> int:
    """The size of dim 0 shared by every tensor of ``batch``.

    Raises:
        MicroBatchError: the batch holds no tensor, a 0-d tensor, or tensors of different sizes.
    """
    tensors = _tensors(batch)
    if not tensors:
        raise MicroBatchError(
            f"The batch ({type(batch).__name__}) holds no tensor, so it cannot be split into micro-batches. "
            f"Return tensors (or tuples/lists/dicts of tensors) from the dataloader."
        )
    sizes = {tuple(t.shape[:1]) for t in tensors}
    if () in sizes:
        raise MicroBatchError("The batch holds a 0-d tensor; every tensor needs a batch dimension (dim 0) to be split.")
    if len(sizes) != 1:
        raise MicroBatchError(
            f"The batch's tensors have different sizes along dim 0: {sorted(s[0] for s in sizes)}; every tensor "
            f"of a batch must share its batch dimension to be split into micro-batches."
        )
    return next(iter(sizes))[0]


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split ``batch`` into ``n`` micro-batches of equal size along dim 0.

    Raises:
        MicroBatchError: when the batch size is not divisible by ``n``.
    """
    size = batch_size_of(batch)
    if size % n != 0:
        raise MicroBatchError(
            f"Batch size {size} is not divisible by n_microbatches={n}. Use a batch size that is a multiple of "
            f"{n} (and `drop_last=True` in the training DataLoader so the last batch is not smaller), or change "
            f"`HPPStrategy(n_microbatches=...)`."
        )
    chunk = size // n
    return [apply_to_collection(batch, torch.Tensor, lambda t, i=i: t[i * chunk : (i + 1) * chunk]) for i in range(n)]


def largest_divisor_at_most(size: int, limit: int) -> int:
    """The largest ``d <= limit`` that divides ``size`` (used for forward-only passes)."""
    for d in range(min(limit, size), 0, -1):
        if size % d == 0:
            return d
    return 1
