"""The heterogeneity-aware partitioner behind ``plan="auto"``.

Given a :class:`~lightning_hpp.planning.profile.CostProfile`, the devices available (a :class:`Cluster`:
count, memory and link speed per device kind), the schedule and the micro-batch count,
:func:`partition` chooses the contiguous cuts, the device kind (and precision) of every stage and,
optionally, the pipeline and data-parallel degrees, minimising the predicted step time

    step = (m + p - 1) * max_s t_s + max_s a_s          (GPipe and 1F1B)

where ``m`` is the number of micro-batches per replica, ``p`` the number of stages,
``t_s`` the per-micro-batch time of stage ``s`` (forward+backward of its units on its kind, plus
sending its output activation and its input gradient over the link, not overlapped) and ``a_s`` the
ring all-reduce of its gradients over ``dp`` replicas (0 when ``dp == 1``). Each stage must fit its
device's memory: ``params * (1 + optimizer_factor) + in_flight * activations``, where
``in_flight`` is ``m`` for GPipe and ``min(m, p - s)`` for 1F1B and ``activations`` is the memory a
micro-batch keeps for the backward (the profile's ``saved_bytes``, else its ``activation_bytes``).

The search is exact. For fixed ``(p, dp)`` a dynamic programme over (units placed, stages placed,
stages used per kind) minimises ``max_s t_s``; the all-reduce term is handled by enumerating the
levels of its threshold (each level is one constrained programme), and the outer loop enumerates
``p`` and ``dp``. Tests check it against brute force.

Costs for a kind the profile has not measured are scaled from another kind by the ratio of the
datasheet TFLOP/s in :data:`~lightning_hpp.planning.devices.DEVICE_SPECS`; the result says so per stage.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

from lightning_hpp.errors import PartitionError, PlacementError
from lightning_hpp.pipeline.schedules import SCHEDULES
from lightning_hpp.planning.devices import (
    DEVICE_SPECS,
    assign_ranks,
    normalize_kind,
    precision_preference,
    stage_kind_orders,
    supports_fp8,
)
from lightning_hpp.planning.memory import describe_memory, stage_memory_bytes
from lightning_hpp.planning.plan import StagePlan, StageSpec, normalize_precision
from lightning_hpp.planning.profile import CostProfile, Overheads
from lightning_hpp.validation import check_int

MODELLED_SCHEDULES = tuple(name for name, kind in SCHEDULES.items() if kind.cls in (ScheduleGPipe, Schedule1F1B))
"""Schedules the partitioner models (torch's GPipe and 1F1B): one stage per rank, bubble (p - 1) / (m + p - 1)."""

# our names and torch's class names, lower case: "1f1b" and "schedule1f1b" are the same schedule
_SCHEDULE_ALIASES = {alias: name for name in MODELLED_SCHEDULES
                     for alias in (name, SCHEDULES[name].cls.__name__.lower())}

DEFAULT_LINK_GBPS = 25.0
"""Assumed link speed per device for stage boundaries and gradient all-reduce (200 Gb/s InfiniBand)."""

_PRECISION_CLASS = {
    "32-true": "fp32",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "fp8": "fp8",
}

_INF = math.inf


# ---------------------------------------------------------------------------- the cluster
@dataclass(frozen=True)
class DeviceGroup:
    """Devices of one kind.

    Attributes:
        kind: Device kind (``"a100"``, ``"h100"``, ``"cpu"``, ...).
        count: Number of devices.
        memory_bytes: Memory per device; ``None`` takes the datasheet value of a known kind and
            means "no limit" for ``cpu`` and unknown kinds.
        link_gbps: GB/s each device sends at (stage boundaries, gradient all-reduce).
    """

    kind: str
    count: int
    memory_bytes: float | None = None
    link_gbps: float = DEFAULT_LINK_GBPS

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", normalize_kind(self.kind, "cluster device kind"))
        check_int(self.count, f"DeviceGroup({self.kind!r}, count=...)", minimum=0, error=PartitionError)
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise PartitionError(f"Memory {self.memory_bytes!r} for kind {self.kind!r} must be > 0 bytes (or None).")
        if not self.link_gbps > 0:
            raise PartitionError(f"link_gbps {self.link_gbps!r} for kind {self.kind!r} must be > 0.")

    @property
    def memory_limit(self) -> float:
        """Memory per device in bytes (``inf`` when unlimited)."""
        if self.memory_bytes is not None:
            return float(self.memory_bytes)
        spec = DEVICE_SPECS.get(self.kind)
        return spec.memory_gb * 1e9 if spec else _INF


_GROUP_RE = re.compile(r"^(?P<count>\d+)\s*[x*]\s*(?P<kind>[A-Za-z0-9_.-]+?)(?::(?P<mem>[0-9.]+)\s*(?:gb)?)?$", re.I)


@dataclass
class Cluster:
    """The devices a plan may use, by kind.

    Build one from a string ``"128xa100,128xh100"`` (``"2xa100:40"`` sets 40 GB of memory), a
    mapping ``{"a100": 128, "h100": 128}``, or a list of :class:`DeviceGroup`.
    """

    groups: list[DeviceGroup]

    def __post_init__(self) -> None:
        kinds = [g.kind for g in self.groups]
        dup = sorted({k for k in kinds if kinds.count(k) > 1})
        if dup:
            raise PartitionError(f"Cluster lists kind(s) {dup} more than once; give each kind once with its count.")

    @classmethod
    def parse(cls, spec: Cluster | str | Mapping[str, int] | Sequence[DeviceGroup], link_gbps: float | None = None) -> Cluster:
        """Build a cluster from any accepted description.

        Args:
            spec: The description (see the class docstring).
            link_gbps: Link speed for every group that does not set its own.

        Raises:
            PartitionError: an unreadable description.
        """
        link = DEFAULT_LINK_GBPS if link_gbps is None else link_gbps
        if isinstance(spec, Cluster):
            return spec
        if isinstance(spec, str):
            groups = []
            for item in filter(None, (p.strip() for p in spec.split(","))):
                m = _GROUP_RE.match(item)
                if not m:
                    raise PartitionError(
                        f"Cluster entry {item!r} (in {spec!r}) is not 'COUNTxKIND' or 'COUNTxKIND:MEMORY_GB'; "
                        f"write for example '128xa100,128xh100' or '2xa100:40'."
                    )
                mem = float(m["mem"]) * 1e9 if m["mem"] else None
                groups.append(DeviceGroup(m["kind"], int(m["count"]), mem, link))
            if not groups:
                raise PartitionError(f"Cluster {spec!r} names no devices; write for example '128xa100,128xh100'.")
            return cls(groups)
        if isinstance(spec, Mapping):
            return cls([DeviceGroup(k, n, None, link) for k, n in spec.items()])
        if isinstance(spec, Sequence):
            return cls([g if isinstance(g, DeviceGroup) else DeviceGroup(**g) for g in spec])
        raise PartitionError(f"Cluster {spec!r} must be a string, a mapping kind->count or a list of DeviceGroup.")

    @classmethod
    def from_rank_kinds(
        cls, rank_kinds: Sequence[str], memory_bytes: Mapping[str, float] | None = None, link_gbps: float = DEFAULT_LINK_GBPS
    ) -> Cluster:
        """The cluster formed by the ranks of a job, from each rank's kind."""
        memory_bytes = dict(memory_bytes or {})
        counts: dict[str, int] = {}
        for k in rank_kinds:
            counts[k] = counts.get(k, 0) + 1
        return cls([DeviceGroup(k, n, memory_bytes.get(k), link_gbps) for k, n in counts.items()])

    @property
    def kinds(self) -> list[str]:
        return [g.kind for g in self.groups]

    @property
    def total(self) -> int:
        return sum(g.count for g in self.groups)

    def group(self, kind: str) -> DeviceGroup | None:
        return next((g for g in self.groups if g.kind == kind), None)

    def describe(self) -> str:
        return ", ".join(f"{g.count}x{g.kind}" for g in self.groups)


# ---------------------------------------------------------------------------- costs per kind
@dataclass
class KindCosts:
    """Per-unit cost arrays of one (kind, precision), with prefix sums for segment queries."""

    kind: str
    precision: str
    source: str
    step_ms: np.ndarray
    param_bytes: np.ndarray
    activation_bytes: np.ndarray
    stash_bytes: np.ndarray
    fixed_ms: np.ndarray | None = None
    overheads: Overheads | None = None
    fwd_ms: np.ndarray | None = None  # the forward's part of step_ms (default: a third)

    def __post_init__(self) -> None:
        z = np.zeros(1)
        if self.fixed_ms is None:
            self.fixed_ms = np.zeros(len(self.step_ms))
        if self.fwd_ms is None:
            self.fwd_ms = np.asarray(self.step_ms, dtype=float) / 3
        self._w = np.concatenate([z, np.cumsum(self.step_ms)])
        self._f = np.concatenate([z, np.cumsum(self.fixed_ms)])
        self._p = np.concatenate([z, np.cumsum(self.param_bytes)])
        self._s = np.concatenate([z, np.cumsum(self.stash_bytes)])

    @property
    def n(self) -> int:
        return len(self.step_ms)

    def compute_ms(self, i: int, j: int) -> float:
        return float(self._w[j] - self._w[i])

    def params(self, i: int, j: int) -> float:
        return float(self._p[j] - self._p[i])

    def stash(self, i: int, j: int) -> float:
        return float(self._s[j] - self._s[i])

    def comm_bytes(self, i: int, j: int) -> float:
        """Bytes the stage holding units ``[i, j)`` sends per micro-batch: output and input gradient."""
        out = self.activation_bytes[j - 1] if j < self.n else 0.0
        grad_in = self.activation_bytes[i - 1] if i > 0 else 0.0
        return float(out + grad_in)

    def matrices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(compute_ms, comm_bytes, param_bytes, stash_bytes)`` for every segment ``[i, j)``, shape (n+1, n+1)."""
        n = self.n
        comp = self._w[None, :] - self._w[:, None]
        params = self._p[None, :] - self._p[:, None]
        stash = self._s[None, :] - self._s[:, None]
        act = np.asarray(self.activation_bytes, dtype=float)
        out = np.zeros(n + 1)
        out[1:n] = act[: n - 1]  # j in 1..n-1: send unit j-1's output; j == n: last stage sends nothing
        grad_in = np.zeros(n + 1)
        grad_in[1:] = act  # i >= 1: send the gradient of unit i-1's output
        comm = grad_in[:, None] + out[None, :]
        return comp, comm, params, stash


def _from_entry(entry, source: str, scale: float = 1.0) -> KindCosts:
    return KindCosts(
        kind=entry.device_kind,
        precision=entry.precision,
        source=source,
        step_ms=np.array([u.step_ms * scale for u in entry.units], dtype=float),
        param_bytes=np.array([u.param_bytes for u in entry.units], dtype=float),
        activation_bytes=np.array([u.activation_bytes for u in entry.units], dtype=float),
        stash_bytes=np.array([u.saved_bytes or u.activation_bytes for u in entry.units], dtype=float),
        fixed_ms=np.array([u.fixed_ms * scale for u in entry.units], dtype=float),
        overheads=entry.overheads,
        fwd_ms=np.array([u.fwd_ms * scale for u in entry.units], dtype=float),
    )


def kind_costs(profile: CostProfile, kind: str, precision: str) -> KindCosts | None:
    """Costs of every unit on ``kind`` in ``precision``: measured, or scaled from another kind.

    Scaling uses the ratio of datasheet dense TFLOP/s of the precision's math class (both kinds
    must be in ``DEVICE_SPECS`` and support that class). Returns ``None`` when neither is possible.
    """
    entry = profile.get(kind, precision)
    if entry is not None:
        return _from_entry(entry, entry.source)
    cls = _PRECISION_CLASS[precision]
    target = DEVICE_SPECS.get(kind)
    if target is None or cls not in target.tflops:
        return None
    for ref in profile.entries:
        spec = DEVICE_SPECS.get(ref.device_kind)
        if ref.precision == precision and spec is not None and cls in spec.tflops:
            k = spec.tflops[cls] / target.tflops[cls]
            src = f"scaled from {ref.device_kind} x{k:.2f} ({cls} TFLOP/s datasheet)"
            out = _from_entry(ref, src, k)
            out.kind = kind
            return out
    return None


def _choose_costs(profile: CostProfile, kind: str, fixed: str | None) -> KindCosts:
    held = ", ".join(f"({k}, {p})" for k, p in profile.pairs()) or "none"
    if fixed is not None:
        if fixed == "fp8" and not supports_fp8(kind):
            raise PartitionError(
                f"Precision 'fp8' was fixed for kind {kind!r}, which does not support fp8 (needs compute "
                f"capability >= 8.9, e.g. h100, h200, l4, l40s). Fix another precision for {kind!r}, e.g. 'bf16-mixed'."
            )
        costs = kind_costs(profile, kind, fixed)
        if costs is None:
            raise PartitionError(
                f"The profile has no costs for kind {kind!r} in precision {fixed!r} and cannot scale them from "
                f"another kind; it holds (kind, precision): {held}. Profile the model on {kind!r} in {fixed!r}."
            )
        return costs
    for prec in precision_preference(kind):
        costs = kind_costs(profile, kind, prec)
        if costs is not None:
            return costs
    raise PartitionError(
        f"The profile has no costs for kind {kind!r} in any precision it supports "
        f"({', '.join(precision_preference(kind))}); it holds (kind, precision): {held}. Profile the model "
        f"on {kind!r}, or leave {kind!r} out of the cluster."
    )


# ---------------------------------------------------------------------------- results
def _fmt_bytes(b: float) -> str:
    if not math.isfinite(b):
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def _units_text(units: Sequence[str]) -> str:
    return ", ".join(units) if len(units) <= 3 else f"{units[0]} .. {units[-1]} ({len(units)})"


@dataclass
class StageEstimate:
    """Predicted numbers for one stage (per micro-batch unless said otherwise).

    Attributes:
        units: Unit names of the stage.
        device: Device kind.
        precision: Precision the costs are for.
        compute_ms: Forward+backward time of the units.
        comm_ms: Time to send the output activation and the input gradient.
        allreduce_ms: Per-step gradient all-reduce over the data-parallel replicas.
        optimizer_ms: Per-step optimizer update of the stage's parameters (0 when not modelled).
        memory_bytes: Predicted peak memory (parameters, gradients, optimizer state, in-flight activations).
        memory_limit: The device's memory (``inf`` when unlimited).
        in_flight: Micro-batches whose activations the stage holds at its peak.
        cost_source: Where the costs come from (``"measured"`` or the scaling used).
    """

    units: list[str]
    device: str
    precision: str
    compute_ms: float
    comm_ms: float
    allreduce_ms: float
    memory_bytes: float
    memory_limit: float
    in_flight: int
    cost_source: str
    optimizer_ms: float = 0.0
    replica_kinds: list[str] | None = None
    memory_detail: str = ""
    """How ``memory_bytes`` adds up (:func:`~lightning_hpp.planning.memory.describe_memory`), where known."""

    @property
    def stage_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit


@dataclass
class PartitionResult:
    """A placement with its predicted numbers.

    Attributes:
        stages: One estimate per stage.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        n_microbatches: Micro-batches per replica per step.
        dp_degree: Data-parallel replicas.
        microbatch_size: Samples per micro-batch (from the profile), if known.
        label: What produced it (``"auto"``, ``"uniform"``, ...).
        notes: Extra lines for the table.
        fixed_step_ms: Fixed cost of one step (the schedule's own), 0 when not modelled.
        ranks: ``ranks[position][replica]``, the global ranks holding each pipeline position (its
            stages), when the placement was made for concrete ranks (:func:`plan_for_ranks`).
        stages_per_rank: Stages every pipeline position holds (``v``; 1 for ``gpipe`` and ``1f1b``).
        positions: ``positions[stage]``: the position holding the stage, when ``stages_per_rank > 1``.
        pipeline_ms: The replayed makespan of the schedule's own action order (``None``: the closed
            form ``(m + p - 1) * slowest stage``).
        update_ms: The slowest position's update (all-reduce plus optimizer of all its stages), when
            replayed.
        replayed_bubble: The idle share of the replayed makespan, when replayed.
        data_parallel: How each stage's replicas share it: ``"ddp"`` (whole on every replica), ``"fsdp"`` or
            ``"hsdp"`` (sharded over ``dp_shard`` of them, FSDP2); what ``plan="auto"`` runs.
        dp_shard: Replicas each stage is sharded over (1: unsharded).
    """

    stages: list[StageEstimate]
    schedule: str
    n_microbatches: int
    dp_degree: int
    microbatch_size: int | None = None
    label: str = "auto"
    notes: list[str] = field(default_factory=list)
    ranks: list[list[int]] | None = None
    fixed_step_ms: float = 0.0
    stages_per_rank: int = 1
    positions: list[int] | None = None
    pipeline_ms: float | None = None
    update_ms: float | None = None
    replayed_bubble: float | None = None
    data_parallel: str = "ddp"
    dp_shard: int = 1

    @property
    def pp_degree(self) -> int:
        return len(self.stages) // self.stages_per_rank

    @property
    def devices_used(self) -> int:
        return self.pp_degree * self.dp_degree

    @property
    def bottleneck_ms(self) -> float:
        return max(s.stage_ms for s in self.stages)

    @property
    def allreduce_ms(self) -> float:
        """The slowest position's per-step update: gradient all-reduce plus optimizer step."""
        if self.update_ms is not None:
            return self.update_ms
        return max(s.allreduce_ms + s.optimizer_ms for s in self.stages)

    @property
    def step_ms(self) -> float:
        """Predicted step time: the schedule's time (replayed, else ``(m + p - 1) * slowest stage``), plus the
        slowest update and the fixed step cost."""
        pipe = self.pipeline_ms
        if pipe is None:
            pipe = (self.n_microbatches + self.pp_degree - 1) * self.bottleneck_ms
        return pipe + self.allreduce_ms + self.fixed_step_ms

    @property
    def bubble_fraction(self) -> float:
        if self.replayed_bubble is not None:
            return self.replayed_bubble
        p, m = self.pp_degree, self.n_microbatches
        return (p - 1) / (m + p - 1)

    @property
    def samples_per_s(self) -> float | None:
        if not self.microbatch_size:
            return None
        return self.dp_degree * self.n_microbatches * self.microbatch_size / (self.step_ms / 1e3)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def require_fit(self) -> PartitionResult:
        """This placement, if every stage fits its device's memory.

        Raises:
            PartitionError: naming the first stage over its limit, its bytes, the limit and how they add up.
        """
        for k, est in enumerate(self.stages):
            if not est.fits:
                detail = f" ({est.memory_detail})" if est.memory_detail else ""
                raise PartitionError(
                    f"Stage {k} ({_units_text(est.units)} on {est.device}) needs {_fmt_bytes(est.memory_bytes)} per rank"
                    f"{detail} but the device has {_fmt_bytes(est.memory_limit)}. Use more stages, shard the stages "
                    f"over their replicas (`ShardingOptions(data_parallel='fsdp')`), more or larger devices, or fewer "
                    f"micro-batches in flight.")
        return self

    @property
    def cuts(self) -> list[int]:
        """Number of units per stage."""
        return [len(s.units) for s in self.stages]

    @property
    def plan(self) -> StagePlan:
        """The :class:`StagePlan`, with the predictions in ``meta["predicted"]``."""
        stages = [StageSpec(modules=list(s.units), device=None if s.replica_kinds else s.device, precision=s.precision)
                  for s in self.stages]
        meta: dict[str, Any] = {"predicted": self.predicted()}
        if self.ranks is not None:
            meta["ranks"] = [list(r) for r in self.ranks]
        return StagePlan(stages, meta)

    def predicted(self) -> dict[str, Any]:
        """The numbers saved with the plan (``plan.meta["predicted"]``)."""
        return {
            "label": self.label,
            "schedule": self.schedule,
            "n_microbatches": self.n_microbatches,
            "pp_degree": self.pp_degree,
            "dp_degree": self.dp_degree,
            "data_parallel": self.data_parallel,
            "dp_shard": self.dp_shard,
            "stages_per_rank": self.stages_per_rank,
            "positions": list(self.positions) if self.positions is not None else list(range(self.pp_degree)),
            "stage_ms": [round(s.stage_ms, 6) for s in self.stages],
            "compute_ms": [round(s.compute_ms, 6) for s in self.stages],
            "comm_ms": [round(s.comm_ms, 6) for s in self.stages],
            "allreduce_ms": [round(s.allreduce_ms, 6) for s in self.stages],
            "optimizer_ms": [round(s.optimizer_ms, 6) for s in self.stages],
            "fixed_step_ms": round(self.fixed_step_ms, 6),
            "pipeline_ms": round(self.step_ms - self.allreduce_ms - self.fixed_step_ms, 6),
            "microbatch_size": self.microbatch_size,
            "memory_bytes": [int(s.memory_bytes) for s in self.stages],
            "cost_source": [s.cost_source for s in self.stages],
            "step_ms": round(self.step_ms, 6),
            "bubble_fraction": round(self.bubble_fraction, 6),
            "samples_per_s": None if self.samples_per_s is None else round(self.samples_per_s, 3),
        }

    def format_table(self) -> str:
        """A readable table of the stages and the predicted step."""
        dp = self.dp_degree > 1
        multi = self.stages_per_rank > 1 and self.positions is not None
        head = ["stage"] + (["rank"] if multi else []) + ["units", "device", "precision", "compute ms", "comm ms"]
        head += ["allreduce ms"] if dp else []
        head += ["stage ms", "memory / limit"]
        rows = [head]
        for k, s in enumerate(self.stages):
            row = [str(k)] + ([str(self.positions[k])] if multi else [])
            row += [_units_text(s.units), s.device, s.precision, f"{s.compute_ms:.3f}", f"{s.comm_ms:.3f}"]
            row += [f"{s.allreduce_ms:.3f}"] if dp else []
            mem = f"{_fmt_bytes(s.memory_bytes)} / {_fmt_bytes(s.memory_limit)}" + ("" if s.fits else "  OVER")
            row += [f"{s.stage_ms:.3f}", mem]
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            f"{self.label} plan: {self.schedule}, {self.n_microbatches} micro-batches per replica, "
            f"pp={self.pp_degree} x dp={self.dp_degree} ({self.devices_used} devices)"
            + (f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else "")
            + (f", data_parallel={self.data_parallel} (each stage sharded over {self.dp_shard} replicas)"
               if self.data_parallel != "ddp" else "")
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        rate = self.samples_per_s
        lines.append(
            f"predicted step {self.step_ms:.2f} ms (bubble {100 * self.bubble_fraction:.1f}%)"
            + ("" if rate is None else f", {rate:,.1f} samples/s")
            + ("" if self.fits else "  -- does not fit in memory")
        )
        sources = sorted({s.cost_source for s in self.stages if s.cost_source != "measured"})
        lines += [f"costs: {src}" for src in sources]
        lines += self.notes
        return "\n".join(lines)


