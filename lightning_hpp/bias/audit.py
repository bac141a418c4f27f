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

Hazards (``Hazard.code``):

========================================  ============================================================
``identical_sampling_across_ranks``       ranks draw the same sequence (data parallelism adds no data)
``seed_equal_across_ranks``               same, caused by a generator seeded equally on every rank
``rank_dependent_sampler_in_wrapper``     the sampler Lightning wraps draws a different sequence per rank
``seed_differs_across_ranks``             a distributed sampler's seed differs between ranks
``duplicated_worker_streams``             dataloader workers start the same random streams on every rank
``sampler_without_set_epoch``             the sampler cannot be told the epoch (not reproducible)
``pythonhashseed_unset``                  PYTHONHASHSEED is not set
``pythonhashseed_differs``                PYTHONHASHSEED (or the resulting str hash) differs between ranks
========================================  ============================================================

Every code has a severity (:data:`SEVERITY`, shown in each message and in ``Hazard.to_dict()``):

* :data:`SKEW` — ranks, or the pipeline peers of one replica, see the wrong data: the run trains on
  something other than what the user asked for. The audit policy acts on these (``"error"`` raises).
* :data:`REPRODUCIBILITY` — the run is correct but another launch (or a resumed one) would not
  repeat it bit for bit: the hash seed, a sampler whose order no checkpoint can restore. These are
  notes (logged, not warned), acted on by the policy only when the run asked for determinism
  (``enforce_audit(..., deterministic=True)``; the guard follows ``torch``'s deterministic flag, which
  ``Trainer(deterministic=True)`` and ``BiasOptions(deterministic=True)`` set).
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
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_hpp.bias.fingerprint import HASH_PROBE, CodedBiasWarning, check_policy, format_ranks
from lightning_hpp.errors import BiasConfigError, CodedBiasError
from lightning_hpp.validation import check_int

IDENTICAL_SAMPLING = "identical_sampling_across_ranks"
SEED_EQUAL = "seed_equal_across_ranks"
WRAPPED_RANK_DEPENDENT = "rank_dependent_sampler_in_wrapper"
SEED_DIFFERS = "seed_differs_across_ranks"
WORKER_STREAMS = "duplicated_worker_streams"
NO_SET_EPOCH = "sampler_without_set_epoch"
HASHSEED_UNSET = "pythonhashseed_unset"
HASHSEED_DIFFERS = "pythonhashseed_differs"
PIPELINE_PEERS_DATA = "pipeline_peers_see_different_data"
"""The ranks of one pipeline replica draw different indices (inputs and targets of different samples)."""
PIPELINE_PEERS_WORKERS = "pipeline_peers_worker_streams_differ"
"""The ranks of one pipeline replica seed their dataloader workers differently."""

SKEW = "skew"
"""Severity: ranks or pipeline peers see the wrong data."""
REPRODUCIBILITY = "reproducibility"
"""Severity: correct now, but not repeatable by another launch or a resume."""

