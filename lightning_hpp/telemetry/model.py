"""A pure model of a pipeline schedule: theoretical bubbles, every schedule's per-rank action order
built without processes, and a replay of an order with given costs and link latency.

Shared by the recorder (expected bubble from measured costs), the renderers (text grid, pictures)
and the planner; it starts no process and imports no Lightning.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.pipelining import schedules as _S

from lightning_hpp.errors import TelemetryError
from lightning_hpp.pipeline import orders as _orders
from lightning_hpp.pipeline.orders import Act, walk_orders  # noqa: F401 (Act: used from here)
from lightning_hpp.pipeline.schedules import SCHEDULES
from lightning_hpp.validation import check_int

now_ns = time.perf_counter_ns
"""The clock of every span telemetry records (host nanoseconds)."""

COMM_KINDS = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")
# the schedules that split the backward into I and W (torch says so only in their action orders)
_SPLIT_BACKWARD = (_S.ScheduleInterleavedZeroBubble, _S.ScheduleZBVZeroBubble, _S.ScheduleDualPipeV)
ZERO_BUBBLE = tuple(name for name, kind in SCHEDULES.items() if issubclass(kind.cls, _SPLIT_BACKWARD))


# --------------------------------------------------------------------------------------------- theory
def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a step for ``p`` pipeline ranks and ``m`` micro-batches, equal stage costs.

    GPipe and 1F1B: ``(p-1) / (m+p-1)``. Interleaved (and looped BFS) with ``v`` stages per rank:
    ``(p-1) / (v*m + p-1)``, the same ``(p-1)/(v*m)`` bubble-to-compute ratio as Megatron's, read as
    a share of the step so that every schedule is on one scale. Zero-bubble schedules
    (``interleaved_zb``, ``zbv``, ``dualpipev``) fill the drain with weight-gradient work; with
    F = I = W only the first forward chain stays idle: ``(p-1) / (3*v*m + p-1)``, close to 0.
    Every value equals :func:`simulate` of torch's own action order with those equal costs and every
    output sent as soon as it is made. DualPipeV's runtime sends what the first action of each
    overlapped pair makes only after the pair (``Act.held``): its replay, and its measured bubble, are
    higher (0.077 against 0.040 at p=2, m=4).

    Args:
        schedule: A schedule name of :data:`lightning_hpp.pipeline.schedules.SCHEDULES`.
        p: Pipeline ranks.
        m: Micro-batches per step.
        v: Stages per rank (1 for ``gpipe`` / ``1f1b``, 2 for the V schedules).

    Returns:
        The fraction of the step a rank is idle, in ``[0, 1)``.

    Raises:
        TelemetryError: Unknown schedule, non-positive counts, or a ``v`` the schedule cannot have.
    """
    if schedule not in SCHEDULES:
        raise TelemetryError(f"Unknown schedule {schedule!r}. Valid schedules: {', '.join(SCHEDULES)}.")
    for name, value in (("p", p), ("m", m), ("v", v)):
        check_int(value, f"theoretical_bubble({schedule!r}, {name}=...)", error=TelemetryError)
    kind = SCHEDULES[schedule]
    if not kind.multi and v != 1:
        raise TelemetryError(f"Schedule {schedule!r} runs one stage per rank; got v={v!r}. Use v=1.")
    if kind.multi and v < 2:
        raise TelemetryError(f"Schedule {schedule!r} runs several stages per rank; got v={v!r}. Use v >= 2.")
    if kind.style == "v" and v != 2:
        raise TelemetryError(f"Schedule {schedule!r} places exactly 2 stages per rank; got v={v!r}. Use v=2.")
    if schedule in ZERO_BUBBLE:
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


