"""``PipelineTelemetry``: the Lightning callback that records, exchanges and logs per-stage timings.
"""

from __future__ import annotations

import os
import socket
import statistics
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback

from lightning_hpp.errors import TelemetryError
from lightning_hpp.pipeline.view import pipeline_view
from lightning_hpp.telemetry.model import now_ns
from lightning_hpp.telemetry.recorder import PipelineRecorder, StepMetrics, collect, mean_metrics
from lightning_hpp.telemetry.render import render_timeline_png, write_chrome_trace
from lightning_hpp.validation import check_int


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
        dist.all_gather_object(now, now_ns())
        diffs.append(now[dist.get_rank()] - now[0])
    return int(statistics.median(diffs))


class PipelineTelemetry(Callback):
    """Per-stage timings, bubble and communication share of an HPPStrategy pipeline, logged.

    Logged every ``every_n_steps`` optimizer steps (the mean over the steps since the last log),
    the same values on every rank: ``pipeline/bubble``, ``pipeline/bubble_theory``,
    ``pipeline/bubble_expected``, ``pipeline/bubble_replayed``, ``pipeline/comm_share``, ``pipeline/step_ms``,
    ``pipeline/stage_{k}/{fwd,bwd,comm,idle}_ms`` and what batches of new shapes cost: ``pipeline/new_shape`` (the
    share of steps whose boundary shapes were new), ``pipeline/shape_ms`` (host time handing them over) and
    ``pipeline/shape_alloc_mb`` (receive buffers grown). See the module docstring for the accounting.

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

    def __init__(
        self,
        every_n_steps: int | None = None,
        trace_step: int | None = None,
        trace_dir: str | os.PathLike | None = None,
    ) -> None:
        for name, value, low in (("every_n_steps", every_n_steps, 1), ("trace_step", trace_step, 0)):
            check_int(value, f"PipelineTelemetry({name}=...)", minimum=low, optional=True, error=TelemetryError)
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
        view = pipeline_view(trainer)
        runner, mesh = (view.runner, view.mesh) if view is not None else (None, None)
        if runner is None or mesh is None:
            raise TelemetryError(
                f"`PipelineTelemetry` measures HPPStrategy pipelines, but the Trainer runs "
                f"{type(trainer.strategy).__name__}. Use `Trainer(strategy=HPPStrategy(...), "
                "callbacks=[PipelineTelemetry()])` "
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
        self.stop()

    def stop(self) -> None:
        """Stop recording and exchanging for the rest of the fit (``history`` is kept). Call it on every rank
        at the same batch: the exchange is collective."""
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
        base = self._trace_dir or trainer.log_dir or trainer.default_root_dir  # every rank asks: collective
        if trainer.global_rank != 0:
            return
        os.makedirs(base, exist_ok=True)
        trace = os.path.join(base, f"pipeline_trace_step{metrics.step}.json")
        png = os.path.join(base, f"pipeline_timeline_step{metrics.step}.png")
        write_chrome_trace(metrics.spans, trace)
        render_timeline_png(
            metrics.spans,
            png,
            title=f"step {metrics.step}: bubble {metrics.bubble:.2f} (theory {metrics.bubble_theory:.2f})",
        )
        self.trace_paths += [trace, png]


def metrics_table(metrics: StepMetrics) -> str:
    """A short text summary of one step's metrics (for logs and terminals)."""
    lines = [
        f"step {metrics.step}: {metrics.step_ms:.1f} ms, bubble {metrics.bubble:.3f} "
        f"(theory {metrics.bubble_theory:.3f}, expected {metrics.bubble_expected:.3f}, replayed "
        f"{metrics.bubble_replayed:.3f}), "
        f"comm {metrics.comm_share:.3f}",
        "stage  fwd_ms  bwd_ms  comm_ms  idle_ms",
    ]
    for k, t in sorted(metrics.stages.items()):
        lines.append(f"{k:>5}  {t.fwd_ms:6.1f}  {t.bwd_ms:6.1f}  {t.comm_ms:7.1f}  {t.idle_ms:7.1f}")
    return "\n".join(lines)