# ---------------------------------------------------------------------------- evaluation
def _schedule(schedule: str) -> str:
    key = str(schedule).lower().replace("_", "").replace("-", "")
    if key not in _SCHEDULE_ALIASES:
        raise PartitionError(
            f"The partitioner models schedules {', '.join(MODELLED_SCHEDULES)} (one stage per rank); "
            f"got {schedule!r}. "
            f"For interleaved or zero-bubble schedules write the stage plan by hand, or plan with '1f1b'."
        )
    return _SCHEDULE_ALIASES[key]


def _in_flight(schedule: str, s: int, p: int, m: int) -> int:
    return m if schedule == "gpipe" else min(m, p - s)


def _ring(dp: int) -> float:
    return 2.0 * (dp - 1) / dp


def _precision_map(precision: str | Mapping[str, str] | None, kinds: Sequence[str]) -> dict[str, str | None]:
    if precision is None:
        return {k: None for k in kinds}
    if isinstance(precision, str):
        p = normalize_precision(precision, "`partition` precision")
        return {k: p for k in kinds}
    out: dict[str, str | None] = {k: None for k in kinds}
    for k, p in precision.items():
        k = normalize_kind(k, "`partition` precision kind")
        if k not in out:
            raise PartitionError(
                f"A precision is fixed for kind {k!r}, but the cluster has no {k!r} devices (it has "
                f"{', '.join(kinds)}). Remove that entry or add the devices."
            )
        out[k] = normalize_precision(p, f"`partition` precision for {k!r}")
    return out


