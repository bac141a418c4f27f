"""Pipeline telemetry: where each stage of a pipeline spends its step.

Recording. :class:`PipelineRecorder` wraps, on the instances only, the methods of the
``PipelineStage`` objects a schedule drives (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``, the four ``get_*_ops``), the schedule's ``step`` and loss
computation, and, once per process, torch's two p2p helpers ``_batch_p2p`` / ``_wait_batch_p2p``
(every schedule posts and waits its sends and receives through them). Each action costs two clock reads
(``time.perf_counter_ns``, CLOCK_MONOTONIC, shared by all processes of one host).

Accounting, per rank and step (every rank computes the same numbers from everyone's records)::

    step  = the replica's ``schedule.step``: first rank's start to last rank's end
    fwd   = forward (F) + loss (L, last stage)        bwd = full (B) + input (I) + weight (W) backward
    comm  = posting p2p ops + the part of each p2p wait after the peer posted the matching op
    idle  = step - fwd - bwd - comm                   (waiting for a peer's compute, and overhead)

A wait on a receive is split where the peer posted its send: before that the rank waits for the
peer's compute (a bubble, counted as idle); after it the data moves (communication). Sends are
split the same way at the peer's receive. ``bubble`` is the mean over ranks of ``idle / step``,
``comm_share`` is ``sum(comm) / sum(step)``; ``bubble_theory`` is :func:`theoretical_bubble`;
``bubble_expected`` is :func:`simulate` of the schedule's own action order with the measured
per-stage costs and free communication (what the bubble would be from stage imbalance alone).

Offline. :func:`schedule_actions` builds any schedule's per-rank action order without processes
and :func:`simulate` replays an order with given costs and link latency; the text grid and the
pictures live in :mod:`lightning_hpp.telemetry_render`.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch.distributed.pipelining import schedules as _S

from lightning_hpp.pipeline import SCHEDULES, check_schedule

_now = time.perf_counter_ns

COMM_KINDS = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")


class TelemetryError(ValueError):
    """Telemetry asked for something it cannot do: the message names the value, the context and the fix."""


# --------------------------------------------------------------------------------------------- theory
def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a step for ``p`` pipeline ranks and ``m`` micro-batches, equal stage costs.

    GPipe and 1F1B: ``(p-1) / (m+p-1)``. Interleaved (and looped BFS) with ``v`` stages per rank:
    ``(p-1) / (v*m + p-1)``, the same ``(p-1)/(v*m)`` bubble-to-compute ratio as Megatron's, read as
    a share of the step so that every schedule is on one scale. Zero-bubble schedules
    (``interleaved_zb``, ``zbv``, ``dualpipev``) fill the drain with weight-gradient work; with
    F = I = W only the first forward chain stays idle: ``(p-1) / (3*v*m + p-1)``, close to 0.
    Every value equals :func:`simulate` of torch's own action order with those equal costs.

    Args:
        schedule: A schedule name of :data:`lightning_hpp.pipeline.SCHEDULES`.
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
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TelemetryError(f"`{name}` must be a positive integer, got {value!r} (schedule {schedule!r}).")
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
class Act(NamedTuple):
    """One compute action: stage, ``"F"``/``"B"``/``"I"``/``"W"``, micro-batch."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def _single_stage_order(cls: type, stage: int, num_stages: int, m: int) -> list[Act]:
    # torch's own pipeline_order of the single-stage schedules does not match what their
    # _step_microbatches runs (1F1B's is off by one micro-batch on the last rank), so the order is
    # rebuilt here from the loop structure of ScheduleGPipe / Schedule1F1B._step_microbatches.
    if issubclass(cls, _S.Schedule1F1B):
        warmup = min(m, num_stages - stage)
        order = [Act(stage, "F", i) for i in range(warmup)]
        f, b = warmup, 0
        while True:
            order.append(Act(stage, "B", b))
            b += 1
            if f == m:
                break
            order.append(Act(stage, "F", f))
            f += 1
        return order + [Act(stage, "B", i) for i in range(b, m)]
    return [Act(stage, "F", i) for i in range(m)] + [Act(stage, "B", i) for i in range(m)]