SEVERITY: dict[str, str] = {
    IDENTICAL_SAMPLING: SKEW,
    SEED_EQUAL: SKEW,
    WRAPPED_RANK_DEPENDENT: SKEW,
    SEED_DIFFERS: SKEW,
    WORKER_STREAMS: SKEW,
    PIPELINE_PEERS_DATA: SKEW,
    PIPELINE_PEERS_WORKERS: SKEW,
    NO_SET_EPOCH: REPRODUCIBILITY,
    HASHSEED_UNSET: REPRODUCIBILITY,
    HASHSEED_DIFFERS: REPRODUCIBILITY,
}
"""The severity of every hazard code."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hazard:
    """One finding of the audit.

    Attributes:
        code: Stable identifier (one of the module's hazard codes).
        message: What is wrong, with the evidence drawn.
        fix: What to change.
        ranks: The data-parallel ranks concerned.
    """

    code: str
    message: str
    fix: str
    ranks: tuple[int, ...] = ()

    @property
    def severity(self) -> str:
        """:data:`SKEW` or :data:`REPRODUCIBILITY`, from the code."""
        return SEVERITY[self.code]

    def blocks(self, deterministic: bool) -> bool:
        """Whether the audit policy acts on this hazard (skew always; reproducibility under determinism)."""
        return self.severity == SKEW or deterministic

    def to_dict(self) -> dict[str, Any]:
        """The hazard as plain JSON types (what the guard writes to ``bias_audit.json``)."""
        return {"code": self.code, "severity": self.severity, "message": self.message, "fix": self.fix,
                "ranks": list(self.ranks)}

    def __str__(self) -> str:
        return f"[{self.code}] ({self.severity}) {self.message} Fix: {self.fix}"


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


# ----------------------------------------------------------------------------- judgement
def analyze_audit_records(
    records: Sequence[dict[str, Any]], name: str = "dataloader", check_hash_seed: bool = True
) -> list[Hazard]:
    """Judge the records of all data-parallel ranks (pure: no communication, no drawing).

    Args:
        records: One :func:`collect_audit_record` result per rank, in rank order.
        name: How the messages call the dataloader.
        check_hash_seed: Whether to judge PYTHONHASHSEED.

    Returns:
        The hazards, in a fixed order.
    """
    hazards: list[Hazard] = []
    hazards += _identical_sampling(records, name)
    hazards += _wrapped_rank_dependent(records, name)
    hazards += _seed_differs(records, name)
    hazards += _worker_streams(records, name)
    hazards += _missing_set_epoch(records, name)
    if check_hash_seed:
        hazards += _hash_seed(records)
    return hazards


def _groups(records: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> list[list[int]]:
    """Ranks grouped by equal, non-empty ``key(record)``; only groups of two or more."""
    by: dict[str, list[int]] = {}
    for rec in records:
        value = key(rec)
        if value:
            by.setdefault(repr(value), []).append(rec["rank"])
    return [ranks for ranks in by.values() if len(ranks) > 1]


def _cross_rank_repeats(shards: Sequence[Sequence[Any]]) -> tuple[int, int]:
    """``(drawn, extra)``: indices drawn, and how many of the ranks' distinct draws repeat another rank's.

    ``extra = sum over ranks of |set(shard)| - |union of the sets|``; for shards of one permutation it
    is 0, and for shards cut from different permutations it equals the samples left unseen.
    """
    sets = [set(s) for s in shards]
    return sum(len(s) for s in shards), sum(len(s) for s in sets) - len(set().union(*sets))


def _preview(indices: Sequence[Any], k: int = 6) -> str:
    head = ", ".join(str(i) for i in indices[:k])
    return f"[{head}{', ...' if len(indices) > k else ''}]"


def _identical_sampling(records: Sequence[dict[str, Any]], name: str) -> list[Hazard]:
    out = []
    by_rank = {rec["rank"]: rec for rec in records}
    for ranks in _groups(records, lambda r: tuple(r["shard"]) if r["shard"] and r["mode"] != "wrapped" else None):
        first = by_rank[ranks[0]]
        shard, sampler, mode = first["shard"], first["sampler"], first["mode"]
        seeds = {by_rank[r]["generator_seed"] for r in ranks}
        who = format_ranks(ranks)
        if mode == "plain" and None not in seeds and len(seeds) == 1:
            out.append(Hazard(
                SEED_EQUAL,
                f"{name}: the {sampler} on {who} has a generator seeded {seeds.pop()} on each of them, "
                f"so they draw the same {len(shard)} indices in the same order {_preview(shard)}; every "
                f"replica trains on the same samples.",
                "With `use_distributed_sampler=False` the seed must differ per rank: seed the generator "
                "with `seed + rank`, or use `DistributedWeightedSampler(weights, seed=seed)`, which shards "
                "one shared sequence across ranks.",
                tuple(ranks)))
        elif mode == "distributed":
            out.append(Hazard(
                IDENTICAL_SAMPLING,
                f"{name}: the {sampler} on {who} draws the same {len(shard)} indices in the same order "
                f"{_preview(shard)}; its `rank` / `num_replicas` do not separate the ranks.",
                "Pass each rank's data-parallel `rank` and `num_replicas` to the sampler (or leave them None "
                "so they are read from torch.distributed).",
                tuple(ranks)))
        else:
            out.append(Hazard(
                IDENTICAL_SAMPLING,
                f"{name}: the {sampler} on {who} draws the identical sequence {_preview(shard)} (first "
                f"{len(shard)} indices equal); every replica trains on the same samples, so data "
                f"parallelism adds no new data and heavily weighted samples dominate every replica.",
                "Use `DistributedWeightedSampler(weights, seed=seed)`, which draws disjoint (or independent, "
                "with replacement) shards per rank; or turn `use_distributed_sampler` on and give the sampler "
                "a generator seeded identically on every rank.",
                tuple(ranks)))
    return out


def _wrapped_rank_dependent(records: Sequence[dict[str, Any]], name: str) -> list[Hazard]:
    wrapped = [r for r in records if r["mode"] == "wrapped" and r["inner"]]
    if len(wrapped) < 2 or len({tuple(r["inner"]) for r in wrapped}) == 1:
        return []
    world = wrapped[0]["world_size"]
    drawn, extra = _cross_rank_repeats([r["shard"] for r in wrapped])
    seeds = {r["rank"]: r["generator_seed"] for r in wrapped}
    seed_note = f" (generator seeds by rank: {seeds})" if any(v is not None for v in seeds.values()) else ""
    return [Hazard(
        WRAPPED_RANK_DEPENDENT,
        f"{name}: Lightning wraps the {wrapped[0]['sampler']} in `DistributedSamplerWrapper`, which gives "
        f"rank r the positions r, r+{world}, ... of the sampler's own sequence and so needs that sequence "
        f"to be the same on every rank; here it differs between ranks{seed_note}. Of the {drawn} indices "
        f"the ranks draw first, {extra} repeat an index another rank also draws (for a sampler without "
        f"replacement, as many samples go unseen).",
        "Seed the sampler's generator identically on every rank (no `+ rank`: the wrapper already "
        "shards), or use `DistributedWeightedSampler(weights, seed=seed)`, which Lightning does not wrap.",
        tuple(r["rank"] for r in wrapped))]


def _seed_differs(records: Sequence[dict[str, Any]], name: str) -> list[Hazard]:
    dist = [r for r in records if r["mode"] in ("distributed", "lightning_distributed") and r["shuffle"]]
    if len(dist) < 2 or len({r["seed"] for r in dist}) == 1:
        return []
    by_seed: dict[Any, list[int]] = {}
    for r in dist:
        by_seed.setdefault(r["seed"], []).append(r["rank"])
    seeds = " vs ".join(f"{s} ({format_ranks(rs)})" for s, rs in by_seed.items())
    drawn, extra = _cross_rank_repeats([r["shard"] or [] for r in dist])
    if dist[0]["mode"] == "lightning_distributed":
        what = (f"Lightning replaces the {dist[0]['sampler']} with a `DistributedSampler` seeded from "
                f"PL_GLOBAL_SEED, which differs between ranks: {seeds}")
        fix = ("Call `seed_everything(seed)` with the same seed on every rank (no `+ rank`); per-rank "
               "randomness in workers comes from `seed_everything(seed, workers=True)`.")
    else:
        what = f"the {dist[0]['sampler']} is seeded differently per rank: {seeds}"
        fix = ("Pass the same `seed` on every rank: a distributed sampler shuffles one shared permutation "
               "and separates the ranks by `rank` itself.")
    return [Hazard(
        SEED_DIFFERS,
        f"{name}: {what}. The ranks' shards must be disjoint, but of the {drawn} indices drawn first, "
        f"{extra} repeat an index another rank also draws, and as many samples go unseen.",
        fix, tuple(r["rank"] for r in dist))]


def _worker_streams(records: Sequence[dict[str, Any]], name: str) -> list[Hazard]:
    out = []
    for ranks in _groups(records, lambda r: r["worker_stream"]):
        rec = next(r for r in records if r["rank"] == ranks[0])
        init = f"worker_init_fn={rec['worker_init']}" if rec["worker_init"] else "no worker_init_fn"
        out.append(Hazard(
            WORKER_STREAMS,
            f"{name}: num_workers={rec['num_workers']} with {init}; worker 0 on {format_ranks(ranks)} starts "
            f"torch, random and numpy in the same state (base seed {rec['worker_base_seed']}), so random "
            f"augmentation and any sampling done in the dataset repeat across these ranks.",
            "Call `seed_everything(seed, workers=True)` before creating the Trainer (Lightning then seeds "
            "every worker from the seed, the worker id and the global rank), or pass a `worker_init_fn` "
            "that mixes the global rank into the worker's seed.",
            tuple(ranks)))
    return out


def _missing_set_epoch(records: Sequence[dict[str, Any]], name: str) -> list[Hazard]:
    hit = [r for r in records if r["epoch_check"]]
    if not hit:
        return []
    rec = hit[0]
    if rec["epoch_check"] == "repeats":
        why = "has no `set_epoch` and draws the same order every epoch"
    else:
        why = ("has no `set_epoch`: its order comes from generator state that checkpoints do not hold (two "
               "passes drew different orders here), so a resumed run does not see the order the "
               "uninterrupted run would have seen")
    return [Hazard(
        NO_SET_EPOCH,
        f"{name}: the {rec['sampler']} on {format_ranks([r['rank'] for r in hit])} {why}.",
        "Give the sampler `set_epoch(epoch)` that reseeds its generator from `(seed, epoch)` (Lightning "
        "calls it at every epoch start), or use `DistributedWeightedSampler`.",
        tuple(r["rank"] for r in hit))]


def _hash_seed(records: Sequence[dict[str, Any]]) -> list[Hazard]:
    out = []
    unset = [r["rank"] for r in records if r["pythonhashseed"] is None]
    probes = Counter(r["hash_probe"] for r in records)
    if unset:
        out.append(Hazard(
            HASHSEED_UNSET,
            f"PYTHONHASHSEED is unset on {format_ranks(unset)}: str hashes, and with them set iteration "
            f"order and any hash-based split or bucketing, change from process to process "
            f"({len(probes)} distinct hash value(s) of a probe string across {len(records)} rank(s)).",
            "Set PYTHONHASHSEED (for example `PYTHONHASHSEED=0`) in the environment that launches every "
            "rank; it must be set before the interpreter starts, so setting os.environ in the script is too late.",
            tuple(unset)))
    set_recs = [r for r in records if r["pythonhashseed"] is not None]
    values = {r["pythonhashseed"] for r in set_recs}
    if len(values) > 1:
        by: dict[str, list[int]] = {}
        for r in set_recs:
            by.setdefault(r["pythonhashseed"], []).append(r["rank"])
        shown = " vs ".join(f"{v!r} ({format_ranks(rs)})" for v, rs in by.items())
        out.append(Hazard(
            HASHSEED_DIFFERS,
            f"PYTHONHASHSEED differs between ranks: {shown}; str hashes and set order differ between them.",
            "Launch every rank with the same PYTHONHASHSEED.",
            tuple(r["rank"] for r in set_recs)))
    elif len(set_recs) > 1 and len({r["hash_probe"] for r in set_recs}) > 1:
        out.append(Hazard(
            HASHSEED_DIFFERS,
            f"PYTHONHASHSEED={set_recs[0]['pythonhashseed']!r} on every rank, yet str hashes differ between "
            f"ranks: it was set after the interpreter started, where it has no effect.",
            "Set PYTHONHASHSEED in the launching environment (shell, launcher, job spec), not in os.environ.",
            tuple(r["rank"] for r in set_recs)))
    return out