def _estimate(
    costs: KindCosts, group: DeviceGroup, i: int, j: int, s: int, p: int, m: int, dp: int, schedule: str,
    optimizer_factor: float, unit_names: Sequence[str], dp_shard: int = 1, reshard_after_forward: bool = False,
) -> StageEstimate:
    link = group.link_gbps * 1e6  # bytes per ms
    fl = _in_flight(schedule, s, p, m)
    params = costs.params(i, j)
    sharding = dict(dp_shard=dp_shard, reshard_after_forward=reshard_after_forward, n_microbatches=m,
                    largest_unit_bytes=max(costs.params(u, u + 1) for u in range(i, j)))
    return StageEstimate(
        units=list(unit_names[i:j]),
        device=group.kind,
        precision=costs.precision,
        compute_ms=costs.compute_ms(i, j),
        comm_ms=costs.comm_bytes(i, j) / link,
        allreduce_ms=_ring(dp) * params / link,
        memory_bytes=stage_memory_bytes(params, optimizer_factor, fl, costs.stash(i, j), **sharding),
        memory_limit=group.memory_limit,
        in_flight=fl,
        cost_source=costs.source,
        memory_detail=describe_memory(params, optimizer_factor, fl, costs.stash(i, j), fmt=_fmt_bytes, **sharding),
    )