def _flatten(actions: Iterable[Any]) -> list[Act]:
    out: list[Act] = []
    for a in actions:
        if a is None:
            continue
        if a.sub_actions:
            out.extend(_flatten(a.sub_actions))
        elif a.computation_type.value in ("F", "B", "I", "W"):
            out.append(Act(a.stage_index, a.computation_type.value, a.microbatch_index))
    return out


def _orders_of(schedule: Any, num_stages: int, pp: int) -> dict[int, list[Act]]:
    """The compute order of every pipeline rank for a live or offline schedule object."""
    m = schedule._n_microbatches
    if hasattr(schedule, "_stages"):
        return {r: _flatten(schedule.pipeline_order[r]) for r in range(pp)}
    return {s: _single_stage_order(type(schedule), s, num_stages, m) for s in range(num_stages)}


def schedule_actions(schedule: str, pp: int, n_microbatches: int, n_stages: int | None = None) -> dict[int, list[Act]]:
    """Build a schedule's per-rank compute order offline (no processes, no process group).

    Args:
        schedule: A name of :data:`lightning_hpp.pipeline.SCHEDULES`.
        pp: Pipeline ranks.
        n_microbatches: Micro-batches per step.
        n_stages: Stages in the pipeline; default ``pp`` for one-stage-per-rank schedules, ``2*pp``
            for the others.

    Returns:
        ``{rank: [Act, ...]}`` in the order each rank runs them.

    Raises:
        lightning_hpp.pipeline.ScheduleError: The schedule cannot run with these numbers.
    """
    if schedule not in SCHEDULES:
        raise TelemetryError(f"Unknown schedule {schedule!r}. Valid schedules: {', '.join(SCHEDULES)}.")
    kind = SCHEDULES[schedule]
    if n_stages is None:
        n_stages = 2 * pp if kind.multi else pp
    check_schedule(schedule, n_stages, pp, n_microbatches)

    def fake(index: int) -> SimpleNamespace:
        return SimpleNamespace(num_stages=n_stages, group_size=pp, group_rank=0, stage_index=index, submod=None)

    if kind.multi:
        sched = kind.cls([fake(i) for i in range(n_stages // pp)], n_microbatches)
    else:
        sched = kind.cls(fake(0), n_microbatches)
    return _orders_of(sched, n_stages, pp)


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


def _deps(a: Act, n_stages: int) -> list[tuple[str, int, int]]:
    if a.kind == "F":
        return [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind in ("B", "I"):
        deps = [("F", a.stage, a.mb)]
        if a.stage < n_stages - 1:
            deps.append(("G", a.stage + 1, a.mb))
        return deps
    return [("G", a.stage, a.mb)]  # W after its I


def simulate(
    orders: dict[int, list[Act]],
    cost: Callable[[Act], float],
    latency: float | Callable[[int, int, Act], float] = 0.0,
) -> Simulation:
    """Replay per-rank action orders as soon as each action's inputs exist.

    An action starts when its rank is free and its inputs have arrived: a forward needs the previous
    stage's forward of the same micro-batch, a backward (B or I) its own forward and the next stage's
    input gradient, a W its own I. A dependency from another rank arrives ``latency`` later.

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
    ptr = dict.fromkeys(orders, 0)
    free = dict.fromkeys(orders, 0.0)
    done: dict[tuple[str, int, int], tuple[float, int]] = {}
    starts: dict[int, list[tuple[Act, float, float]]] = {r: [] for r in orders}
    left = sum(len(v) for v in orders.values())
    while left:
        progress = False
        for r, acts in orders.items():
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                ready = free[r]
                for dep in _deps(a, n_stages):
                    if dep not in done:
                        break
                    t, src = done[dep]
                    ready = max(ready, t + (lat(src, r, a) if src != r else 0.0))
                else:
                    end = ready + cost(a)
                    starts[r].append((a, ready, end))
                    done[("G" if a.kind in ("B", "I") else a.kind, a.stage, a.mb)] = (end, r)
                    free[r] = end
                    ptr[r] += 1
                    left -= 1
                    progress = True
                    continue
                break
        if not progress:
            stuck = {r: str(orders[r][ptr[r]]) for r in orders if ptr[r] < len(orders[r])}
            raise TelemetryError(f"The action orders deadlock: ranks wait on {stuck} forever. Check the schedule's orders.")
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


@dataclass
class RankStep:
    """What one rank recorded during one ``schedule.step``."""

    rank: int
    replica: int
    position: int
    step: int
    start: int
    end: int
    spans: list[tuple] = field(default_factory=list)


@dataclass
class ScheduleInfo:
    """What analysis needs to know about the schedule being recorded."""

    name: str
    pp: int
    m: int
    n_stages: int
    orders: dict[int, list[Act]]

    @property
    def v(self) -> int:
        return self.n_stages // self.pp


_OPS: dict[int, tuple] = {}  # id(P2POp) -> (recorder, kind, stage, mb)
_WORKS: dict[int, tuple] = {}  # id(Work) -> (recorder, kind, stage, mb, post_ns)
_ORIGINAL: dict[str, Callable] = {}
_RECORDERS: set[int] = set()


def _batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
    if not _OPS:
        return _ORIGINAL["_batch_p2p"](p2p_ops, desc)
    tags = [_OPS.pop(id(op), None) for op in p2p_ops]
    t0 = _now()
    works = _ORIGINAL["_batch_p2p"](p2p_ops, desc)
    t1 = _now()
    tagged = [t for t in tags if t is not None]
    if tagged:
        rec, _, stage, _ = tagged[0]
        if rec._open is not None:
            rec._open.spans.append(("POST", stage, -1, t0, t1, None))
        if len(works) == len(tags):
            for w, t in zip(works, tags):
                if t is not None:
                    _WORKS[id(w)] = (*t, t0)
        elif works:  # a coalesced batch (NCCL): one work stands for the whole batch
            recv = [t for t in tagged if t[1].startswith("RECV")]
            _WORKS[id(works[-1])] = (*(recv or tagged)[0], t0)
    return works


def _wait_batch_p2p(work: list) -> None:
    if not _WORKS:
        return _ORIGINAL["_wait_batch_p2p"](work)
    for w in work:
        tag = _WORKS.pop(id(w), None)
        if tag is None:
            w.wait()
            continue
        rec, kind, stage, mb, post = tag
        t0 = _now()
        w.wait()
        rec._sync()
        if rec._open is not None:
            rec._open.spans.append((kind, stage, mb, t0, _now(), post))
    return None


def _install_p2p_hooks() -> None:
    if not _ORIGINAL:
        _ORIGINAL["_batch_p2p"] = _S._batch_p2p
        _ORIGINAL["_wait_batch_p2p"] = _S._wait_batch_p2p
        _S._batch_p2p = _batch_p2p
        _S._wait_batch_p2p = _wait_batch_p2p


def _remove_p2p_hooks() -> None:
    if _ORIGINAL and not _RECORDERS:
        _S._batch_p2p = _ORIGINAL.pop("_batch_p2p")
        _S._wait_batch_p2p = _ORIGINAL.pop("_wait_batch_p2p")
        _OPS.clear()
        _WORKS.clear()


class PipelineRecorder:
    """Records the actions of the training schedules it is given, on one rank.

    Use ``recorder.instrument`` as a ``PipelineRunner.schedule_observers`` entry (forward-only
    schedules are left alone), or call it on any torch pipelining schedule directly.

    Args:
        rank: This process's global rank.
        replica: Its data-parallel replica (p2p partners are matched within a replica).
        position: Its pipeline position.
        schedule_name: The name of the schedule (a key of :data:`SCHEDULES`), for the theory.
        clock_offset_ns: Subtracted from local timestamps to put them on rank 0's clock.

    Attributes:
        enabled: Record the next steps (a disabled recorder costs one attribute read per action).
        info: The recorded schedule's :class:`ScheduleInfo`, once a schedule ran.
    """

    def __init__(self, rank: int, replica: int = 0, position: int = 0, schedule_name: str | None = None, clock_offset_ns: int = 0) -> None:
        self.rank = rank
        self.replica = replica
        self.position = position
        self.schedule_name = schedule_name
        self.clock_offset_ns = clock_offset_ns
        self.enabled = True
        self.info: ScheduleInfo | None = None
        self._open: RankStep | None = None
        self._done: list[RankStep] = []
        self._count = 0
        self._cuda: torch.device | None = None
        self._closed = False
        _RECORDERS.add(id(self))

    # ------------------------------------------------------------------ wiring
    def instrument(self, schedule: Any) -> None:
        """Wrap a schedule and its stages (a ``schedule_observers`` callable)."""
        if not getattr(schedule, "_has_backward", False) or getattr(schedule, "_hpp_recorder", None) is self:
            return
        stages = list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]
        pp = stages[0].group_size
        n_stages = stages[0].num_stages
        name = self.schedule_name or _schedule_name(schedule)
        self.info = ScheduleInfo(name, pp, schedule._n_microbatches, n_stages, _orders_of(schedule, n_stages, pp))
        if stages[0].device.type == "cuda":
            self._cuda = stages[0].device
        for stage in stages:
            self._wrap_stage(stage)
        self._wrap_schedule(schedule)
        schedule._hpp_recorder = self
        _install_p2p_hooks()

    def _sync(self) -> None:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)

    def _timed(self, kind: str, stage: int, fn: Callable, mb_of: Callable[..., int], kind_of: Callable[..., str] | None = None) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            open_ = self._open
            if open_ is None:
                return fn(*args, **kwargs)
            t0 = _now()
            out = fn(*args, **kwargs)
            self._sync()
            k = kind_of(*args, **kwargs) if kind_of is not None else kind
            open_.spans.append((k, stage, mb_of(*args, **kwargs), t0, _now(), None))
            return out

        return wrapper

    def _tagging(self, kind: str, stage: int, fn: Callable) -> Callable:
        def wrapper(chunk: int, *args: Any, **kwargs: Any) -> Any:
            ops = fn(chunk, *args, **kwargs)
            if self._open is not None:
                for op in ops:
                    _OPS[id(op)] = (self, kind, stage, chunk)
            return ops

        return wrapper

    def _wrap_stage(self, stage: Any) -> None:
        if getattr(stage, "_hpp_recorder", None) is self:
            return
        s = stage.stage_index
        first = lambda chunk, *a, **k: chunk  # noqa: E731
        stage.forward_one_chunk = self._timed("F", s, stage.forward_one_chunk, first)
        stage.backward_one_chunk = self._timed(
            "B", s, stage.backward_one_chunk, first, lambda chunk, loss=None, full_backward=True, *a, **k: "B" if full_backward else "I"
        )
        stage.backward_weight_one_chunk = self._timed("W", s, stage.backward_weight_one_chunk, first)
        for kind, attr in (("RECV_F", "get_fwd_recv_ops"), ("RECV_B", "get_bwd_recv_ops"), ("SEND_F", "get_fwd_send_ops"), ("SEND_B", "get_bwd_send_ops")):
            setattr(stage, attr, self._tagging(kind, s, getattr(stage, attr)))
        stage._hpp_recorder = self

    def _wrap_schedule(self, schedule: Any) -> None:
        step = schedule.step
        compute_loss = schedule._maybe_compute_loss

        def maybe_compute_loss(stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any, **kwargs: Any) -> Any:
            open_ = self._open
            if open_ is None or not stage.is_last:
                return compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
            t0 = _now()
            out = compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
            self._sync()
            open_.spans.append(("L", stage.stage_index, mb_index, t0, _now(), None))
            return out

        schedule._maybe_compute_loss = maybe_compute_loss

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            index = self._count
            self._count += 1
            if not self.enabled:
                return step(*args, **kwargs)
            self._sync()
            self._open = RankStep(self.rank, self.replica, self.position, index, _now(), 0)
            try:
                return step(*args, **kwargs)
            finally:
                self._sync()
                rec, self._open = self._open, None
                rec.end = _now()
                self._done.append(rec)
                for registry in (_OPS, _WORKS):
                    for key in [k for k, v in registry.items() if v[0] is self]:
                        del registry[key]

        schedule.step = timed_step

    # ------------------------------------------------------------------ results
    def take(self) -> list[RankStep]:
        """The steps recorded since the last call, on rank 0's clock."""
        done, self._done = self._done, []
        off = self.clock_offset_ns
        if off:
            for rec in done:
                rec.start -= off
                rec.end -= off
                rec.spans = [(k, s, mb, t0 - off, t1 - off, None if p is None else p - off) for k, s, mb, t0, t1, p in rec.spans]
        return done

    def close(self) -> None:
        """Stop recording; the process's p2p hooks go when no recorder is left."""
        self.enabled = False
        if not self._closed:
            self._closed = True
            _RECORDERS.discard(id(self))
            _remove_p2p_hooks()


def _schedule_name(schedule: Any) -> str:
    for name, kind in SCHEDULES.items():
        if type(schedule) is kind.cls:
            return name
    return type(schedule).__name__


# --------------------------------------------------------------------------------------------- analysis
@dataclass
class StageTimes:
    """Milliseconds one stage spent in one step (mean over the replicas holding it)."""

    fwd_ms: float
    bwd_ms: float
    comm_ms: float
    idle_ms: float


@dataclass
class StepMetrics:
    """The numbers of one step, the same on every rank.

    Attributes:
        step: Index of the step (training batch) within the fit.
        step_ms: Wall time of the pipeline's step: first rank's start of ``schedule.step`` to the
            last rank's end (mean over replicas).
        bubble: Mean over ranks of idle / step.
        bubble_theory: :func:`theoretical_bubble` for the schedule, p, m, v.
        bubble_expected: The schedule replayed with the measured per-stage costs and free links.
        comm_share: Communication time / step time, over all ranks.
        stages: Per-stage :class:`StageTimes`.
        spans: Every rank's spans with ``comm`` filled (kept only where a picture is asked for).
    """

    step: int
    step_ms: float
    bubble: float
    bubble_theory: float
    bubble_expected: float
    comm_share: float
    stages: dict[int, StageTimes]
    spans: list[Span] = field(default_factory=list, repr=False)

    def as_log_dict(self, prefix: str = "pipeline") -> dict[str, float]:
        out = {
            f"{prefix}/bubble": self.bubble,
            f"{prefix}/bubble_theory": self.bubble_theory,
            f"{prefix}/bubble_expected": self.bubble_expected,
            f"{prefix}/comm_share": self.comm_share,
            f"{prefix}/step_ms": self.step_ms,
        }
        for k, t in sorted(self.stages.items()):
            for name in ("fwd_ms", "bwd_ms", "comm_ms", "idle_ms"):
                out[f"{prefix}/stage_{k}/{name}"] = getattr(t, name)
        return out


def _channel(kind: str, stage: int, mb: int) -> tuple[tuple, str]:
    """The (channel, side) of a p2p op: both ends of one transfer name the same channel."""
    if kind == "SEND_F":
        return ("F", stage, stage + 1, mb), "send"
    if kind == "RECV_F":
        return ("F", stage - 1, stage, mb), "recv"
    if kind == "SEND_B":
        return ("B", stage, stage - 1, mb), "send"
    return ("B", stage + 1, stage, mb), "recv"


def analyze(records: list[RankStep], info: ScheduleInfo) -> StepMetrics:
    """Turn every rank's record of one step into :class:`StepMetrics`.

    Args:
        records: One :class:`RankStep` per rank, all for the same step.
        info: The schedule that ran.

    Returns:
        The step's metrics, with every span (``comm`` filled for p2p waits).
    """
    posts: dict[tuple, int] = {}
    for rec in records:
        for kind, stage, mb, _t0, _t1, post in rec.spans:
            if kind in COMM_KINDS and post is not None:
                chan, side = _channel(kind, stage, mb)
                posts[(rec.replica, chan, side)] = post
    # The step of a replica runs from its first rank's start to its last rank's end: a rank that
    # finishes early (the last stage of GPipe) is idle until the pipeline's step is over.
    window: dict[int, tuple[int, int]] = {}
    for rec in records:
        lo, hi = window.get(rec.replica, (rec.start, rec.end))
        window[rec.replica] = (min(lo, rec.start), max(hi, rec.end))
    spans: list[Span] = []
    per_rank: dict[int, dict[str, float]] = {}
    stage_sum: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    holder: dict[int, list[int]] = defaultdict(list)
    costs: dict[tuple[int, str], list[float]] = defaultdict(list)
    for rec in records:
        totals = {"fwd": 0.0, "bwd": 0.0, "comm": 0.0}
        by_stage: dict[int, dict[str, float]] = defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0, "comm": 0.0})
        loss_ns: dict[tuple[int, int], int] = {}
        for kind, stage, mb, t0, t1, post in rec.spans:
            dur = t1 - t0
            comm = None
            if kind in COMM_KINDS:
                chan, side = _channel(kind, stage, mb)
                ready = posts.get((rec.replica, chan, "recv" if side == "send" else "send"), t0)
                comm = t1 - min(max(ready, t0), t1)
                bucket, ns = "comm", comm
            elif kind == "POST":
                bucket, ns = "comm", dur
            elif kind in ("F", "L"):
                bucket, ns = "fwd", dur
                if kind == "L":
                    loss_ns[(stage, mb)] = dur
            else:
                bucket, ns = "bwd", dur
            if kind in ("F", "B", "I", "W"):
                costs[(stage, kind)].append(dur)
            by_stage[stage][bucket] += ns / 1e6
            totals[bucket] += ns / 1e6
            spans.append(Span(rec.rank, kind, stage, mb, t0, t1, post, comm))
        for (stage, _mb), ns in loss_ns.items():
            costs[(stage, "L")].append(ns)
        lo, hi = window[rec.replica]
        step_ms = (hi - lo) / 1e6
        idle = max(0.0, step_ms - totals["fwd"] - totals["bwd"] - totals["comm"])
        per_rank[rec.rank] = {"step": step_ms, "idle": idle, "comm": totals["comm"]}
        for stage, t in by_stage.items():
            for name, value in t.items():
                stage_sum[stage][name].append(value)
            stage_sum[stage]["idle"].append(idle)
            holder[stage].append(rec.rank)
    steps = [v["step"] for v in per_rank.values()]
    total_step = sum(steps)
    bubble = sum(v["idle"] / v["step"] for v in per_rank.values() if v["step"] > 0) / max(1, len(per_rank))
    comm_share = sum(v["comm"] for v in per_rank.values()) / total_step if total_step > 0 else 0.0
    stages = {
        k: StageTimes(*(statistics.fmean(stage_sum[k][n]) if stage_sum[k][n] else 0.0 for n in ("fwd", "bwd", "comm", "idle")))
        for k in sorted(stage_sum)
    }
    return StepMetrics(
        step=records[0].step,
        step_ms=statistics.fmean(steps) if steps else 0.0,
        bubble=bubble,
        bubble_theory=theoretical_bubble(info.name, info.pp, info.m, info.v) if info.name in SCHEDULES else float("nan"),
        bubble_expected=_expected_bubble(info, costs),
        comm_share=comm_share,
        stages=stages,
        spans=sorted(spans, key=lambda s: (s.rank, s.start)),
    )


def _expected_bubble(info: ScheduleInfo, costs: dict[tuple[int, str], list[float]]) -> float:
    mean = {k: statistics.fmean(v) for k, v in costs.items()}

    def cost(a: Act) -> float:
        # The loss runs right after the last stage's forward and holds back its backward.
        extra = mean.get((a.stage, "L"), 0.0) if a.kind == "F" else 0.0
        return mean.get((a.stage, a.kind), 0.0) + extra

    try:
        return simulate(info.orders, cost).bubble
    except TelemetryError:
        return float("nan")


def mean_metrics(metrics: list[StepMetrics]) -> dict[str, float]:
    """The mean of each logged value over several steps."""
    dicts = [m.as_log_dict() for m in metrics]
    keys = dicts[0].keys() if dicts else []
    return {k: statistics.fmean(d[k] for d in dicts if k in d) for k in keys}


def collect(recorder: PipelineRecorder, keep_spans_of: int | None = None) -> list[StepMetrics]:
    """Exchange every rank's records (one ``all_gather_object`` over the world group) and analyze them.

    Collective: every rank calls it at the same point and gets the same list.

    Args:
        recorder: This rank's recorder; its finished steps are taken.
        keep_spans_of: The step whose spans are kept (for pictures); the others drop them.

    Returns:
        The metrics of every step that all ranks recorded, in step order.
    """
    local = recorder.take()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (local, recorder.info))
    else:
        gathered = [(local, recorder.info)]
    info = next((i for _, i in gathered if i is not None), None)
    if info is None:
        return []
    by_step: dict[int, list[RankStep]] = defaultdict(list)
    for recs, _ in gathered:
        for rec in recs:
            by_step[rec.step].append(rec)
    out = []
    for step in sorted(by_step):
        if len(by_step[step]) != len(gathered):
            continue
        metrics = analyze(by_step[step], info)
        if step != keep_spans_of:
            metrics.spans = []
        out.append(metrics)
    return out


# --------------------------------------------------------------------------------------------- callback
def _same_clock_host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}:{f.read().strip()}"
    except OSError:
        return f"{socket.gethostname()}:{os.getpid()}"


