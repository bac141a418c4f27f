"""Data for a pipeline: every stage of one replica must see the same batches.

* :func:`shard_over_replicas` points a user's own ``DistributedSampler`` (Lightning leaves those
  alone) at the data-parallel replicas instead of at all ranks, so the pipeline peers of one replica
  draw the same indices;
* :func:`seed_workers_per_replica` gives dataloader workers seeds derived from the replica, not
  the global rank (the stages of one replica then get the same random augmentations);
* :func:`rebatch` makes a loader's batches smaller in place, when ``plan="auto"`` spreads one
  step's batch over more replicas than the plan it replaced;
* :func:`peek_batch` takes one real batch from a loader without moving any RNG, for the setup
  checks that need a real micro-batch;
* :func:`resume_mid_epoch` makes a train loader start where a mid-epoch checkpoint left its epoch;
* :func:`loaders_once` takes a loop's loaders for the setup without calling its ``*_dataloader`` hook twice.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import BatchSampler, DistributedSampler

from lightning_hpp.errors import MicroBatchError


def _sampler_of(dataloader: Any) -> Any:
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None) or getattr(dataloader, "sampler", None)


def shard_over_replicas(dataloader: Any, dp: int, replica: int) -> None:
    """Make a ``DistributedSampler`` inside ``dataloader`` shard over ``dp`` replicas (in place)."""
    sampler = _sampler_of(dataloader)
    if not isinstance(sampler, DistributedSampler) or (sampler.num_replicas, sampler.rank) == (dp, replica):
        return
    sampler.rank = replica  # first: dp <= world, so the rank stays valid throughout
    sampler.num_replicas = dp
    if type(sampler) is DistributedSampler:  # subclasses such as DistributedWeightedSampler derive sizes lazily
        n = len(sampler.dataset)
        if sampler.drop_last and n % dp:
            sampler.num_samples = math.ceil((n - dp) / dp)
        else:
            sampler.num_samples = math.ceil(n / dp)
        sampler.total_size = sampler.num_samples * dp


def can_rebatch(dataloader: Any) -> bool:
    """Whether :func:`rebatch` can make ``dataloader``'s batches smaller (it batches with torch's ``BatchSampler``)."""
    return isinstance(getattr(dataloader, "batch_sampler", None), BatchSampler)


def rebatch(dataloader: Any, parts: int) -> None:
    """Make every batch of ``dataloader`` ``1 / parts`` of the size it was built with (in place, idempotent).

    Raises:
        MicroBatchError: the loader batches with something other than torch's ``BatchSampler``, or
            its batch size is not divisible by ``parts``.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    full = getattr(batch_sampler, "_hpp_full_batch", getattr(batch_sampler, "batch_size", None))
    if parts == 1 and full == getattr(batch_sampler, "batch_size", None):
        return
    if not isinstance(batch_sampler, BatchSampler) or not isinstance(full, int) or full % parts:
        raise MicroBatchError(
            f"plan='auto' spreads each batch over {parts}x more replicas, so the DataLoader's batches must become "
            f"{parts}x smaller, but its batch sampler is {type(batch_sampler).__name__} with batch size {full!r}. "
            f"Use a DataLoader with `batch_size=` divisible by {parts}, or fix `HPPStrategy(pp_degree=...)`."
        )
    batch_sampler._hpp_full_batch = full
    batch_sampler.batch_size = full // parts


def seed_workers_per_replica(dataloader: Any, init_fn: Any) -> None:
    """Give the workers of ``dataloader`` the replica's ``init_fn`` (a ``worker_init_fn`` seeded by the
    replica, e.g. :func:`lightning_hpp.bias.determinism.worker_init_fn`), unless the user set one."""
    if getattr(dataloader, "num_workers", 0) > 0 and getattr(dataloader, "worker_init_fn", False) is None:
        dataloader.worker_init_fn = init_fn


def first_loader(loaders: Any) -> Any:
    """The first dataloader of what a Lightning data source returns (a loader, list or dict)."""
    if isinstance(loaders, dict):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


def peek_batch(loader: Any) -> Any:
    """One batch of ``loader`` (``None`` if it is empty), with every RNG left as it was."""
    if loader is None:
        return None
    with isolate_rng():
        it = iter(loader)
        try:
            return next(it)
        except StopIteration:
            return None
        finally:
            del it


class SkipFirst:
    """A sampler that skips its first ``n`` indices once (a mid-epoch resume), then is itself.

    That once it draws the order of ``epoch`` (the checkpoint's): Lightning sets a resumed loader's epoch
    from the epochs it counts processed, one more than the epoch trained when ``max_steps`` ended it.
    """

    def __init__(self, sampler: Any, n: int, epoch: int | None = None) -> None:
        self.sampler = sampler
        self.n = n
        self.epoch = epoch

    def __iter__(self):
        if self.n and self.epoch is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        it = iter(self.sampler)
        n, self.n = self.n, 0
        for _ in range(n):
            next(it, None)
        return it

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "sampler" or name.startswith("__"):  # not set yet (copy.copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)


def resume_mid_epoch(dataloader: Any, batches: int, epoch: int) -> bool:
    """Make ``dataloader`` start its next iteration ``batches`` batches into epoch ``epoch`` (in place).

    It must run before the loader's iterator exists: an iterator with workers (``num_workers > 0``)
    draws its first sampler indices when it is created (to prefetch), and Lightning creates the
    train iterator before ``on_train_start``. So the sampler is set to the resumed epoch (a
    ``DistributedSampler`` shuffles by epoch) and told to skip the consumed batches here, when the
    loader is handed to the strategy.

    Returns:
        Whether the loader has a batch sampler to do this with.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is None or not hasattr(batch_sampler, "sampler") or not getattr(batch_sampler, "batch_size", None):
        return False
    sampler = batch_sampler.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    batch_sampler.sampler = SkipFirst(sampler, batches * batch_sampler.batch_size, epoch)
    return True


def loaders_once(source: Any) -> Any:
    """The loaders of a Lightning loop's data source, asked for once: Lightning's next ``dataloader()`` call (its data
    set-up,
    right after ``setup``) gets the same object instead of calling the ``*_dataloader`` hook a second time."""
    loaders = source.dataloader()

    def once() -> Any:
        del source.dataloader  # the class's method again
        return loaders

    source.dataloader = once
    return loaders