def evaluate(
    profile: CostProfile,
    cluster: Cluster | str | Mapping[str, int],
    stages: Sequence[Sequence[str]],
    stage_kinds: Sequence[str],
    *,
    schedule: str = "1f1b",
    n_microbatches: int = 8,
    dp_degree: int = 1,
    precision: str | Mapping[str, str] | None = None,
    optimizer_factor: float = 3.0,
    label: str = "given",
    dp_shard: int = 1,
    reshard_after_forward: bool = False,
) -> PartitionResult:
    """Predict the numbers of a given placement (the cost model :func:`partition` minimises).

    Args:
        profile: Unit costs.
        cluster: The devices (memory and link speed per kind).
        stages: Unit names of every stage, contiguous and in order, covering all units.
        stage_kinds: Device kind of every stage.
        schedule, n_microbatches, dp_degree, precision, optimizer_factor: As for :func:`partition`.
        label: Name shown in the table.
        dp_shard, reshard_after_forward: Stages sharded over ``dp_shard`` of their ``dp_degree`` replicas
            (FSDP2; 1: unsharded) and FSDP2's choice for them: the memory model of
            :mod:`lightning_hpp.planning.memory` (:meth:`PartitionResult.require_fit` refuses what does not fit).

    Returns:
        The estimates; ``result.fits`` tells whether every stage fits its device's memory.

    Raises:
        PartitionError: stages that do not cover the units in order, kinds without devices or costs.
    """
    schedule = _schedule(schedule)
    m = check_int(n_microbatches, "n_microbatches", error=PartitionError)
    dp = check_int(dp_degree, "dp_degree", error=PartitionError)
    shard = check_int(dp_shard, "dp_shard", error=PartitionError)
    if dp % shard:
        raise PartitionError(f"dp_shard={shard} must divide dp_degree={dp}: a stage is sharded over some of its replicas.")
    cluster = Cluster.parse(cluster)
    stages = [list(s) for s in stages]
    if len(stage_kinds) != len(stages):
        raise PartitionError(f"{len(stage_kinds)} stage kinds for {len(stages)} stages; give one kind per stage.")
    flat = [u for s in stages for u in s]
    if flat != profile.unit_names or any(not s for s in stages):
        raise PartitionError(
            f"Stages {stages} must be non-empty and cover the profile's units in order: {profile.unit_names}."
        )
    kinds = [normalize_kind(k, f"stage {s} device") for s, k in enumerate(stage_kinds)]
    fixed = _precision_map(precision, cluster.kinds)
    p = len(stages)
    out, i = [], 0
    for s, (units, kind) in enumerate(zip(stages, kinds)):
        group = cluster.group(kind)
        if group is None or group.count < dp * kinds.count(kind):
            have = 0 if group is None else group.count
            raise PartitionError(
                f"The placement needs {dp * kinds.count(kind)} {kind!r} devices ({kinds.count(kind)} stage(s) x "
                f"dp {dp}) but the cluster has {have} ({cluster.describe()})."
            )
        costs = _choose_costs(profile, kind, fixed.get(kind))
        out.append(_estimate(costs, group, i, i + len(units), s, p, m, dp, schedule, optimizer_factor, profile.unit_names,
                             dp_shard=shard, reshard_after_forward=reshard_after_forward))
        i += len(units)
    return PartitionResult(out, schedule, m, dp, profile.microbatch_size, label)


