"""Every schedule's per-rank compute order, built offline from torch's own schedule classes.

torch's schedules are lists of ``_Action`` per rank (``pipeline_order``); :func:`schedule_actions`
builds one without processes and flattens it to :class:`Act` (stage, ``F``/``B``/``I``/``W``,
micro-batch), and :func:`dependencies` says what each action waits for. :func:`walk_orders` is the one
walk of those orders both replays are built on: the telemetry's against measured costs
(:func:`lightning_hpp.telemetry.model.simulate`), the planner's against predicted ones
(:func:`lightning_hpp.planning.replay.program`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any, NamedTuple

from torch.distributed.pipelining import schedules as _S

from lightning_hpp.errors import ScheduleError
from lightning_hpp.pipeline.schedules import SCHEDULES, check_schedule


class Act(NamedTuple):
    """One compute action: stage, ``"F"``/``"B"``/``"I"``/``"W"``, micro-batch.

    ``held``: the action runs inside an overlapped pair (torch's ``OVERLAP_F_B``, DualPipeV's forward of
    one micro-batch beside the backward of another) before the pair's last action. torch's runtime runs
    the pair's actions one after the other and posts their sends to other ranks after the whole pair, so
    what a held action sends leaves when the pair's last action is done (a stage on the same rank gets it
    at once)."""

    stage: int
    kind: str
    mb: int
    held: bool = False

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
            pair = _flatten(a.sub_actions)  # an overlapped pair: all but its last action are held (see Act)
            out.extend([x._replace(held=True) for x in pair[:-1]] + pair[-1:])
        elif a.computation_type.value in ("F", "B", "I", "W"):
            out.append(Act(a.stage_index, a.computation_type.value, a.microbatch_index))
    return out


def orders_of(schedule: Any, num_stages: int, pp: int) -> dict[int, list[Act]]:
    """The compute order of every pipeline rank for a live or offline schedule object."""
    m = schedule._n_microbatches
    if hasattr(schedule, "_stages"):
        return {r: _flatten(schedule.pipeline_order[r]) for r in range(pp)}
    return {s: _single_stage_order(type(schedule), s, num_stages, m) for s in range(num_stages)}


def schedule_actions(schedule: str, pp: int, n_microbatches: int, n_stages: int | None = None) -> dict[int, list[Act]]:
    """Build a schedule's per-rank compute order offline (no processes, no process group).

    Args:
        schedule: A name of :data:`lightning_hpp.pipeline.schedules.SCHEDULES`.
        pp: Pipeline ranks.
        n_microbatches: Micro-batches per step.
        n_stages: Stages in the pipeline; default ``pp`` for one-stage-per-rank schedules, ``2*pp``
            for the others.

    Returns:
        ``{rank: [Act, ...]}`` in the order each rank runs them.

    Raises:
        lightning_hpp.errors.ScheduleError: The schedule cannot run with these numbers.
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"Unknown schedule {schedule!r}. Valid schedules: {', '.join(SCHEDULES)}.")
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
    return orders_of(sched, n_stages, pp)


def output_key(a: Act) -> tuple[str, int, int]:
    """The key of what ``a`` makes, as :func:`dependencies` names it (a backward's: ``"G"``, the input gradient)."""
    return ("G" if a.kind in ("B", "I") else a.kind, a.stage, a.mb)


def dependencies(a: Act, n_stages: int) -> list[tuple[str, int, int]]:
    """What action ``a`` waits for, as ``(kind, stage, micro-batch)`` keys of finished work: a forward
    the previous stage's forward, a backward (``B`` or ``I``) its own forward and the next stage's input
    gradient (``"G"``: its ``B`` or ``I``), a ``W`` its own ``I``."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind in ("B", "I"):
        deps = [("F", a.stage, a.mb)]
        if a.stage < n_stages - 1:
            deps.append(("G", a.stage + 1, a.mb))
        return deps
    return [("G", a.stage, a.mb)]  # W after its I


class Step(NamedTuple):
    """One action of a walk (:func:`walk_orders`), by its index in the walk.

    Attributes:
        rank: The rank that runs it.
        act: The action.
        prev: The index of the action before it on its rank (``-1`` for the rank's first).
        waits: The indices of the actions whose finish it waits for: the makers of its inputs, on its own
            rank, or for an input from another rank the action after which that input is sent (the last
            action of the maker's overlapped pair, see :class:`Act`).
    """

    rank: int
    act: Act
    prev: int
    waits: tuple[int, ...]


def walk_orders(
    orders: dict[int, list[Act]], n_stages: int, deadlock: Callable[[dict[int, str]], Exception]
) -> list[Step]:
    """Every action of ``orders`` once, in an order where each comes after what it waits for.

    Each rank's actions keep their order; a rank moves on while the next action's inputs exist, then the
    next rank. Replaying the walk with ``finish(i) = max(finish(prev), finish(waits)) + cost`` gives each
    action's finish when every action starts as soon as its rank is free and its inputs have arrived.

    Args:
        orders: ``{rank: [Act, ...]}`` as from :func:`schedule_actions`.
        n_stages: Stages of the pipeline.
        deadlock: The error to raise for ``{rank: action it waits at}`` when an action waits on one that
            never runs.
    """
    # what each walked action made: where, the step its own rank waits for, the step other ranks wait for
    where: dict[tuple[str, int, int], int] = {}
    local: dict[tuple[str, int, int], int] = {}
    remote: dict[tuple[str, int, int], int] = {}
    held: dict[int, list[tuple[str, int, int]]] = {r: [] for r in orders}
    steps: list[Step] = []
    ptr = dict.fromkeys(orders, 0)
    last = dict.fromkeys(orders, -1)
    left = sum(len(v) for v in orders.values())
    while left:
        moved = False
        for r, acts in orders.items():
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                waits = [(local if where.get(d) == r else remote).get(d) for d in dependencies(a, n_stages)]
                if any(w is None for w in waits):
                    break
                i = len(steps)
                steps.append(Step(r, a, last[r], tuple(waits)))
                key = output_key(a)
                where[key], local[key] = r, i
                held[r].append(key)
                if not a.held:  # the pair (or the action alone) is done: what it made leaves now
                    remote.update(dict.fromkeys(held[r], i))
                    held[r].clear()
                last[r] = i
                ptr[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise deadlock({r: str(orders[r][ptr[r]]) for r in orders if ptr[r] < len(orders[r])})
    return steps
