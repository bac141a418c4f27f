"""Predicted against measured stage times, for plans made by ``plan="auto"``.

The partitioner predicts each stage's time per micro-batch (forward + backward + its sends);
:class:`PipelineTelemetry` measures forward and backward per step. After ``report_after`` steps
this callback logs both per stage (``placement/stage_{k}/predicted_ms``, ``.../measured_ms``) and
for the step (``placement/step_predicted_ms``, ``placement/step_measured_ms``, the schedule's part of
the step as telemetry times it) and prints a table on rank 0, so a poor profile or a drifting device
shows up early.
"""

from __future__ import annotations

import statistics
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_hpp.errors import TelemetryError
from lightning_hpp.pipeline.view import pipeline_view
from lightning_hpp.telemetry.callback import PipelineTelemetry
from lightning_hpp.validation import check_int


class PlacementReport(Callback):
    """Log predicted vs measured per-micro-batch stage times once, after ``report_after`` steps.

    With ``stop_telemetry`` (``plan="auto"`` started the telemetry only for this report) the
    telemetry stops recording and exchanging once the report is made.
    """

    def __init__(self, report_after: int = 10, stop_telemetry: bool = False) -> None:
        self.report_after = check_int(report_after, "PlacementReport(report_after=...)", error=TelemetryError)
        self.stop_telemetry = stop_telemetry  # the telemetry was started for this report alone: stop it after
        self.rows: list[tuple[int, float, float]] = []
        self.step: tuple[float, float] | None = None  # predicted, measured step ms
        self._done = False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self._done or trainer.global_step < self.report_after:
            return
        view = pipeline_view(trainer)
        plan = view.plan if view is not None else None
        predicted = (plan.meta.get("predicted") or {}).get("stage_ms") if plan is not None else None
        telemetry = next((cb for cb in trainer.callbacks if isinstance(cb, PipelineTelemetry)), None)
        if not predicted or telemetry is None or not telemetry.history:
            return
        m = view.n_microbatches
        self.rows = []
        for k, pred in enumerate(predicted):
            per_step = [(h.stages[k].fwd_ms + h.stages[k].bwd_ms) for h in telemetry.history if k in h.stages]
            if not per_step:
                return
            measured = statistics.median(per_step) / m
            self.rows.append((k, float(pred), measured))
        self._done = True
        if self.stop_telemetry:  # same batch on every rank: the history it decides on is the exchanged one
            telemetry.stop()
        meta = plan.meta["predicted"]
        schedule_ms = meta.get("pipeline_ms") or (m + len(predicted) - 1) * max(predicted)  # the step less its update
        self.step = (float(schedule_ms), statistics.median(h.step_ms for h in telemetry.history))
        for k, pred, meas in self.rows:
            pl_module.log(f"placement/stage_{k}/predicted_ms", pred, on_step=True, on_epoch=False, batch_size=1)
            pl_module.log(f"placement/stage_{k}/measured_ms", meas, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("placement/step_predicted_ms", self.step[0], on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("placement/step_measured_ms", self.step[1], on_step=True, on_epoch=False, batch_size=1)
        if trainer.is_global_zero:
            title = (
                f"plan='auto' ({meta.get('schedule')}, m={m}, pp={meta.get('pp_degree')} x "
                f"dp={meta.get('dp_degree')}): "
                f"stage time per micro-batch, predicted vs measured (fwd+bwd, median)"
            )
            lines = [title, "stage  predicted_ms  measured_ms  ratio"]
            lines += [f"{k:<5}  {p:>12.3f}  {q:>11.3f}  {q / p if p else float('nan'):>5.2f}" for k, p, q in self.rows]
            lines.append(f"step (schedule only): predicted {self.step[0]:.3f} ms, measured {self.step[1]:.3f} ms")
            print("\n".join(lines), flush=True)
