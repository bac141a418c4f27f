"""What the planner answers: one :class:`PlanResult` per plan, with a :class:`StageEstimate` per stage.

A result carries the layout it chose (pipeline, data-parallel and tensor-parallel degrees, the sharding of
the replicas, the schedule and micro-batches, the rank grid), every stage's predicted numbers, the
:class:`~lightning_hpp.planning.plan.StagePlan` to train with (``result.plan``, its predictions in
``meta["predicted"]``) and a readable table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_hpp.errors import PartitionError
from lightning_hpp.pipeline.dims import ParallelDims
from lightning_hpp.planning.plan import StagePlan, StageSpec


def fmt_bytes(b: float) -> str:
    if not math.isfinite(b):
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def units_text(units: Sequence[str]) -> str:
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
class PlanResult:
    """A placement with its predicted numbers.

    Attributes:
        stages: One estimate per stage.
        schedule: The schedule's name.
        n_microbatches: Micro-batches per replica per step.
        dp_degree: Data-parallel replicas.
        microbatch_size: Samples per micro-batch (from the profile), if known.
        label: What produced it (``"auto"``, ``"uniform"``, ...).
        notes: Extra lines for the table.
        fixed_step_ms: Fixed cost of one step (the schedule's own), 0 when not modelled.
        ranks: ``ranks[position][replica · tp + tp_rank]``, the global ranks holding each pipeline position
            (its stages), when the placement was made for concrete ranks.
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
        tp_degree: Ranks of each replica splitting every stage's layers (tensor parallel; 1: none).
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
    tp_degree: int = 1

    @property
    def pp_degree(self) -> int:
        return len(self.stages) // self.stages_per_rank

    @property
    def devices_used(self) -> int:
        return self.pp_degree * self.dp_degree * self.tp_degree

    @property
    def dims(self) -> ParallelDims:
        """The plan's degrees."""
        return ParallelDims(self.pp_degree, self.dp_degree // self.dp_shard, self.dp_shard, self.tp_degree)

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

    def require_fit(self) -> PlanResult:
        """This placement, if every stage fits its device's memory.

        Raises:
            PartitionError: naming the first stage over its limit, its bytes, the limit and how they add up.
        """
        for k, est in enumerate(self.stages):
            if not est.fits:
                detail = f" ({est.memory_detail})" if est.memory_detail else ""
                raise PartitionError(
                    f"Stage {k} ({units_text(est.units)} on {est.device}) needs {fmt_bytes(est.memory_bytes)} per rank"
                    f"{detail} but the device has {fmt_bytes(est.memory_limit)}. Use more stages, shard the stages "
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
            "tp_degree": self.tp_degree,
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
            row += [units_text(s.units), s.device, s.precision, f"{s.compute_ms:.3f}", f"{s.comm_ms:.3f}"]
            row += [f"{s.allreduce_ms:.3f}"] if dp else []
            mem = f"{fmt_bytes(s.memory_bytes)} / {fmt_bytes(s.memory_limit)}" + ("" if s.fits else "  OVER")
            row += [f"{s.stage_ms:.3f}", mem]
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            f"{self.label} plan: {self.schedule}, {self.n_microbatches} micro-batches per replica, "
            f"pp={self.pp_degree} x dp={self.dp_degree}" + (f" x tp={self.tp_degree}" if self.tp_degree > 1 else "")
            + f" ({self.devices_used} devices)"
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
