"""Every schedule's per-rank compute order, built offline from torch's own schedule classes.

torch's schedules are lists of ``_Action`` per rank (``pipeline_order``); :func:`schedule_actions`
builds one without processes and flattens it to :class:`Act` (stage, ``F``/``B``/``I``/``W``,
micro-batch), and :func:`dependencies` says what each action waits for. The telemetry replays these
orders against measured costs (:mod:`lightning_hpp.telemetry.model`), the planner against predicted
ones (:mod:`lightning_hpp.planning.replay`).
"""

from __future__ import annotations

from collections.abc import Iterable
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


