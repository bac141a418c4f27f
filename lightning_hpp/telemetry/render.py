"""Pictures of a pipeline schedule: a text grid, a Chrome/Perfetto trace and a PNG timeline.

:func:`schedule_grid` draws a schedule's order offline, one row per time slot and one column per
rank, every action one slot (torchgpipe's ``clock_cycles`` table, built from torch's own orders)::

    gpipe  pp=2  stages=2  microbatches=4
    slot  rank 0  rank 1
       0  0F0     .
       1  0F1     1F0
       2  0F2     1F1
       ...

:func:`write_chrome_trace` and :func:`render_timeline_png` draw recorded spans (from
:class:`lightning_hpp.telemetry.callback.PipelineTelemetry`): one track per rank, one slice per forward,
backward, send and receive of each micro-batch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from lightning_hpp.pipeline.schedules import SCHEDULES
from lightning_hpp.telemetry.model import Span, schedule_actions, simulate, theoretical_bubble

CATEGORY = {
    "F": "forward",
    "L": "loss",
    "B": "backward",
    "I": "backward",
    "W": "backward",
    "SEND_F": "send",
    "SEND_B": "send",
    "RECV_F": "recv",
    "RECV_B": "recv",
}
COLORS = {"F": "#4C72B0", "L": "#8172B2", "B": "#DD8452", "I": "#2A9D8F", "W": "#55A868"}
COMM_COLOR, WAIT_COLOR = "#444444", "#CCCCCC"


def schedule_grid(schedule_name: str, pp: int, n_microbatches: int, n_stages: int | None = None) -> str:
    """The schedule as a text grid (time slot × rank), built offline from torch's action orders.

    Every action takes one slot and starts as soon as its inputs exist, so a ``.`` is a slot the
    rank waits: the bubble of the schedule with equal action costs.

    Args:
        schedule_name: A name of :data:`lightning_hpp.pipeline.schedules.SCHEDULES`.
        pp: Pipeline ranks.
        n_microbatches: Micro-batches per step.
        n_stages: Stages; default ``pp`` (one per rank) or ``2*pp`` for multi-stage schedules.

    Returns:
        The grid, with a header line and a line giving the idle share.

    Raises:
        lightning_hpp.errors.TelemetryError: Unknown schedule.
        lightning_hpp.errors.ScheduleError: The schedule cannot run with these numbers.
    """
    orders = schedule_actions(schedule_name, pp, n_microbatches, n_stages)
    n_stages = 1 + max(a.stage for acts in orders.values() for a in acts)
    sim = simulate(orders, lambda a: 1.0)
    slots = int(round(sim.makespan))
    cells = {(int(round(s)), r): str(a) for r, runs in sim.starts.items() for a, s, _ in runs}
    width = max(6, *(len(c) for c in cells.values())) + 2
    ranks = sorted(orders)
    lines = [
        f"{schedule_name}  pp={pp}  stages={n_stages}  microbatches={n_microbatches}",
        "slot  " + "".join(f"{'rank ' + str(r):<{width}}" for r in ranks).rstrip(),
    ]
    for t in range(slots):
        lines.append(f"{t:>4}  " + "".join(f"{cells.get((t, r), '.'):<{width}}" for r in ranks).rstrip())
    idle = slots * len(ranks) - len(cells)
    v = n_stages // pp
    theory = theoretical_bubble(schedule_name, pp, n_microbatches, v) if schedule_name in SCHEDULES else float("nan")
    lines.append(
        f"idle {idle} of {slots * len(ranks)} slots = {idle / (slots * len(ranks)):.3f} (theory, equal costs: "
        f"{theory:.3f})"
    )
    return "\n".join(lines)


def _label(s: Span) -> str:
    return f"{s.stage}{s.kind}{s.mb}"


def write_chrome_trace(spans: Iterable[Span], path: str | os.PathLike) -> str:
    """Write spans as a Chrome/Perfetto trace (open in ``chrome://tracing`` or ui.perfetto.dev).

    One process track per rank; one complete ("X") slice per forward, loss, backward, send wait
    and receive wait, named like the schedule grid (``0F3`` = stage 0, forward, micro-batch 3).
    Waits carry ``comm_ms`` (data moving) and ``dependency_ms`` (waiting for the peer) in ``args``.

    Args:
        spans: Recorded spans (``StepMetrics.spans``).
        path: Output ``.json`` file.

    Returns:
        The path written.
    """
    spans = [s for s in spans if s.kind in CATEGORY]
    t0 = min((s.start for s in spans), default=0)
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "pid": rank, "tid": 0, "name": "process_name", "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "pid": rank, "tid": 0, "name": "process_sort_index", "args": {"sort_index": rank}})
        events.append({"ph": "M", "pid": rank, "tid": 0, "name": "thread_name", "args": {"name": "pipeline"}})
    for s in spans:
        args: dict[str, Any] = {"stage": s.stage, "microbatch": s.mb}
        if s.comm is not None:
            args.update(comm_ms=s.comm / 1e6, dependency_ms=(s.end - s.start - s.comm) / 1e6)
        events.append(
            {
                "ph": "X",
                "pid": s.rank,
                "tid": 0,
                "ts": (s.start - t0) / 1e3,
                "dur": max(0.001, (s.end - s.start) / 1e3),
                "name": _label(s),
                "cat": CATEGORY[s.kind],
                "args": args,
            }
        )
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def render_timeline_png(spans: Iterable[Span], path: str | os.PathLike, title: str | None = None) -> str:
    """Draw one step's spans as a PNG timeline: one row per rank, time in ms.

    Compute slices are coloured by kind and labelled with their micro-batch; a p2p wait is drawn
    as a thin bar, light grey while the peer is still computing and dark grey while data moves.

    Args:
        spans: Recorded spans (``StepMetrics.spans``).
        path: Output ``.png`` file.
        title: Figure title.

    Returns:
        The path written.

    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "`render_timeline_png` needs matplotlib: `pip install matplotlib` (or `pip install lightning-hpp[bench]`)."
        ) from e
    spans = [s for s in spans if s.kind in CATEGORY]
    t0 = min((s.start for s in spans), default=0)
    t1 = max((s.end for s in spans), default=1)
    ranks = sorted({s.rank for s in spans})
    fig = Figure(figsize=(12, 1.5 + 0.7 * max(1, len(ranks))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    span_ms = max(1e-9, (t1 - t0) / 1e6)
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for s in (s for s in spans if s.rank == rank):
            x, w = (s.start - t0) / 1e6, (s.end - s.start) / 1e6
            if s.kind in COLORS:
                ax.broken_barh([(x, w)], (y - 0.35, 0.7), facecolors=COLORS[s.kind], edgecolors="white", linewidth=0.5)
                if w > span_ms * 0.025:
                    ax.text(x + w / 2, y, f"{s.kind}{s.mb}", ha="center", va="center", fontsize=7, color="white")
            else:
                comm = (s.comm if s.comm is not None else s.end - s.start) / 1e6
                ax.broken_barh([(x, w - comm)], (y - 0.12, 0.24), facecolors=WAIT_COLOR)
                ax.broken_barh([(x + w - comm, comm)], (y - 0.12, 0.24), facecolors=COMM_COLOR)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("ms since the step started")
    fig.legend(
        handles=[
            Patch(color=COLORS["F"], label="forward"),
            Patch(color=COLORS["L"], label="loss"),
            Patch(color=COLORS["B"], label="backward"),
            Patch(color=COLORS["I"], label="backward (input)"),
            Patch(color=COLORS["W"], label="backward (weight)"),
            Patch(color=WAIT_COLOR, label="waiting for peer"),
            Patch(color=COMM_COLOR, label="communication"),
        ],
        loc="lower center",
        ncol=7,
        fontsize=7,
        frameon=False,
    )
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    return path
