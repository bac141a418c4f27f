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
per-stage costs and free communication (what the bubble would be from stage imbalance alone), and
``bubble_replayed`` the same order replayed with everything measured: each action also takes its rank's
communication and overhead per action (the time a rank spends in no span), idle counted as measured.
What still separates ``bubble`` from ``bubble_replayed`` is what a replay of the order with mean costs
does not explain: costs that vary from one micro-batch to the next, and waits the order does not make.

The offline model of a schedule (:func:`~lightning_hpp.telemetry.model.schedule_actions`,
:func:`~lightning_hpp.telemetry.model.simulate`) lives in :mod:`lightning_hpp.telemetry.model`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_hpp._timing import synchronize
from lightning_hpp.errors import TelemetryError
from lightning_hpp.pipeline.orders import orders_of
from lightning_hpp.pipeline.schedules import SCHEDULES
from lightning_hpp.pipeline.shapes import step_shape_stats
from lightning_hpp.pipeline.transfers import TransferListener, add_listener, remove_listener
from lightning_hpp.telemetry.model import COMM_KINDS, Act, Span, now_ns, simulate, theoretical_bubble


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
    shape: tuple[bool, int, int] = (False, 0, 0)  # new shapes handed over, their host ns, receive bytes allocated


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
_RECORDERS: set[int] = set()


class _RecordedTransfers(TransferListener):
    """The recorders' view of torch's transfers: a POST span per tagged batch, a wait span per tagged work."""

    def posted(self, ops: list, works: list, t0_ns: int, t1_ns: int) -> None:
        if not _OPS:
            return
        tags = [_OPS.pop(id(op), None) for op in ops]
        tagged = [t for t in tags if t is not None]
        if not tagged:
            return
        rec, _, stage, _ = tagged[0]
        if rec._open is not None:
            rec._open.spans.append(("POST", stage, -1, t0_ns, t1_ns, None))
        if len(works) == len(tags):
            for w, t in zip(works, tags):
                if t is not None:
                    _WORKS[id(w)] = (*t, t0_ns)
        elif works:  # a coalesced batch (NCCL): one work stands for the whole batch
            recv = [t for t in tagged if t[1].startswith("RECV")]
            _WORKS[id(works[-1])] = (*(recv or tagged)[0], t0_ns)

    def waiting(self, work: Any) -> Any:
        tag = _WORKS.pop(id(work), None) if _WORKS else None
        return None if tag is None else (tag, now_ns())

    def waited(self, work: Any, token: Any, error: BaseException | None) -> None:
        if token is None or error is not None:
            return
        (rec, kind, stage, mb, post), t0 = token
        rec._sync()
        if rec._open is not None:
            rec._open.spans.append((kind, stage, mb, t0, now_ns(), post))


_LISTENER = _RecordedTransfers()


def _install_p2p_hooks() -> None:
    add_listener(_LISTENER)


