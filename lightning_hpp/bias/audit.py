"""The data-loading audit: find coded bias in a dataloader before the first step.

Every data-parallel rank inspects its own dataloader, draws a bounded number of indices from a
fork of its sampler (the user's sampler, generators and global RNG states are left untouched),
and the ranks exchange what they drew. Every rank then judges the same evidence the same way and
returns the same list of :class:`Hazard`, each naming the problem, the ranks and the fix.

What the audit knows about Lightning (``use_distributed_sampler=True``, the default):

* a ``RandomSampler`` / ``SequentialSampler`` is replaced by a ``DistributedSampler`` seeded from
  ``PL_GLOBAL_SEED`` (set by ``seed_everything``), which must therefore be equal on every rank;
* any other sampler that is not a ``DistributedSampler`` is wrapped in
  ``DistributedSamplerWrapper``, which gives rank ``r`` the positions ``r, r + R, ...`` of the
  sampler's own sequence, so that sequence must be identical on every rank: a per-rank generator
  (``seed + rank``) makes ranks overlap and leaves samples unseen;
* a ``DistributedSampler`` (including :class:`~lightning_hpp.bias.samplers.DistributedWeightedSampler`)
  is left as it is.

With ``use_distributed_sampler=False`` every rank iterates its sampler as it is, so a sampler
without a rank-aware generator draws the same sequence on every rank.

The hazards it reports (:class:`Hazard`: their codes and severities) and the rules that find them in
the ranks' records (:func:`analyze_audit_records`) are in :mod:`lightning_hpp.bias.audit_rules`;
they are importable from here too.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import os
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_hpp.bias.audit_rules import (  # noqa: F401 - where users and tests import them from
    HASHSEED_DIFFERS,
    HASHSEED_UNSET,
    IDENTICAL_SAMPLING,
    NO_SET_EPOCH,
    PIPELINE_PEERS_DATA,
    PIPELINE_PEERS_WORKERS,
    REPRODUCIBILITY,
    SEED_DIFFERS,
    SEED_EQUAL,
    SEVERITY,
    SKEW,
    WORKER_STREAMS,
    WRAPPED_RANK_DEPENDENT,
    Hazard,
    analyze_audit_records,
)
from lightning_hpp.bias.fingerprint import HASH_PROBE, CodedBiasWarning, check_policy
from lightning_hpp.errors import BiasConfigError, CodedBiasError
from lightning_hpp.validation import check_int

_log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- public entry
def audit_dataloader(
    dataloader: Any,
    *,
    rank: int,
    world_size: int,
    dp_group: Any = None,
    use_distributed_sampler: bool,
    max_indices: int = 256,
    name: str = "dataloader",
    train: bool = True,
    check_hash_seed: bool = True,
    gather: Callable[[dict[str, Any]], Sequence[dict[str, Any]]] | None = None,
) -> list[Hazard]:
    """Audit a dataloader across the data-parallel ranks. A collective: every rank calls it.

    Args:
        dataloader: This rank's dataloader, before or after Lightning replaced its sampler.
        rank: This rank's index among the data-parallel replicas (what Lightning passes to its
            distributed sampler as ``rank``).
        world_size: Number of data-parallel replicas.
        dp_group: The data-parallel process group; ``None`` means the world.
        use_distributed_sampler: The Trainer's ``use_distributed_sampler``.
        max_indices: Indices drawn per rank (bounded, from a fork of the sampler).
        name: How the messages call this dataloader (``"train dataloader"``, ...).
        train: Training loader: also check that the sampler follows the epoch.
        check_hash_seed: Also check PYTHONHASHSEED (turn off when auditing several loaders).
        gather: Replaces the all-gather: takes this rank's record, returns every rank's record in
            rank order. ``None`` uses ``all_gather_object`` over ``dp_group``.

    Returns:
        The hazards found; the same list on every rank. Empty for a correct setup.

    Raises:
        BiasConfigError: invalid ``rank``, ``world_size`` or ``max_indices``, or ``world_size > 1``
            without an initialised process group and without ``gather``.
    """
    record = collect_audit_record(
        dataloader, rank=rank, world_size=world_size,
        use_distributed_sampler=use_distributed_sampler, max_indices=max_indices, train=train,
    )
    records = _gather(record, world_size, dp_group, gather)
    return analyze_audit_records(records, name=name, check_hash_seed=check_hash_seed)


def enforce_audit(hazards: Sequence[Hazard], policy: str, deterministic: bool = False) -> None:
    """Act on the audit's hazards according to a policy and their severity.

    Skew hazards (and, with ``deterministic``, reproducibility ones) follow the policy; the other
    reproducibility hazards are notes, logged at INFO level whatever the policy (except ``"off"``).

    Args:
        hazards: From :func:`audit_dataloader`.
        policy: ``"warn"`` emits one :class:`CodedBiasWarning` per hazard, ``"error"`` raises with
            all hazards, ``"off"`` does nothing.
        deterministic: The run asked for bitwise reproducibility: reproducibility hazards count too.

    Raises:
        CodedBiasError: ``policy == "error"`` and there is at least one hazard the policy acts on.
        BiasConfigError: ``policy`` is not one of ``"warn"``, ``"error"``, ``"off"``.
    """
    check_policy(policy, "audit policy")
    if policy == "off" or not hazards:
        return
    for h in hazards:
        if not h.blocks(deterministic):
            _log.info("coded-bias audit note: %s", h)
    hazards = [h for h in hazards if h.blocks(deterministic)]
    if not hazards:
        return
    if policy == "error":
        lines = "\n".join(f"  - {h}" for h in hazards)
        raise CodedBiasError(
            f"The data-loading audit found {len(hazards)} coded-bias hazard(s):\n{lines}\n"
            f"Fix them, or set the audit policy to 'warn' to train anyway."
        )
    for h in hazards:
        warnings.warn(str(h), CodedBiasWarning, stacklevel=2)


# ----------------------------------------------------------------------------- per-rank record
def collect_audit_record(
    dataloader: Any,
    *,
    rank: int,
    world_size: int,
    use_distributed_sampler: bool,
    max_indices: int = 256,
    train: bool = True,
) -> dict[str, Any]:
    """What this rank's dataloader draws, as a small picklable record (no communication).

    The sampler is forked before drawing and the global ``torch`` / ``random`` / ``numpy`` states
    are restored afterwards, so training later sees exactly what it would have seen.

    Args:
        dataloader: This rank's dataloader.
        rank: This rank's data-parallel rank.
        world_size: Number of data-parallel replicas.
        use_distributed_sampler: The Trainer's ``use_distributed_sampler``.
        max_indices: Indices drawn for this rank.
        train: Whether this is a training loader.

    Returns:
        The record that :func:`analyze_audit_records` compares across ranks.

    Raises:
        BiasConfigError: invalid ``rank``, ``world_size`` or ``max_indices``.
    """
    for label, value, low in (("world_size", world_size, 1), ("max_indices", max_indices, 1), ("rank", rank, 0)):
        check_int(value, label, minimum=low, error=BiasConfigError)
    if rank >= world_size:
        raise BiasConfigError(
            f"`rank={rank}` is out of range for `world_size={world_size}`; use [0, {world_size - 1}]."
        )

    rec: dict[str, Any] = {
        "rank": rank, "world_size": world_size, "train": train,
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"), "hash_probe": hash(HASH_PROBE),
        "mode": None, "sampler": None, "shard": None, "inner": None, "seed": None, "shuffle": None,
        "generator_seed": None, "epoch_check": None, "num_workers": int(getattr(dataloader, "num_workers", 0) or 0),
        "worker_stream": None, "worker_base_seed": None, "worker_init": None,
    }
    dataset = getattr(dataloader, "dataset", None)
    sampler = _effective_sampler(dataloader)
    rec["sampler"] = type(sampler).__qualname__ if sampler is not None else None

    with _preserved_rng():
        if sampler is not None and not isinstance(dataset, IterableDataset):
            _record_sampling(rec, sampler, dataset, rank, world_size, use_distributed_sampler, max_indices)
        if rec["num_workers"] > 0:
            _record_worker_stream(rec, dataloader, rank)
    return rec


def _effective_sampler(dataloader: Any) -> Any:
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is not None:
        return getattr(batch_sampler, "sampler", batch_sampler)
    return getattr(dataloader, "sampler", None)


def _wrapper_types() -> tuple[type, ...]:
    try:
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
        from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
    except ImportError:  # Lightning absent: nothing can have wrapped the sampler
        return ()
    return (DistributedSamplerWrapper, UnrepeatedDistributedSamplerWrapper)


def _record_sampling(
    rec: dict[str, Any], sampler: Any, dataset: Any, rank: int, world_size: int,
    use_distributed_sampler: bool, n: int,
) -> None:
    wrappers = _wrapper_types()
    epoch_target = None
    if wrappers and isinstance(sampler, wrappers):
        inner = sampler.dataset._sampler
        rec.update(mode="wrapped", sampler=type(inner).__qualname__)
        rec["inner"] = _draw(inner, n * world_size)
        rec["shard"] = _draw(sampler, n)
        rec["generator_seed"] = _generator_seed(inner)
        epoch_target = inner
    elif isinstance(sampler, DistributedSampler):
        rec.update(mode="distributed", seed=getattr(sampler, "seed", None),
                   shuffle=bool(getattr(sampler, "shuffle", True)))
        rec["shard"] = _draw(sampler, n)
    elif use_distributed_sampler and isinstance(sampler, (RandomSampler, SequentialSampler)):
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        shuffle = isinstance(sampler, RandomSampler)
        rec.update(mode="lightning_distributed", seed=seed, shuffle=shuffle)
        if hasattr(dataset, "__len__"):
            ds = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
            rec["shard"] = _draw(ds, n)
    elif use_distributed_sampler:
        rec["mode"] = "wrapped"
        rec["inner"] = _draw(sampler, n * world_size)
        rec["shard"] = rec["inner"][rank::world_size][:n]
        rec["generator_seed"] = _generator_seed(sampler)
        epoch_target = sampler
    else:
        rec["mode"] = "plain"
        rec["shard"] = _draw(sampler, n)
        rec["generator_seed"] = _generator_seed(sampler)
        epoch_target = sampler
    if rec["train"] and epoch_target is not None and not callable(getattr(epoch_target, "set_epoch", None)):
        if not isinstance(epoch_target, SequentialSampler):
            first, second = _draw(epoch_target, n, passes=2)
            if first != second:
                rec["epoch_check"] = "varies"
            elif first != list(range(len(first))):
                rec["epoch_check"] = "repeats"


def _generator_seed(sampler: Any) -> int | None:
    g = getattr(sampler, "generator", None)
    return int(g.initial_seed()) if isinstance(g, torch.Generator) else None


def _record_worker_stream(rec: dict[str, Any], dataloader: Any, rank: int) -> None:
    """Reproduce how worker 0 of this rank seeds itself, then draw from its three RNGs."""
    base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=dataloader.generator).item())
    init_fn = dataloader.worker_init_fn
    rec["worker_init"] = getattr(init_fn, "__qualname__", type(init_fn).__qualname__) if init_fn else None
    if init_fn is None and int(os.environ.get("PL_SEED_WORKERS", 0)):
        from lightning.fabric.utilities.seed import pl_worker_init_function

        global_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else rank
        init_fn = functools.partial(pl_worker_init_function, rank=global_rank)
        rec["worker_init"] = "pl_worker_init_function"
    worker_id = 0
    random.seed(base_seed + worker_id)
    torch.manual_seed(base_seed + worker_id)
    try:
        from torch.utils.data._utils.worker import _generate_state

        np.random.seed(_generate_state(base_seed, worker_id))
    except ImportError:  # private helper moved: numpy then starts from a seed derived the same way
        np.random.seed((base_seed + worker_id) % 2**32)
    if init_fn is not None:
        try:
            init_fn(worker_id)
        except Exception:
            # Outside a worker process (no worker info) some init functions fail; their effect
            # cannot be reproduced here, so the audit does not judge them.
            return
    rec["worker_base_seed"] = base_seed
    rec["worker_stream"] = (
        int(torch.randint(0, 2**62, (1,)).item()), random.getrandbits(62), int(np.random.randint(0, 2**62)),
    )


@contextlib.contextmanager
def _preserved_rng() -> Iterator[None]:
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _fork(obj: Any, depth: int = 3) -> Any:
    """Shallow copy with private copies of every generator and nested sampler it holds."""
    try:
        clone = copy.copy(obj)
    except Exception:
        return obj
    attrs = getattr(clone, "__dict__", None)
    if attrs is None:
        return clone
    for key, value in list(attrs.items()):
        if isinstance(value, torch.Generator):
            g = torch.Generator(device=value.device)
            g.set_state(value.get_state())
            attrs[key] = g
        elif isinstance(value, (np.random.Generator, np.random.RandomState, random.Random)):
            attrs[key] = copy.deepcopy(value)
        elif depth > 0 and (isinstance(value, Sampler) or hasattr(value, "_sampler")):
            attrs[key] = _fork(value, depth - 1)
    return clone


def _flat(items: Iterator[Any]) -> Iterator[Any]:
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from item
        else:
            yield item


def _draw(sampler: Any, n: int, passes: int = 1) -> Any:
    """The first ``n`` indices of a fork of ``sampler`` (``passes`` consecutive iterations)."""
    fork = _fork(sampler)
    out = []
    for _ in range(passes):
        out.append([_plain(i) for i in itertools.islice(_flat(iter(fork)), n)])
    return out[0] if passes == 1 else out


def _plain(index: Any) -> Any:
    if isinstance(index, torch.Tensor) and index.numel() == 1:
        return int(index.item())
    if isinstance(index, (np.integer,)):
        return int(index)
    return index


def _gather(record: dict[str, Any], world_size: int, group: Any, gather: Callable | None) -> list[dict[str, Any]]:
    if gather is not None:
        records = list(gather(record))
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        size = torch.distributed.get_world_size(group)
        if size != world_size:
            raise BiasConfigError(
                f"`world_size={world_size}` but the data-parallel group has {size} ranks; pass the "
                f"size of `dp_group` (or the world size when `dp_group` is None)."
            )
        records = [None] * size
        torch.distributed.all_gather_object(records, record, group=group)
    elif world_size == 1:
        records = [record]
    else:
        raise BiasConfigError(
            f"`world_size={world_size}` but torch.distributed is not initialised, so the ranks cannot "
            f"be compared; call the audit after the process group exists or pass `gather=`."
        )
    if len(records) != world_size:
        raise BiasConfigError(f"`gather` returned {len(records)} records for `world_size={world_size}`.")
    return records
