"""The audit's hazards and the rules that judge the ranks' records: what :mod:`lightning_hpp.bias.audit` reports.

:mod:`~lightning_hpp.bias.audit` collects a record per rank (what its sampler draws, its seeds, its
workers' streams) and gathers them; :func:`analyze_audit_records` here judges the gathered records
(pure: no communication, no drawing), so every rank reaches the same list of :class:`Hazard`. They
were split from the collecting side to keep each module to one concept; both are importable from
:mod:`lightning_hpp.bias.audit` as before.

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

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_hpp.bias.fingerprint import format_ranks

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