def clock_offset_ns(rounds: int = 5) -> int:
    """This rank's clock minus rank 0's (0 where all ranks share one host's monotonic clock).

    Collective over the world group. Across hosts the offset is taken at barrier exits, so its
    error is the barrier's exit skew (tens of microseconds on one switch).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, _same_clock_host())
    if len(set(hosts)) == 1:
        return 0
    diffs = []
    for _ in range(rounds):
        dist.barrier()
        now: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(now, _now())
        diffs.append(now[dist.get_rank()] - now[0])
    return int(statistics.median(diffs))


class PipelineTelemetry(Callback):
    """Per-stage timings, bubble and communication share of an HPPStrategy pipeline, logged.

    Logged every ``every_n_steps`` optimizer steps (the mean over the steps since the last log),
    the same values on every rank: ``pipeline/bubble``, ``pipeline/bubble_theory``,
    ``pipeline/bubble_expected``, ``pipeline/comm_share``, ``pipeline/step_ms`` and
    ``pipeline/stage_{k}/{fwd,bwd,comm,idle}_ms``. See the module docstring for the accounting.

    Args:
        every_n_steps: Steps between two exchanges of the records (one ``all_gather_object`` over
            the world group) and two logs. Default: the Trainer's ``log_every_n_steps``, so that
            every exchange reaches the loggers.
        trace_step: If set, the training batch (0-based, within this fit) whose Chrome/Perfetto
            trace (``pipeline_trace_step{N}.json``) and PNG timeline (``pipeline_timeline_step{N}.png``)
            rank 0 writes.
        trace_dir: Where the pictures go; default the Trainer's ``log_dir``.

    Raises:
        TelemetryError: Bad option values, or a Trainer whose strategy is not a pipeline strategy.
    """

    def __init__(self, every_n_steps: int | None = None, trace_step: int | None = None, trace_dir: str | os.PathLike | None = None) -> None:
        for name, value, low in (("every_n_steps", every_n_steps, 1), ("trace_step", trace_step, 0)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise TelemetryError(
                    f"`PipelineTelemetry({name}=...)` must be None or an integer >= {low}, got {value!r}."
                )
        self._every_arg = every_n_steps
        self._trace_step = trace_step
        self._trace_dir = None if trace_dir is None else os.fspath(trace_dir)
        self._every = 1
        self._recorder: PipelineRecorder | None = None
        self._runner: Any = None
        self._last_step = 0
        self._batches = 0
        self.history: list[StepMetrics] = []
        self.trace_paths: list[str] = []

    @property
    def recorder(self) -> PipelineRecorder | None:
        """This rank's recorder (``recorder.enabled`` pauses recording)."""
        return self._recorder

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        runner, mesh = getattr(strategy, "runner", None), getattr(strategy, "mesh", None)
        if runner is None or mesh is None:
            raise TelemetryError(
                f"`PipelineTelemetry` measures HPPStrategy pipelines, but the Trainer runs "
                f"{type(strategy).__name__}. Use `Trainer(strategy=HPPStrategy(...), callbacks=[PipelineTelemetry()])` "
                f"or remove the callback."
            )
        self._every = self._every_arg or max(1, trainer.log_every_n_steps)
        self._recorder = PipelineRecorder(
            trainer.global_rank, mesh.replica, mesh.position, runner.schedule_name, clock_offset_ns()
        )
        self._runner = runner
        runner.schedule_observers.append(self._recorder.instrument)
        # A runner kept from an earlier fit already holds its schedules.
        for sched in runner.schedules:
            self._recorder.instrument(sched)
        self._batches = 0
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._recorder is None:
            return
        index = self._batches
        self._batches += 1
        # Lightning's loggers take values at batches that stepped the optimizer to a global step
        # divisible by log_every_n_steps; flushing on the same batches lets every log reach them.
        step = trainer.global_step
        due = step != self._last_step and step % self._every == 0
        self._last_step = step
        if not due and index != self._trace_step:
            return
        metrics = self._flush(keep_spans_of=self._trace_step)
        if metrics:
            for name, value in mean_metrics(metrics).items():
                pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)
        traced = [m for m in metrics if m.step == self._trace_step]
        if traced:
            self._write_pictures(trainer, traced[0])

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._recorder is not None:
            self._flush(keep_spans_of=self._trace_step)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._recorder is None:
            return
        if self._runner is not None and self._recorder.instrument in self._runner.schedule_observers:
            self._runner.schedule_observers.remove(self._recorder.instrument)
        self._recorder.close()
        self._recorder = None
        self._runner = None

    def _flush(self, keep_spans_of: int | None) -> list[StepMetrics]:
        assert self._recorder is not None
        out = collect(self._recorder, keep_spans_of)
        self.history.extend(out)
        return out

    def _write_pictures(self, trainer: Any, metrics: StepMetrics) -> None:
        from lightning_hpp.telemetry_render import render_timeline_png, write_chrome_trace

        base = self._trace_dir or trainer.log_dir or trainer.default_root_dir  # every rank asks: collective
        if trainer.global_rank != 0:
            return
        os.makedirs(base, exist_ok=True)
        trace = os.path.join(base, f"pipeline_trace_step{metrics.step}.json")
        png = os.path.join(base, f"pipeline_timeline_step{metrics.step}.png")
        write_chrome_trace(metrics.spans, trace)
        render_timeline_png(metrics.spans, png, title=f"step {metrics.step}: bubble {metrics.bubble:.2f} (theory {metrics.bubble_theory:.2f})")
        self.trace_paths += [trace, png]


def metrics_table(metrics: StepMetrics) -> str:
    """A short text summary of one step's metrics (for logs and terminals)."""
    lines = [
        f"step {metrics.step}: {metrics.step_ms:.1f} ms, bubble {metrics.bubble:.3f} "
        f"(theory {metrics.bubble_theory:.3f}, expected {metrics.bubble_expected:.3f}), comm {metrics.comm_share:.3f}",
        "stage  fwd_ms  bwd_ms  comm_ms  idle_ms",
    ]
    for k, t in sorted(metrics.stages.items()):
        lines.append(f"{k:>5}  {t.fwd_ms:6.1f}  {t.bwd_ms:6.1f}  {t.comm_ms:7.1f}  {t.idle_ms:7.1f}")
    return "\n".join(lines)
