"""Where a paired step's time goes (``main.py --paired-only --probe``).

In the paired run every HPPStrategy step is followed by a raw torch pipelining step (or a plain DDP
step) on the same batch. With ``--probe`` each rank also times, on both sides apart, the calls the two
make alike: each stage's forward, backward (a zero-bubble schedule's input pass) and weight pass, the
schedule's ``step`` and the loss (raw: the model's loss function; HPPStrategy: the user's
``training_step`` replayed on the micro-batch's output, ``self.log`` recorded, the loss function inside
it timed on its own row); the non-finite guard's check before each backward, which HPPStrategy's
backward includes (it is timed at its own stage class, hooks included); and what handing shapes over adds to
HPPStrategy's step (``lightning_hpp.pipeline.shapes``): the step's shape id sent before the schedule,
the shape check before each forward send and the hand-over before a stage's first receive (nothing to do while
the shapes repeat).

The table gives, per rank and call, the median wall time on each side, the difference, the calls a
step makes and what the difference costs a step (difference × calls); a call made on one side only runs
inside another row's call (the guard inside the backward, the loss function inside HPPStrategy's loss,
a stage's actions inside the schedule step) and is counted there. A call on one rank's critical
path costs the step what it costs the rank; one the rank makes while another rank is the bottleneck
costs nothing. Probes cost two clock reads and a list append per call (about a microsecond on each
side alike), which the step times of a probed run include.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Label = Callable[[tuple, dict], "str | None"]


class Probes:
    """Class-level timers of the calls a paired step makes, HPPStrategy's (``side = "hpp"``) and raw's
    (``side = "raw"``) apart. :meth:`install` before the models and schedules are built, :meth:`remove` after."""

    def __init__(self) -> None:
        self.side = "hpp"
        self.calls: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        import models
        from torch.distributed.pipelining import schedules as S
        from torch.distributed.pipelining.stage import _PipelineStageBase

        from lightning_hpp.pipeline.runner import PipelineRunner
        from lightning_hpp.pipeline.shapes import BoundaryShapes, StageBoundary
        from lightning_hpp.pipeline.stage import HookedStage
        from lightning_hpp.precision.guards import BoundaryGuard

        def backward(args: tuple, kwargs: dict) -> str:
            stage, full = args[0], kwargs.get("full_backward", args[3] if len(args) > 3 else True)
            return f"{'backward' if full else 'input backward'}, stage {stage.stage_index}"

        def stage_action(what: str, skip: type | None = None) -> Label:  # HPP's backward is timed at HookedStage
            def label(args: tuple, kwargs: dict) -> str | None:
                stage = args[0]
                return None if skip is not None and isinstance(stage, skip) else f"{what}, stage {stage.stage_index}"
            return label

        self._wrap(_PipelineStageBase, "forward_one_chunk", stage_action("forward"))
        self._wrap(_PipelineStageBase, "backward_one_chunk",
                   lambda a, k: None if isinstance(a[0], HookedStage) else backward(a, k))
        self._wrap(_PipelineStageBase, "backward_weight_one_chunk", stage_action("weight", skip=HookedStage))
        self._wrap(HookedStage, "backward_one_chunk", backward)
        self._wrap(HookedStage, "backward_weight_one_chunk", stage_action("weight"))
        self._wrap(S.PipelineScheduleSingle, "step", lambda a, k: "schedule step")
        self._wrap(S.PipelineScheduleMulti, "step", lambda a, k: "schedule step")
        self._wrap(PipelineRunner, "_loss_fn", lambda a, k: "loss")
        self._wrap(BoundaryShapes, "_step_id", lambda a, k: "the step's shape id (sent before the schedule)")
        self._wrap(StageBoundary, "send", lambda a, k: f"shape check before a send, stage {a[0].stage.stage_index}")
        self._wrap(StageBoundary, "receive",
                   lambda a, k: f"shape hand-over before a receive, stage {a[0].stage.stage_index}")
        self._wrap(BoundaryGuard, "before_backward",
                   lambda a, k: f"guard before backward, stage {a[1]} (in its backward)")
        # the model's loss function: raw's loss, and what the user's training_step calls inside HPP's loss (a module
        # global: the step's own lookup and the schedules built after this see the timer)
        self._wrap(models, "loss_fn", lambda a, k: "loss" if self.side == "raw" else "loss function (in HPP's loss)")

    def _wrap(self, owner: Any, name: str, label: Label) -> None:
        """Time ``owner.name`` (a class's method or a module's function) under ``label(args, kwargs)``, a method's
        ``args`` starting with its object; a label of ``None`` is not counted."""
        original = vars(owner)[name]
        calls = self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                what = label(args, kwargs)
                if what is not None:
                    calls[(self.side, what)].append(time.perf_counter_ns() - t0)

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def remove(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def reset(self) -> None:
        """Forget what was timed so far (the warm-up steps)."""
        self.calls.clear()

    def summary(self, steps: int) -> dict[str, dict[str, float]]:
        """Per call: the median µs on each side and the calls a step makes (``steps``: the timed steps)."""
        out: dict[str, dict[str, float]] = {}
        for (side, what), ns in sorted(self.calls.items(), key=lambda kv: kv[0][1]):
            row = out.setdefault(what, {})
            row[f"{side}_us"] = statistics.median(ns) / 1e3
            row[f"{side}_per_step"] = len(ns) / max(1, steps)
        return out


def table(per_rank: list[dict[str, dict[str, float]]], baseline: str = "raw") -> str:
    """Markdown: per rank and call, the median on each side, the difference and its cost per step."""
    lines = [f"| rank | call | HPP µs | {baseline} µs | difference µs | calls per step (HPP / {baseline}) | "
             f"HPP − {baseline} per step, ms |",
             "|---:|---|---:|---:|---:|---|---:|"]
    for rank, rows in enumerate(per_rank):
        for what, r in rows.items():
            hpp, raw = r.get("hpp_us"), r.get("raw_us")
            n_hpp, n_raw = r.get("hpp_per_step", 0.0), r.get("raw_per_step", 0.0)
            both = hpp is not None and raw is not None  # a call on one side only runs inside another row's call
            diff = f"{hpp - raw:+.1f}" if both else ""
            cost = f"{(hpp * n_hpp - raw * n_raw) / 1e3:+.2f}" if both else ""
            lines.append(f"| {rank} | {what} | {'' if hpp is None else f'{hpp:.1f}'} | "
                         f"{'' if raw is None else f'{raw:.1f}'} | {diff} | {n_hpp:g} / {n_raw:g} | {cost} |")
    return "\n".join(lines)