def uniform_partition(
    profile: CostProfile,
    cluster: Cluster | str | Mapping[str, int],
    pp_degree: int,
    *,
    stage_kinds: Sequence[str] | None = None,
    schedule: str = "1f1b",
    n_microbatches: int = 8,
    dp_degree: int = 1,
    precision: str | Mapping[str, str] | None = None,
    optimizer_factor: float = 3.0,
) -> PartitionResult:
    """The baseline: equal numbers of units per stage (the first ``n % p`` stages get one more).

    Args:
        pp_degree: Number of stages.
        stage_kinds: Kind of every stage; default: the cluster's kinds in the order they are
            listed, each giving ``count // dp_degree`` stages.
        Other arguments: as for :func:`evaluate`.

    Raises:
        PartitionError: fewer units than stages, or not enough devices.
    """
    pp = check_int(pp_degree, "pp_degree", error=PartitionError)
    dp = check_int(dp_degree, "dp_degree", error=PartitionError)
    n = len(profile.unit_names)
    if pp > n:
        raise PartitionError(f"pp_degree={pp} stages but the model has only {n} units; use pp_degree <= {n}.")
    cluster = Cluster.parse(cluster)
    if stage_kinds is None:
        pool = [g.kind for g in cluster.groups for _ in range(g.count // dp)]
        if len(pool) < pp:
            raise PartitionError(
                f"A {pp}-stage uniform cut with dp={dp} needs {pp * dp} devices; the cluster has "
                f"{cluster.describe()}."
            )
        stage_kinds = pool[:pp]
    sizes = [n // pp + (1 if s < n % pp else 0) for s in range(pp)]
    stages, i = [], 0
    for size in sizes:
        stages.append(profile.unit_names[i : i + size])
        i += size
    return evaluate(
        profile, cluster, stages, list(stage_kinds), schedule=schedule, n_microbatches=n_microbatches,
        dp_degree=dp, precision=precision, optimizer_factor=optimizer_factor, label="uniform",
    )


# ---------------------------------------------------------------------------- the search
def _bottleneck(n: int, p: int, budgets: Sequence[int], cost) -> tuple[float, list[int], list[int]] | None:
    """Minimise ``max_s cost(kind_s, s)[cut_s, cut_{s+1}]`` over contiguous cuts and kind choices.

    ``cost(k, s)`` is an ``(n+1, n+1)`` matrix, ``inf`` where segment ``[i, j)`` is not allowed for
    stage ``s`` on kind ``k``; ``budgets[k]`` bounds the number of stages of kind ``k``.
    Returns ``(value, cuts, kinds)`` with ``cuts`` the ``p + 1`` boundaries, or ``None``.
    """
    K = len(budgets)
    cols = np.arange(n + 1)
    start = np.full(n + 1, _INF)
    start[0] = 0.0
    f: dict[tuple[int, ...], np.ndarray] = {(0,) * K: start}
    back: list[dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]] = []
    for s in range(p):
        g: dict[tuple[int, ...], np.ndarray] = {}
        bk: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        for c, arr in f.items():
            if not np.isfinite(arr).any():
                continue
            for k in range(K):
                if c[k] >= budgets[k]:
                    continue
                mat = np.maximum(arr[:, None], cost(k, s))
                i_best = mat.argmin(axis=0)
                val = mat[i_best, cols]
                c2 = c[:k] + (c[k] + 1,) + c[k + 1 :]
                if c2 not in g:
                    g[c2] = val
                    bk[c2] = (np.full(n + 1, k), i_best)
                else:
                    better = val < g[c2]
                    g[c2] = np.where(better, val, g[c2])
                    bk[c2][0][better] = k
                    bk[c2][1][better] = i_best[better]
        f = g
        back.append(bk)
    best_c, best_v = None, _INF
    for c, arr in f.items():
        if arr[n] < best_v:
            best_c, best_v = c, float(arr[n])
    if best_c is None:
        return None
    cuts, kinds, j, c = [n], [], n, best_c
    for s in range(p - 1, -1, -1):
        k = int(back[s][c][0][j])
        i = int(back[s][c][1][j])
        kinds.append(k)
        cuts.append(i)
        c = c[:k] + (c[k] - 1,) + c[k + 1 :]
        j = i
    return best_v, cuts[::-1], kinds[::-1]


@dataclass
class _Problem:
    costs: list[KindCosts]
    groups: list[DeviceGroup]
    schedule: str
    optimizer_factor: float
    pinned: list[int | None] | None  # kind index per stage, when the user fixed stage kinds

    def __post_init__(self) -> None:
        self.n = self.costs[0].n
        self._mats = [c.matrices() for c in self.costs]
        tri = np.triu(np.ones((self.n + 1, self.n + 1), dtype=bool), 1)
        self._invalid = ~tri

    def time(self, k: int) -> np.ndarray:
        comp, comm, _, _ = self._mats[k]
        t = comp + comm / (self.groups[k].link_gbps * 1e6)
        return np.where(self._invalid, _INF, t)

    def memory(self, k: int, s: int, p: int, m: int) -> np.ndarray:
        _, _, params, stash = self._mats[k]
        return params * (1 + self.optimizer_factor) + _in_flight(self.schedule, s, p, m) * stash

    def allreduce(self, k: int, dp: int) -> np.ndarray:
        return _ring(dp) * self._mats[k][2] / (self.groups[k].link_gbps * 1e6)

    def update_free(self, dp: int) -> bool:
        """Whether the per-step term ``max_s a_s`` is 0 for every placement (no all-reduce)."""
        return dp == 1

    def allowed(self, k: int, s: int) -> bool:
        return self.pinned is None or self.pinned[s] is None or self.pinned[s] == k

    def solve(self, p: int, dp: int, m: int) -> tuple[float, list[int], list[int]] | None:
        """Exact minimum of ``(m + p - 1) * max t_s + max a_s`` for fixed ``p`` and ``dp``."""
        K = len(self.costs)
        budgets = [g.count // dp for g in self.groups]
        times = [self.time(k) for k in range(K)]
        fit: dict[tuple[int, int], np.ndarray] = {}
        for k in range(K):
            for s in range(p):
                if self.allowed(k, s):
                    fit[k, s] = self.memory(k, s, p, m) <= self.groups[k].memory_limit
        blocked = np.full((self.n + 1, self.n + 1), _INF)

        def run(limit: float):
            ar = [self.allreduce(k, dp) <= limit for k in range(K)]

            def cost(k: int, s: int) -> np.ndarray:
                if (k, s) not in fit:
                    return blocked
                return np.where(fit[k, s] & ar[k], times[k], _INF)

            return _bottleneck(self.n, p, budgets, cost)

        c = m + p - 1
        if self.update_free(dp):
            sol = run(_INF)
            return None if sol is None else (c * sol[0], sol[1], sol[2])
        # Enumerate the levels of T*(A) = min max t_s subject to max a_s <= A, from large A down.
        levels = np.unique(np.concatenate([self.allreduce(k, dp)[~self._invalid] for k in range(K)]))
        best: tuple[float, list[int], list[int]] | None = None
        hi = len(levels) - 1
        while hi >= 0:
            sol = run(levels[hi])
            if sol is None:
                break
            t = sol[0]
            if best is not None and c * t >= best[0]:
                break
            lo, lo_sol = hi, sol
            a, b = 0, hi - 1  # smallest index whose optimum is still <= t
            while a <= b:
                mid = (a + b) // 2
                trial = run(levels[mid])
                if trial is not None and trial[0] <= t:
                    lo, lo_sol, b = mid, trial, mid - 1
                else:
                    a = mid + 1
            value = c * lo_sol[0] + levels[lo]
            if best is None or value < best[0]:
                best = (value, lo_sol[1], lo_sol[2])
            hi = lo - 1
        return best

    def lower_bound_ms(self, p: int) -> float:
        """A bound below any stage-time maximum with ``p`` stages (the work spread evenly)."""
        fastest = np.min([c.step_ms for c in self.costs], axis=0)
        return float(fastest.sum()) / p

    def closest_to_fitting(self, p: int, dp: int, m: int) -> tuple[float, list[int], list[int]] | None:
        """The placement with the smallest worst memory/limit ratio (for the error message)."""
        budgets = [g.count // dp for g in self.groups]
        blocked = np.full((self.n + 1, self.n + 1), _INF)

        def cost(k: int, s: int) -> np.ndarray:
            if not self.allowed(k, s):
                return blocked
            return np.where(self._invalid, _INF, self.memory(k, s, p, m) / self.groups[k].memory_limit)

        return _bottleneck(self.n, p, budgets, cost)


def partition(
    profile: CostProfile,
    cluster: Cluster | str | Mapping[str, int],
    *,
    schedule: str = "1f1b",
    n_microbatches: int = 8,
    pp_degree: int | None = None,
    dp_degree: int | str = 1,
    global_microbatches: int | None = None,
    precision: str | Mapping[str, str] | None = None,
    stage_kinds: Sequence[str | None] | None = None,
    optimizer_factor: float = 3.0,
) -> PartitionResult:
    """Choose cuts, stage kinds (and optionally the pipeline and data-parallel degrees) for the
    smallest predicted step time that fits in memory.

    Args:
        profile: Unit costs; kinds it lacks are scaled from datasheet TFLOP/s where possible.
        cluster: The devices: ``"128xa100,128xh100"``, ``{"a100": 1, "h100": 1}`` or a :class:`Cluster`.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        n_microbatches: Micro-batches per replica per step (used when ``dp_degree`` is an int).
        pp_degree: Number of stages; ``None`` searches 1 .. number of units.
        dp_degree: Data-parallel replicas, or ``"auto"`` to search the divisors of
            ``global_microbatches``.
        global_microbatches: Micro-batches per step over all replicas; required with ``dp_degree="auto"``
            (then each replica runs ``global_microbatches / dp`` of them).
        precision: Fixed precision for every stage (a string) or per kind (``{"h100": "bf16-mixed"}``);
            kinds without one follow the device: fp8 where supported, else bf16, else fp16, else fp32.
        stage_kinds: Fixed kind per stage (``None`` entries are free); sets ``pp_degree``.
        optimizer_factor: Bytes of gradients plus optimizer state per parameter byte (Adam: 3).

    Returns:
        The best placement; ``result.plan`` is the :class:`StagePlan` with the predictions in
        ``meta["predicted"]`` and ``result.format_table()`` a readable table.

    Raises:
        PartitionError: fewer units than stages, kinds without devices or costs, no placement that
            fits in memory (the message names the stage, its need and its limit), bad arguments.
    """
    schedule = _schedule(schedule)
    cluster = Cluster.parse(cluster)
    n = len(profile.unit_names)
    groups = [g for g in cluster.groups if g.count > 0]
    if not groups:
        raise PartitionError(f"The cluster ({cluster.describe()}) has no devices.")
    if optimizer_factor < 0:
        raise PartitionError(f"`optimizer_factor` must be >= 0, got {optimizer_factor!r}.")
    kinds = [g.kind for g in groups]

    pinned: list[int | None] | None = None
    if stage_kinds is not None:
        wanted = [None if k is None else normalize_kind(k, f"stage {s} device") for s, k in enumerate(stage_kinds)]
        absent = sorted({k for k in wanted if k is not None and k not in kinds})
        if absent:
            raise PartitionError(
                f"Stages ask for device kind(s) {absent}, but the cluster has zero of them "
                f"({cluster.describe()}). Change the stages' kinds or add those devices."
            )
        if pp_degree is not None and pp_degree != len(wanted):
            raise PartitionError(f"pp_degree={pp_degree!r} but {len(wanted)} stage kinds were given; make them agree.")
        pp_degree = len(wanted)
        pinned = [None if k is None else kinds.index(k) for k in wanted]
    if pp_degree is not None:
        pp_degree = check_int(pp_degree, "pp_degree", error=PartitionError)
        if pp_degree > n:
            raise PartitionError(
                f"pp_degree={pp_degree} stages but the profile has only {n} units ({', '.join(profile.unit_names)}); "
                f"every stage needs at least one unit. Use pp_degree <= {n} or split the model into more units."
            )

    if dp_degree == "auto":
        if global_microbatches is None:
            raise PartitionError(
                "dp_degree='auto' needs `global_microbatches` (micro-batches per step over all replicas), so "
                "that plans with different dp degrees process the same global batch."
            )
        g = check_int(global_microbatches, "global_microbatches", error=PartitionError)
        options = [(dp, g // dp) for dp in range(1, min(g, cluster.total) + 1) if g % dp == 0]
    else:
        dp = check_int(dp_degree, "dp_degree", error=PartitionError)
        m = check_int(n_microbatches, "n_microbatches", error=PartitionError)
        if global_microbatches is not None and global_microbatches != dp * m:
            raise PartitionError(
                f"global_microbatches={global_microbatches!r} != dp_degree {dp} x n_microbatches {m}; give one "
                f"of them, or dp_degree='auto'."
            )
        options = [(dp, m)]

    fixed = _precision_map(precision, kinds)
    problem = _Problem([_choose_costs(profile, k, fixed[k]) for k in kinds], groups, schedule, optimizer_factor, pinned)

    best: tuple[float, int, int, int, list[int], list[int]] | None = None
    tried: list[tuple[int, int, int]] = []
    for dp, m in options:
        most = sum(g.count // dp for g in groups)
        ps = [pp_degree] if pp_degree is not None else list(range(1, min(n, most) + 1))
        for p in ps:
            if p > most:
                continue
            if best is not None and (m + p - 1) * problem.lower_bound_ms(p) >= best[0]:
                continue
            tried.append((p, dp, m))
            sol = problem.solve(p, dp, m)
            if sol is None:
                continue
            key = (sol[0], p * dp, p)
            if best is None or key < (best[0], best[1] * best[2], best[1]):
                best = (sol[0], p, dp, m, sol[1], sol[2])
    if best is None:
        raise _no_plan_error(problem, cluster, tried, profile, pp_degree)
    _, p, dp, m, cuts, ks = best
    stages = [
        _estimate(problem.costs[k], groups[k], cuts[s], cuts[s + 1], s, p, m, dp, schedule, optimizer_factor, profile.unit_names)
        for s, k in enumerate(ks)
    ]
    return PartitionResult(stages, schedule, m, dp, profile.microbatch_size, "auto")


def _no_plan_error(problem: _Problem, cluster: Cluster, tried, profile: CostProfile, pp_degree) -> PartitionError:
    if not tried:
        return PartitionError(
            f"No placement is possible: the cluster ({cluster.describe()}) cannot hold "
            f"{'pp_degree=' + str(pp_degree) if pp_degree else 'any number of'} stages with the requested "
            f"dp degree and stage kinds. Use more devices, a smaller dp_degree or fewer stages."
        )
    worst: tuple[float, int, int, int, list[int], list[int]] | None = None
    for p, dp, m in tried:
        sol = problem.closest_to_fitting(p, dp, m)
        if sol is not None and (worst is None or sol[0] < worst[0]):
            worst = (sol[0], p, dp, m, sol[1], sol[2])
    if worst is None:
        return PartitionError(f"No placement is possible on {cluster.describe()} with the given constraints.")
    _, p, dp, m, cuts, ks = worst
    ratios = []
    for s, k in enumerate(ks):
        est = _estimate(problem.costs[k], problem.groups[k], cuts[s], cuts[s + 1], s, p, m, dp,
                        problem.schedule, problem.optimizer_factor, profile.unit_names)
        ratios.append((est.memory_bytes / est.memory_limit, s, est, k))
    _, s, est, k = max(ratios, key=lambda r: r[0])
    costs = problem.costs[k]
    params = costs.params(cuts[s], cuts[s + 1])
    stash = costs.stash(cuts[s], cuts[s + 1])
    return PartitionError(
        f"No placement fits in device memory. The closest one (pp={p}, dp={dp}, {m} micro-batches) still needs "
        f"{_fmt_bytes(est.memory_bytes)} on stage {s} ({_units_text(est.units)} on {est.device}) against a limit "
        f"of {_fmt_bytes(est.memory_limit)}: parameters {_fmt_bytes(params)} x (1 + optimizer_factor "
        f"{problem.optimizer_factor:g}) + {est.in_flight} in-flight micro-batch(es) x {_fmt_bytes(stash)} of "
        f"activations. Use more or larger devices, a smaller micro-batch, fewer micro-batches in flight "
        f"(1f1b instead of gpipe) or a smaller optimizer_factor."
    )


def plan_for_ranks(
    profile: CostProfile,
    rank_kinds: Sequence[str],
    *,
    dp_degree: int = 1,
    schedule: str = "1f1b",
    n_microbatches: int = 8,
    precision: str | Mapping[str, str] | None = None,
    optimizer_factor: float = 3.0,
    memory_bytes: Mapping[str, float] | None = None,
    link_gbps: float = DEFAULT_LINK_GBPS,
) -> PartitionResult:
    """The best placement on the ranks of a running job (what ``plan="auto"`` needs).

    Every rank is used: ``pp_degree = len(rank_kinds) / dp_degree``. Only stage-kind orders that
    :func:`~lightning_hpp.planning.devices.assign_ranks` can lay out with ascending pipelines are
    considered; the result carries the rank grid in ``result.ranks`` (and ``plan.meta["ranks"]``).

    Args:
        profile: Unit costs.
        rank_kinds: The kind of every global rank (index = rank).
        dp_degree: Data-parallel replicas; must divide the number of ranks.
        schedule, n_microbatches, precision, optimizer_factor: As for :func:`partition`.
        memory_bytes: Memory per device by kind (default: datasheet, unlimited for ``cpu``).
        link_gbps: Link speed of every rank.

    Raises:
        PartitionError: as :func:`partition`, and when ``dp_degree`` does not divide the world size.
    """
    world = len(rank_kinds)
    dp = check_int(dp_degree, "dp_degree", error=PartitionError)
    if world == 0 or world % dp:
        raise PartitionError(f"{world} ranks cannot form dp_degree={dp} replicas; dp_degree must divide the world size.")
    pp = world // dp
    cluster = Cluster.from_rank_kinds([normalize_kind(k, f"rank {r} kind") for r, k in enumerate(rank_kinds)],
                                      memory_bytes, link_gbps)
    try:
        orders = stage_kind_orders(rank_kinds, pp, dp)
    except PlacementError as err:
        raise PartitionError(str(err)) from None
    best: PartitionResult | None = None
    last_error: PartitionError | None = None
    for order in orders:
        try:
            res = partition(profile, cluster, schedule=schedule, n_microbatches=n_microbatches, dp_degree=dp,
                            precision=precision, stage_kinds=order, optimizer_factor=optimizer_factor)
        except PartitionError as err:
            last_error = err
            continue
        if best is None or res.step_ms < best.step_ms:
            best = res
    if best is None:
        if last_error is not None:
            raise last_error
        raise PartitionError(
            f"Ranks {list(rank_kinds)} cannot form {dp} pipeline replica(s) of {pp} stages in which the ranks "
            f"holding one stage share a kind and every pipeline ascends in rank. Use dp_degree=1, or set the "
            f"ranks' kinds so that each kind has a multiple of {dp} ranks."
        )
    best.ranks = assign_ranks([s.device for s in best.stages], rank_kinds, pp, dp)
    return best
