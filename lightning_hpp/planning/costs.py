"""The cost model the planner minimises: what every segment of units costs on a kind of device.

:class:`KindCosts` holds a profile's per-unit arrays for one (kind, precision), measured or scaled from
another kind by the datasheet TFLOP/s of :data:`~lightning_hpp.planning.devices.DEVICE_SPECS`
(:func:`kind_costs`, :func:`choose_costs`). :class:`CostModel` turns them into the cost of every segment
``[i, j)`` of units for one structure of the search: micro-batches of ``b = scale · b0`` samples, stages
sharded over ``dp_shard`` ranks, layers split over ``tp`` ranks. For a stage holding units ``[i, j)`` on kind
``k``, per micro-batch and action::

    F_s = sum_units fwd_share * (F_u + V_u * b) * t_u + c_mb / 2 + [last] L / 3 + [output to another rank] msg_out
          + sum_units fwd_allreduces_u * ar_tp(act_u)
    B_s = sum_units bwd_share * (F_u + V_u * b) * t_u + c_mb / 2 + [last] 2 L / 3 + [input from another rank] msg_in
          + sum_units bwd_allreduces_u * ar_tp(act_u)
    msg = latency + bytes * b / b0 / bandwidth
    t_u = split_u / tp + (1 - split_u)                                    (the part of a unit one tp rank runs)
    ar_tp(x) = 2 (tp - 1) / tp * x * b / b0 / allreduce_bandwidth + 2 (tp - 1) * latency

``F_u`` is the unit's fixed time per micro-batch, ``V_u`` its time per sample, ``split_u`` the share of its
parameter bytes the tensor-parallel plan splits and ``*_allreduces_u`` the all-reduces of its output's size
its split modules run (a rowwise module's output forward, a colwise module's input gradient backward:
:meth:`~lightning_hpp.planning.profile.CostProfile.tp_shape`). A rank's parameters are ``params_u · t_u``:
the share of the stage one rank holds is ``1 / (dp_shard · tp)`` of its split weights and ``1 / dp_shard`` of
the rest (:mod:`~lightning_hpp.planning.memory` with ``params · t``); the activations a micro-batch keeps are
counted whole on every tp rank (the inputs of every split module are replicated). The per-step terms, on a
rank's parameters::

    a_s = 2 (dp - 1) / dp * params_s / allreduce_bandwidth + 2 (dp - 1) * latency       (gradient all-reduce)
    g_s = gathers * ((dp_shard - 1) / dp_shard * params_s / allreduce_bandwidth + (dp_shard - 1) * latency)
    o_s = optimizer_ms_per_mb * params_s / 1e6

(``gathers`` = 1 per step, ``2 m`` with ``reshard_after_forward=True``). The search
(:mod:`~lightning_hpp.planning.search`) adds the schedule's replay and the step's fixed cost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_hpp.errors import PartitionError
from lightning_hpp.planning.cluster import DeviceGroup
from lightning_hpp.planning.devices import DEVICE_SPECS, normalize_kind, precision_preference, supports_fp8
from lightning_hpp.planning.memory import stage_memory_bytes
from lightning_hpp.planning.plan import normalize_precision
from lightning_hpp.planning.profile import CostProfile, Overheads, ProfileEntry

PRECISION_CLASS = {
    "32-true": "fp32",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "fp8": "fp8",
}
"""The datasheet math class each precision runs in (what unmeasured kinds are scaled by)."""

NO_OVERHEADS = Overheads()


@dataclass
class KindCosts:
    """Per-unit cost arrays of one (kind, precision).

    Attributes:
        kind, precision: What the costs are for.
        source: Where they come from (``"measured"`` or the scaling used).
        step_ms, fixed_ms, fwd_ms: Each unit's forward + backward time, its part per micro-batch, its forward.
        param_bytes, activation_bytes, stash_bytes: Each unit's parameters, output and saved activations.
        overheads: The kind's step costs besides the units.
    """

    kind: str
    precision: str
    source: str
    step_ms: np.ndarray
    param_bytes: np.ndarray
    activation_bytes: np.ndarray
    stash_bytes: np.ndarray
    fixed_ms: np.ndarray
    fwd_ms: np.ndarray
    overheads: Overheads | None = None

    @property
    def n(self) -> int:
        return len(self.step_ms)


def _from_entry(entry: ProfileEntry, source: str, scale: float = 1.0) -> KindCosts:
    return KindCosts(
        kind=entry.device_kind,
        precision=entry.precision,
        source=source,
        step_ms=np.array([u.step_ms * scale for u in entry.units], dtype=float),
        param_bytes=np.array([u.param_bytes for u in entry.units], dtype=float),
        activation_bytes=np.array([u.activation_bytes for u in entry.units], dtype=float),
        stash_bytes=np.array([u.saved_bytes or u.activation_bytes for u in entry.units], dtype=float),
        fixed_ms=np.array([u.fixed_ms * scale for u in entry.units], dtype=float),
        fwd_ms=np.array([u.fwd_ms * scale for u in entry.units], dtype=float),
        overheads=entry.overheads,
    )


def kind_costs(profile: CostProfile, kind: str, precision: str) -> KindCosts | None:
    """Costs of every unit on ``kind`` in ``precision``: measured, or scaled from another kind.

    Scaling uses the ratio of datasheet dense TFLOP/s of the precision's math class (both kinds
    must be in ``DEVICE_SPECS`` and support that class). Returns ``None`` when neither is possible.
    """
    entry = profile.get(kind, precision)
    if entry is not None:
        return _from_entry(entry, entry.source)
    cls = PRECISION_CLASS[precision]
    target = DEVICE_SPECS.get(kind)
    if target is None or cls not in target.tflops:
        return None
    for ref in profile.entries:
        spec = DEVICE_SPECS.get(ref.device_kind)
        if ref.precision == precision and spec is not None and cls in spec.tflops:
            k = spec.tflops[cls] / target.tflops[cls]
            out = _from_entry(ref, f"scaled from {ref.device_kind} x{k:.2f} ({cls} TFLOP/s datasheet)", k)
            out.kind = kind
            return out
    return None


def choose_costs(profile: CostProfile, kind: str, fixed: str | None) -> KindCosts:
    """The costs a kind is planned with: in the ``fixed`` precision, else the first of the kind's preference
    (fp8 where supported, bf16, fp16, fp32) the profile has or can scale.

    Raises:
        PartitionError: fp8 fixed on a kind without it, or no costs for the kind.
    """
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


def precision_map(precision: str | Mapping[str, str] | None, kinds: Sequence[str]) -> dict[str, str | None]:
    """The precision fixed for every kind (``None``: free), from one precision or one per kind.

    Raises:
        PartitionError: a precision fixed for a kind the ranks do not have, or no precision name.
    """
    if precision is None:
        return {k: None for k in kinds}
    if isinstance(precision, str):
        p = normalize_precision(precision, "the planner's precision")
        return {k: p for k in kinds}
    out: dict[str, str | None] = {k: None for k in kinds}
    for k, p in precision.items():
        k = normalize_kind(k, "the planner's precision kind")
        if k not in out:
            raise PartitionError(
                f"A precision is fixed for kind {k!r}, but the cluster has no {k!r} devices (it has "
                f"{', '.join(kinds)}). Remove that entry or add the devices."
            )
        out[k] = normalize_precision(p, f"the planner's precision for {k!r}")
    return out


def in_flight(schedule: str, s: int, p: int, m: int) -> int:
    """Micro-batches whose activations stage ``s`` of ``p`` holds at its peak (one stage per rank)."""
    return m if schedule == "gpipe" else min(m, p - s)


def ring_factor(n: int) -> float:
    """What a ring all-reduce over ``n`` ranks sends per byte: ``2 (n - 1) / n``."""
    return 2.0 * (n - 1) / n


def _prefix_matrix(values: np.ndarray) -> np.ndarray:
    """``out[i, j]`` = the sum of ``values[i:j]`` (negative below the diagonal)."""
    c = np.concatenate([[0.0], np.cumsum(values)])
    return c[None, :] - c[:, None]


@dataclass
class CostModel:
    """Every segment's costs on every kind for one structure of the search (the module docstring).

    Attributes:
        costs: Per kind, its :class:`KindCosts`.
        groups: Per kind, its devices (memory limit, link speed).
        schedule: The schedule (the closed-form activations in flight of :meth:`memory`).
        optimizer_factor: Gradient + optimizer bytes per parameter byte.
        scale: Micro-batch size over the profile's (``b / b0``).
        dp_shard: Ranks a stage is sharded over (FSDP2; 1: unsharded).
        reshard_after_forward: FSDP2's choice for sharded stages.
        tp: Tensor-parallel degree.
        tp_split: Per unit, the share of its parameter bytes tensor parallel splits (default: all).
        tp_allreduces: Per unit, ``(forward, backward)`` all-reduces of its output's size under tensor parallel.
    """

    costs: list[KindCosts]
    groups: list[DeviceGroup]
    schedule: str
    optimizer_factor: float = 3.0
    scale: float = 1.0
    dp_shard: int = 1
    reshard_after_forward: bool = False
    tp: int = 1
    tp_split: Sequence[float] | None = None
    tp_allreduces: Sequence[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        n = self.n = self.costs[0].n
        split = np.ones(n) if self.tp_split is None else np.asarray(self.tp_split, dtype=float)
        self.tp_share = split / self.tp + (1.0 - split)
        """Per unit, the part of its computation and parameters one tensor-parallel rank has."""
        self.invalid = ~np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        """``True`` where ``[i, j)`` is no segment (``j <= i``)."""
        self.unit_params = [np.asarray(c.param_bytes, dtype=float) * self.tp_share for c in self.costs]
        """Per kind, each unit's parameter bytes on one rank (before FSDP2's sharding)."""
        self.params = [_prefix_matrix(p) for p in self.unit_params]
        """Per kind, every segment's parameter bytes on one rank (before FSDP2's sharding)."""
        self.stash = [_prefix_matrix(np.asarray(c.stash_bytes, dtype=float)) for c in self.costs]
        """Per kind, every segment's saved activation bytes per micro-batch at the profile's size."""
        self.actions = [self._action_parts(k) for k in range(len(self.costs))]
        """Per kind: forward and backward of every segment, the message out at ``j`` and back at ``i``, and the
        per-micro-batch, loss-forward and loss-backward costs."""

    def overheads(self, k: int) -> Overheads:
        return self.costs[k].overheads or NO_OVERHEADS

    def bandwidth(self, k: int) -> float:
        """Point-to-point bytes per ms of kind ``k`` (measured, else its link)."""
        return (self.overheads(k).p2p_gbps or self.groups[k].link_gbps) * 1e6

    def allreduce_bandwidth(self, k: int) -> float:
        """All-reduce bytes per ms of kind ``k`` (measured, else point-to-point)."""
        oh = self.overheads(k)
        return oh.allreduce_gbps * 1e6 if oh.allreduce_gbps else self.bandwidth(k)

    def tp_allreduce_ms(self, k: int) -> np.ndarray:
        """Per unit, one tensor-parallel all-reduce of its output at this micro-batch size (0 without tp)."""
        if self.tp <= 1:
            return np.zeros(self.n)
        act = np.asarray(self.costs[k].activation_bytes, dtype=float) * self.scale
        latency = 2 * (self.tp - 1) * self.overheads(k).p2p_latency_ms
        return ring_factor(self.tp) * act / self.allreduce_bandwidth(k) + latency

    def _action_parts(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float, float]:
        costs, oh = self.costs[k], self.overheads(k)
        unit = (costs.fixed_ms + (costs.step_ms - costs.fixed_ms) * self.scale) * self.tp_share
        share = np.divide(costs.fwd_ms, costs.step_ms, out=np.full(self.n, 1 / 3), where=costs.step_ms > 0)
        fwd_units, bwd_units = unit * share, unit * (1 - share)
        if self.tp > 1:
            given = self.tp_allreduces if self.tp_allreduces is not None else [(2, 2)] * self.n
            reduces = np.asarray(given, dtype=float)
            one = self.tp_allreduce_ms(k)
            fwd_units, bwd_units = fwd_units + reduces[:, 0] * one, bwd_units + reduces[:, 1] * one
        fwd, bwd = _prefix_matrix(fwd_units), _prefix_matrix(bwd_units)
        act = np.asarray(costs.activation_bytes, dtype=float) * self.scale / self.bandwidth(k)
        out = np.zeros(self.n + 1)
        out[1:self.n] = act[: self.n - 1] + oh.p2p_latency_ms
        back = np.zeros(self.n + 1)
        back[1:] = act + oh.p2p_latency_ms
        loss = oh.loss_fixed_ms + (oh.loss_ms - oh.loss_fixed_ms) * self.scale
        return fwd, bwd, out, back, oh.microbatch_ms, loss / 3, 2 * loss / 3

    def lower_bound(self, position_kinds: Sequence[int], n_stages: int, m: int) -> float:
        """A bound below the step of every cut of a layout: the busiest rank works at least the mean of all
        ranks' work (each unit at the fastest of the positions' kinds, every stage's fixed cost per
        micro-batch, the loss), and the fixed step cost is paid."""
        used = sorted(set(position_kinds))
        u = np.arange(self.n)
        fastest = np.min([self.actions[k][0][u, u + 1] + self.actions[k][1][u, u + 1] for k in used], axis=0).sum()
        per_mb = (min(self.actions[k][4] for k in used) * n_stages
                  + min(self.actions[k][5] + self.actions[k][6] for k in used))
        fixed = max(self.overheads(k).step_ms for k in used)
        return m * (float(fastest) + per_mb) / len(position_kinds) + fixed

    def parts(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(compute_ms, comm_ms)`` of every segment on kind ``k``, both boundaries sent (``inf`` where invalid)."""
        fwd, bwd, out, back, mb, lf, lb = self.actions[k]
        compute = fwd + bwd + mb
        compute[:, self.n] += lf + lb
        talk = back[:, None] + out[None, :]
        return np.where(self.invalid, math.inf, compute), np.where(self.invalid, math.inf, talk)

    def time(self, k: int) -> np.ndarray:
        """Every segment's time per micro-batch on kind ``k``, both boundaries sent (the bottleneck's cost)."""
        compute, talk = self.parts(k)
        return compute + talk

    def held(self, params: np.ndarray, largest: np.ndarray | None, activations: np.ndarray | float,
             m: int) -> np.ndarray:
        """What one rank holds for ``params`` bytes of parameters (of which the largest unit's ``largest``)
        and ``activations`` bytes kept for the backward, under this model's sharding
        (:func:`~lightning_hpp.planning.memory.stage_memory_bytes`)."""
        return stage_memory_bytes(params, self.optimizer_factor, 1, activations, dp_shard=self.dp_shard,
                                  n_microbatches=m, reshard_after_forward=self.reshard_after_forward,
                                  largest_unit_bytes=largest)

    def largest(self, k: int) -> np.ndarray:
        """The largest unit's parameter bytes (on one rank) of every segment ``[i, j)`` on kind ``k``."""
        units = self.unit_params[k]
        out = np.zeros((self.n + 1, self.n + 1))
        for i in range(self.n):
            out[i, i + 1:] = np.maximum.accumulate(units[i:])
        return out

    def memory(self, k: int, s: int, p: int, m: int) -> np.ndarray:
        """Every segment's bytes on one rank as stage ``s`` of ``p`` (the closed form's activations in flight)."""
        largest = self.largest(k) if self.dp_shard > 1 and m == 1 else None
        return self.held(self.params[k], largest, in_flight(self.schedule, s, p, m) * self.stash[k] * self.scale, m)

    def optimizer(self, k: int) -> np.ndarray:
        return self.params[k] / 1e6 * self.overheads(k).optimizer_ms_per_mb

    def ring(self, k: int, dp: int) -> np.ndarray:
        """The gradient all-reduce of every segment over ``dp`` replicas, not overlapped."""
        latency = 2 * (dp - 1) * self.overheads(k).p2p_latency_ms  # a ring sends 2 (dp - 1) messages
        return ring_factor(dp) * self.params[k] / self.allreduce_bandwidth(k) + latency

    def gather(self, k: int, m: int) -> np.ndarray:
        """FSDP2's all-gathers of every segment's parameters over the ``dp_shard`` ranks it is sharded over, per
        step and not overlapped (0 unsharded): once, or for every micro-batch's forward and backward with
        ``reshard_after_forward``; each with the ring's terms, one way."""
        s = self.dp_shard
        if s <= 1:
            return np.zeros_like(self.params[k])
        gathers = 2 * m if self.reshard_after_forward else 1
        return gathers * ((s - 1) / s * self.params[k] / self.allreduce_bandwidth(k)
                          + (s - 1) * self.overheads(k).p2p_latency_ms)

    def allreduce(self, k: int, dp: int, m: int = 1) -> np.ndarray:
        """The per-step update of every segment: all-reduce, gathers and the optimizer, none overlapped."""
        return self.ring(k, dp) + self.gather(k, m) + self.optimizer(k)

    def exposed(self, k: int, dp: int, i: int, j: int, m: int = 1) -> float:
        """What of segment ``[i, j)``'s all-reduce the step waits for: its buckets start during the last
        micro-batch's backward, the first unit's (final last) after it; and a sharded stage's all-gathers."""
        ring = self.ring(k, dp)
        gather = float(self.gather(k, m)[i, j])
        window = self.overheads(k).allreduce_overlap * self.actions[k][1][i, j]
        return max(float(ring[i, i + 1]), float(ring[i, j] - window)) + gather if dp > 1 else 0.0