# --------------------------------------------------------------------------------------------- action orders
def schedule_actions(schedule: str, pp: int, n_microbatches: int, n_stages: int | None = None) -> dict[int, list[Act]]:
    """:func:`lightning_hpp.pipeline.orders.schedule_actions`, with :class:`TelemetryError` for an unknown name."""
    if schedule not in SCHEDULES:
        raise TelemetryError(f"Unknown schedule {schedule!r}. Valid schedules: {', '.join(SCHEDULES)}.")
    return _orders.schedule_actions(schedule, pp, n_microbatches, n_stages)


# --------------------------------------------------------------------------------------------- simulation
@dataclass
class Simulation:
    """A replayed schedule: when each action ran, the makespan and the bubble."""

    starts: dict[int, list[tuple[Act, float, float]]]
    makespan: float

    def busy(self, rank: int) -> float:
        return sum(e - s for _, s, e in self.starts[rank])

    @property
    def bubble(self) -> float:
        """Mean over ranks of the idle share of the makespan."""
        if self.makespan <= 0:
            return 0.0
        ranks = list(self.starts)
        return sum(1 - self.busy(r) / self.makespan for r in ranks) / len(ranks)


def simulate(
    orders: dict[int, list[Act]],
    cost: Callable[[Act], float],
    latency: float | Callable[[int, int, Act], float] = 0.0,
) -> Simulation:
    """Replay per-rank action orders as soon as each action's inputs exist (on :func:`walk_orders`, the walk
    the planner's :func:`~lightning_hpp.planning.replay.program` replays too).

    An action starts when its rank is free and its inputs have arrived: a forward needs the previous
    stage's forward of the same micro-batch, a backward (B or I) its own forward and the next stage's
    input gradient, a W its own I. A dependency from another rank arrives ``latency`` later, and one
    made by a ``held`` action (the first of an overlapped pair) leaves that rank when the pair is done.

    Args:
        orders: ``{rank: [Act, ...]}`` as from :func:`schedule_actions`.
        cost: Duration of an action.
        latency: Delay of a cross-rank dependency: a number, or ``f(src_rank, dst_rank, action)``.

    Returns:
        The :class:`Simulation`.

    Raises:
        TelemetryError: The orders deadlock (an action waits on one that never runs).
    """
    n_stages = 1 + max((a.stage for acts in orders.values() for a in acts), default=0)
    lat = latency if callable(latency) else (lambda s, d, a, _v=float(latency): _v)

    def deadlock(stuck: dict[int, str]) -> TelemetryError:
        return TelemetryError(
            f"The action orders deadlock: ranks wait on {stuck} forever. Check the schedule's orders."
        )

    steps = walk_orders(orders, n_stages, deadlock)
    end = [0.0] * len(steps)
    free = dict.fromkeys(orders, 0.0)
    starts: dict[int, list[tuple[Act, float, float]]] = {r: [] for r in orders}
    for i, step in enumerate(steps):
        ready = end[step.prev] if step.prev >= 0 else 0.0
        for w in step.waits:  # an input from another rank arrives `latency` after it is sent
            src = steps[w].rank
            ready = max(ready, end[w] + (lat(src, step.rank, step.act) if src != step.rank else 0.0))
        end[i] = ready + cost(step.act)
        starts[step.rank].append((step.act, ready, end[i]))
        free[step.rank] = end[i]
    return Simulation(starts, max(free.values(), default=0.0))


# --------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Span:
    """One recorded interval on one rank (times in ns on rank 0's monotonic clock).

    Attributes:
        rank: Global rank.
        kind: ``F B I W L`` (compute), ``SEND_F SEND_B RECV_F RECV_B`` (a p2p wait) or ``POST``.
        stage: Stage index.
        mb: Micro-batch index (-1 for ``POST``).
        start: Start, ns.
        end: End, ns.
        post: For p2p waits, when this rank posted the op.
        comm: For p2p waits, the ns after the peer posted its matching op (filled by :func:`analyze`).
    """

    rank: int
    kind: str
    stage: int
    mb: int
    start: int
    end: int
    post: int | None = None
    comm: int | None = None

    @property
    def ms(self) -> float:
        return (self.end - self.start) / 1e6