def _remove_p2p_hooks() -> None:
    if not _RECORDERS:
        remove_listener(_LISTENER)
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

    def __init__(
        self, rank: int, replica: int = 0, position: int = 0, schedule_name: str | None = None, clock_offset_ns: int = 0
    ) -> None:
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
        self.info = ScheduleInfo(name, pp, schedule._n_microbatches, n_stages, orders_of(schedule, n_stages, pp))
        if stages[0].device.type == "cuda":
            self._cuda = stages[0].device
        for stage in stages:
            self._wrap_stage(stage)
        self._wrap_schedule(schedule)
        schedule._hpp_recorder = self
        _install_p2p_hooks()

    def _sync(self) -> None:
        if self._cuda is not None:
            synchronize(self._cuda)

    def _timed(
        self, kind: str, stage: int, fn: Callable, mb_of: Callable[..., int], kind_of: Callable[..., str] | None = None
    ) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            open_ = self._open
            if open_ is None:
                return fn(*args, **kwargs)
            t0 = now_ns()
            out = fn(*args, **kwargs)
            self._sync()
            k = kind_of(*args, **kwargs) if kind_of is not None else kind
            open_.spans.append((k, stage, mb_of(*args, **kwargs), t0, now_ns(), None))
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
            "B",
            s,
            stage.backward_one_chunk,
            first,
            lambda chunk, loss=None, full_backward=True, *a, **k: "B" if full_backward else "I",
        )
        stage.backward_weight_one_chunk = self._timed("W", s, stage.backward_weight_one_chunk, first)
        for kind, attr in (
            ("RECV_F", "get_fwd_recv_ops"),
            ("RECV_B", "get_bwd_recv_ops"),
            ("SEND_F", "get_fwd_send_ops"),
            ("SEND_B", "get_bwd_send_ops"),
        ):
            setattr(stage, attr, self._tagging(kind, s, getattr(stage, attr)))
        stage._hpp_recorder = self

    def _wrap_schedule(self, schedule: Any) -> None:
        step = schedule.step
        compute_loss = schedule._maybe_compute_loss

        def maybe_compute_loss(
            stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any, **kwargs: Any
        ) -> Any:
            open_ = self._open
            if open_ is None or not stage.is_last:
                return compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
            t0 = now_ns()
            out = compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
            self._sync()
            open_.spans.append(("L", stage.stage_index, mb_index, t0, now_ns(), None))
            return out

        schedule._maybe_compute_loss = maybe_compute_loss

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            index = self._count
            self._count += 1
            if not self.enabled:
                return step(*args, **kwargs)
            self._sync()
            self._open = RankStep(self.rank, self.replica, self.position, index, now_ns(), 0)
            try:
                return step(*args, **kwargs)
            finally:
                self._sync()
                rec, self._open = self._open, None
                rec.end = now_ns()
                shape = step_shape_stats(schedule)
                if shape is not None:
                    rec.shape = (shape.new, shape.ns, shape.alloc_bytes)
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
                rec.spans = [
                    (k, s, mb, t0 - off, t1 - off, None if p is None else p - off) for k, s, mb, t0, t1, p in rec.spans
                ]
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
        bubble_expected: The schedule replayed with the measured per-stage costs and free links (what stage
            imbalance alone would give).
        bubble_replayed: The schedule replayed with everything measured: the per-stage costs and, per action,
            its rank's communication (posting and moving the data) and its overhead (the time in no span:
            the runtime's own work between actions); idle as measured (the overhead counts, communication not).
        comm_share: Communication time / step time, over all ranks.
        stages: Per-stage :class:`StageTimes`.
        spans: Every rank's spans with ``comm`` filled (kept only where a picture is asked for).
        new_shape: 1 where the step's boundary shapes were new to the pipeline (handed over in band,
            :mod:`lightning_hpp.pipeline.shapes`), else 0: averaged over logged steps, the share of such steps.
        shape_ms: Host time the ranks spent handing shapes over in the step (the slowest rank's): headers,
            metadata, receive buffers viewed or allocated.
        shape_alloc_mb: Receive storage the step allocated for shapes larger than any before, over all ranks.
    """

    step: int
    step_ms: float
    bubble: float
    bubble_theory: float
    bubble_expected: float
    comm_share: float
    stages: dict[int, StageTimes]
    bubble_replayed: float = float("nan")
    spans: list[Span] = field(default_factory=list, repr=False)
    new_shape: float = 0.0
    shape_ms: float = 0.0
    shape_alloc_mb: float = 0.0

    def as_log_dict(self, prefix: str = "pipeline") -> dict[str, float]:
        out = {
            f"{prefix}/bubble": self.bubble,
            f"{prefix}/bubble_theory": self.bubble_theory,
            f"{prefix}/bubble_expected": self.bubble_expected,
            f"{prefix}/bubble_replayed": self.bubble_replayed,
            f"{prefix}/comm_share": self.comm_share,
            f"{prefix}/step_ms": self.step_ms,
            f"{prefix}/new_shape": self.new_shape,
            f"{prefix}/shape_ms": self.shape_ms,
            f"{prefix}/shape_alloc_mb": self.shape_alloc_mb,
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
    # stage -> per-action comm, overhead
    extra: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        totals = {"fwd": 0.0, "bwd": 0.0, "comm": 0.0}
        covered, actions = 0, 0
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
            covered += dur
            if kind in ("F", "B", "I", "W"):
                costs[(stage, kind)].append(dur)
                actions += 1
            by_stage[stage][bucket] += ns / 1e6
            totals[bucket] += ns / 1e6
            spans.append(Span(rec.rank, kind, stage, mb, t0, t1, post, comm))
        for (stage, _mb), ns in loss_ns.items():
            costs[(stage, "L")].append(ns)
        lo, hi = window[rec.replica]
        step_ms = (hi - lo) / 1e6
        idle = max(0.0, step_ms - totals["fwd"] - totals["bwd"] - totals["comm"])
        per_rank[rec.rank] = {"step": step_ms, "idle": idle, "comm": totals["comm"]}
        if actions:
            for stage in by_stage:
                extra[stage]["comm"].append(totals["comm"] * 1e6 / actions)
                extra[stage]["overhead"].append(max(0, rec.end - rec.start - covered) / actions)
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
        k: StageTimes(
            *(statistics.fmean(stage_sum[k][n]) if stage_sum[k][n] else 0.0 for n in ("fwd", "bwd", "comm", "idle"))
        )
        for k in sorted(stage_sum)
    }
    return StepMetrics(
        step=records[0].step,
        step_ms=statistics.fmean(steps) if steps else 0.0,
        bubble=bubble,
        bubble_theory=theoretical_bubble(info.name, info.pp, info.m, info.v)
        if info.name in SCHEDULES
        else float("nan"),
        bubble_expected=_expected_bubble(info, costs),
        comm_share=comm_share,
        stages=stages,
        bubble_replayed=_replayed_bubble(info, costs, extra),
        spans=sorted(spans, key=lambda s: (s.rank, s.start)),
        new_shape=float(any(rec.shape[0] for rec in records)),
        shape_ms=max(rec.shape[1] for rec in records) / 1e6,
        shape_alloc_mb=sum(rec.shape[2] for rec in records) / 2**20,
    )


def _compute_costs(costs: dict[tuple[int, str], list[float]]) -> Callable[[Act], float]:
    """Each action's mean measured compute: its stage's mean of that kind (the loss, right after the last
    stage's forward and holding back its backward, counted with the forward)."""
    mean = {k: statistics.fmean(v) for k, v in costs.items()}

    def compute(a: Act) -> float:
        return mean.get((a.stage, a.kind), 0.0) + (mean.get((a.stage, "L"), 0.0) if a.kind == "F" else 0.0)

    return compute


def _expected_bubble(info: ScheduleInfo, costs: dict[tuple[int, str], list[float]]) -> float:
    try:
        return simulate(info.orders, _compute_costs(costs)).bubble
    except TelemetryError:
        return float("nan")


def _replayed_bubble(
    info: ScheduleInfo, costs: dict[tuple[int, str], list[float]], extra: dict[int, dict[str, list[float]]]
) -> float:
    """The schedule replayed with its stage costs plus, per action, its rank's communication and overhead.

    An action lasts its compute, its rank's communication per action (the data it posts and waits for,
    once the peer has posted) and its rank's overhead per action; a rank's idle is the makespan less its
    compute and communication, as :func:`analyze` counts the measured one."""
    compute = _compute_costs(costs)
    comm = {k: statistics.fmean(v["comm"]) for k, v in extra.items()}
    overhead = {k: statistics.fmean(v["overhead"]) for k, v in extra.items()}
    try:
        sim = simulate(info.orders, lambda a: compute(a) + comm.get(a.stage, 0.0) + overhead.get(a.stage, 0.0))
    except TelemetryError:
        return float("nan")
    if sim.makespan <= 0:
        return 0.0
    busy = {r: sum(compute(a) + comm.get(a.stage, 0.0) for a, _, _ in acts) for r, acts in sim.starts.items()}
    return statistics.fmean(max(0.0, 1 - b / sim.makespan) for b in busy.values())


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
