"""The straggler watch: a rank that gets slow is named, and the job warns, stops or re-plans.

A heterogeneous pipeline is planned for measured device speeds; when one device slows down
(throttling, a noisy neighbour, a failing link) the whole pipeline runs at its pace. The watch,
on by default (``PlacementOptions(watch="warn")``), notices it.

Measuring. Each rank times its own stages' compute (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``: two clock marks per action) and each wait on a pipeline transfer
(torch's ``_batch_p2p`` / ``_wait_batch_p2p``, through which every schedule sends and receives),
per training step, on its device's clock (:func:`~lightning_hpp._timing.device_clock`: CUDA events on
CUDA, whose kernels run asynchronously, read when the step's times are next looked at; the host clock on
CPU). Nothing is exchanged for it: every rank compares its own numbers with its own
recent past (:class:`~lightning_hpp.telemetry.slowdown.SlowdownDetector`, which says how).

Compute is compared with the plan's prediction too (``plan.meta["predicted"]``, for ``plan="auto"``):
the finding says both. A transfer wait is watched the same way (a slow link), with ``wait_ms`` as
the smallest increase that counts, and a transfer that fails or times out (the strategy's
``timeout``) raises :class:`~lightning_hpp.errors.TransferError` naming both ranks.

Deciding together. The flag of each rank (its slowdown ratio, 0 when nothing was found) rides on
the step's one collective (a :class:`~lightning_hpp.pipeline.runner.StepCheck` of the runner: the
all-reduce that brings the loss to every rank), so every rank learns in the same step that some
pipeline position is slow, and all act at the same batch. That collective is posted before the
rank's last backward of a step, before the step's own times are complete: a rank's flag says what
it found up to the step before (a finding is one step later than its data, and names its step).

Acting (``WatchOptions.action``):

* ``"warn"``: the slow rank logs the finding (rank, host, device kind, stages, measured against
  expected, since which step); training goes on.
* ``"stop"``: every rank writes a checkpoint ``step-<N>`` into ``CheckpointOptions(dir=...)``,
  records the measured per-rank speeds in its ``metadata.json`` (``extra.watch``) and ends with
  exit code :data:`STOP_EXIT_CODE` (75).
* ``"replan"``: the same, with exit code :data:`REPLAN_EXIT_CODE` (76). Only compute findings change
  the recorded speeds; a slow link stops the job the same way, and re-planning then keeps the speeds.
  Started again (the same command with ``CheckpointOptions(resume="auto")``, or torchrun
  ``--max-restarts``), ``plan="auto"`` plans with the recorded speeds (a slowed rank's costs are its
  kind's measured costs divided by its speed: :func:`~lightning_hpp.planning.speeds.with_rank_speeds`)
  and the run resumes from that
  checkpoint on the new cut. Re-planning inside the running processes is not done: the cut, the
  optimizers and Lightning's loops would all have to be rebuilt in place.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback

from lightning_hpp._dist import all_gather_object
from lightning_hpp._timing import HostClock, device_clock
from lightning_hpp.errors import TransferError
from lightning_hpp.pipeline.mesh import stages_of_position
from lightning_hpp.pipeline.transfers import TransferListener, add_listener, remove_listener
from lightning_hpp.pipeline.view import pipeline_view
from lightning_hpp.telemetry.slowdown import (
    META_KEY,
    REPLAN_EXIT_CODE,
    STOP_EXIT_CODE,
    Finding,
    SlowdownDetector,
    WatchOptions,
)


# ============================================================================================ timing
class _StepTimer:
    """Times this rank's stage compute and transfer waits per training ``schedule.step``."""

    def __init__(self, rank: int, describe_peer: Callable[[int], str], timeout_s: float | None) -> None:
        self.rank = rank
        self.describe_peer = describe_peer
        self.timeout_s = timeout_s
        self.clock: Any = HostClock()  # the stages' device's (set when a schedule is instrumented)
        self.compute: list[tuple[Any, Any]] = []  # this step's compute spans (clock marks)
        self.waits: list[tuple[Any, Any, int]] = []  # this step's transfer waits: marks and peer
        self.fresh = False  # the times of a step no one has read yet
        self.label = 0  # the global step being run (set by the watch)
        self.fresh_label = 0  # the global step the fresh times are of
        self._fresh: tuple[Any, list, list] | None = None  # the last step's spans, read at the first look
        self._fresh_times: tuple[int, int, int | None] = (0, 0, None)
        self.enabled = True
        self._in_step = False
        self._failed: tuple[str, int] | None = None

    def instrument(self, schedule: Any) -> None:
        """Wrap a training schedule and its stages (a ``PipelineRunner.schedule_observers`` callable)."""
        if not getattr(schedule, "_has_backward", False) or getattr(schedule, "_hpp_watch", None) is self:
            return
        stages = list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]
        self.clock = device_clock(stages[0].device)
        for stage in stages:
            if getattr(stage, "_hpp_watch", None) is not self:
                for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    setattr(stage, name, self._timed(getattr(stage, name)))
                stage._hpp_watch = self
        step = schedule.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            self.compute, self.waits, self._failed = [], [], None
            self._in_step = self.enabled
            try:
                return step(*args, **kwargs)
            except RuntimeError as exc:
                if self._failed is None or isinstance(exc, TransferError):
                    raise
                raise TransferError(self._transfer_message(exc)) from exc
            finally:
                self.fresh, self._in_step = self._in_step, False
                if self.fresh:
                    self.fresh_label, self._fresh = self.label, (self.clock, self.compute, self.waits)

        schedule.step = timed_step
        schedule._hpp_watch = self
        _install_p2p_hooks()

    @property
    def fresh_times(self) -> tuple[int, int, int | None]:
        """The last step's compute ns, longest transfer wait ns and its peer (its clock's marks read now)."""
        if self._fresh is not None:
            clock, compute, waits = self._fresh
            self._fresh = None
            longest = max(
                ((clock.elapsed_ns([(a, b)]), peer) for a, b, peer in waits), default=(0, None), key=lambda w: w[0]
            )
            self._fresh_times = (clock.elapsed_ns(compute), longest[0], longest[1])
        return self._fresh_times

    @fresh_times.setter
    def fresh_times(self, times: tuple[int, int, int | None]) -> None:
        self._fresh, self._fresh_times = None, times

    def _timed(self, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:
                return fn(*args, **kwargs)
            t0 = self.clock.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self.compute.append((t0, self.clock.mark()))

        return wrapper

    def note_wait(self, start: Any, end: Any, peer: int) -> None:
        """A transfer wait from clock mark ``start`` to ``end`` on the receive from (or send to) ``peer``."""
        if self._in_step:
            self.waits.append((start, end, peer))

    def note_failure(self, what: str, peer: int) -> None:
        if self._failed is None:
            self._failed = (what, peer)

    def _transfer_message(self, exc: BaseException) -> str:
        assert self._failed is not None
        what, peer = self._failed
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        after = f" after the timeout of {self.timeout_s:g} s" if timed_out and self.timeout_s else ""
        verb = "timed out" if timed_out else "failed"
        return (
            f"A pipeline transfer {verb}{after}: {self.describe_peer(self.rank)} waited on a {what} "
            f"{self.describe_peer(peer)}, which never completed ({text}). The peer is stuck, very slow or gone; "
            f"raise `HPPStrategy(timeout=...)` if it is only slow, or take its host out of the pool."
        )


_TIMERS: list[_StepTimer] = []  # the timers of the running fits of this process (the newest is used)
_TAGS: dict[int, tuple[str, int]] = {}  # id(Work) -> ("receive from" | "send to", peer global rank)


class _WatchedTransfers(TransferListener):
    """The watch's view of torch's transfers: which peer each wait is on, how long it took, which one failed."""

    def posted(self, ops: list, works: list, t0_ns: int, t1_ns: int) -> None:
        if not _TIMERS or not ops:
            return
        tags = [("receive from" if "recv" in getattr(op.op, "__name__", "") else "send to", int(op.peer)) for op in ops]
        if len(works) == len(tags):
            for w, tag in zip(works, tags):
                _TAGS[id(w)] = tag
        elif works:  # one work for a coalesced batch: its receive is what the rank waits for
            _TAGS[id(works[-1])] = next((t for t in tags if t[0] == "receive from"), tags[0])

    def waiting(self, work: Any) -> Any:
        if not _TIMERS:
            return None
        timer = _TIMERS[-1]
        return timer, _TAGS.pop(id(work), None), timer.clock.mark()

    def waited(self, work: Any, token: Any, error: BaseException | None) -> None:
        if token is None:
            return
        timer, tag, t0 = token
        if tag is None:
            return
        if error is None:
            timer.note_wait(t0, timer.clock.mark(), tag[1])
        elif isinstance(error, RuntimeError):
            timer.note_failure(*tag)


_LISTENER = _WatchedTransfers()


def _install_p2p_hooks() -> None:
    add_listener(_LISTENER)


def _remove_p2p_hooks() -> None:
    if _TIMERS:
        return
    remove_listener(_LISTENER)
    _TAGS.clear()


# ============================================================================================ callback
class _Flag:
    """One signal's :class:`~lightning_hpp.pipeline.runner.StepCheck`: the slowdown ratio this rank found in
    this step (0: none), on the step's collective; every rank learns which positions found one."""

    def __init__(self, watch: StragglerWatch, signal: str) -> None:
        self.watch, self.signal = watch, signal

    def reset(self) -> None:
        pass

    def flag(self) -> torch.Tensor:
        return torch.tensor(self.watch._flag(self.signal), dtype=torch.float32, device=self.watch._device)

    def resolve(self, flags: list[float]) -> None:
        self.watch._resolve(self.signal, [float(f) for f in flags])


class StragglerWatch(Callback):
    """Finds slow ranks and slow links of an HPPStrategy pipeline, and warns, stops or re-plans.

    Added by ``HPPStrategy`` for ``PlacementOptions(watch=...)`` (on by default, ``"warn"``); see the
    module docstring for what is measured and how it is decided.

    Args:
        options: The :class:`WatchOptions`.
        checkpoint_dir: Where ``"stop"`` / ``"replan"`` write their checkpoint (``CheckpointOptions(dir=...)``).
        notes: The dict whose entries every later checkpoint's ``metadata.json`` carries under ``extra``
            (the strategy's checkpoint session); the measured speeds go there.
        timeout_s: The strategy's timeout (named in a transfer's timeout report).

    Attributes:
        findings: This rank's :class:`Finding` s.
        alerts: On every rank, ``(step, signal, {position: ratio})`` of every step some position found one.
    """

    def __init__(
        self,
        options: WatchOptions,
        checkpoint_dir: str | None = None,
        notes: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.options = options
        self.checkpoint_dir = checkpoint_dir
        self.notes = notes if notes is not None else {}
        self.timeout_s = timeout_s
        self.findings: list[Finding] = []
        self.alerts: list[tuple[int, str, dict[int, float]]] = []
        self._timer: _StepTimer | None = None
        self._runner: Any = None
        self._detectors: dict[str, SlowdownDetector] = {}
        self._found: dict[str, Finding | None] = {}
        self._observed_step = -1
        self._step = 0
        self._decided: tuple[str, dict[int, float]] | None = None
        self._rank_info: dict[int, tuple[str, list[int]]] = {}
        self._planned_ms: float | None = None
        self._ctx: tuple[int, str, str, list[int]] = (0, "", "", [])
        self._levels: list[float] = []
        self._position = 0
        self._device = torch.device("cpu")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        view = pipeline_view(trainer)
        if view is None or view.runner is None or view.mesh is None:
            return
        o, mesh, runner = self.options, view.mesh, view.runner
        self._detectors = {
            "compute": SlowdownDetector(o.ratio, o.steps, o.warmup, o.window, o.min_ms, o.min_s),
            "transfer": SlowdownDetector(o.ratio, o.steps, o.warmup, o.window, o.wait_ms, o.min_s),
        }
        self._found = {"compute": None, "transfer": None}
        kinds = list((view.plan.meta.get("device_kinds") if view.plan is not None else None) or [])
        n_stages = view.plan.num_stages if view.plan is not None else len(view.stage_ids)
        style = runner.kind.style
        for pos, row in enumerate(mesh.grid):
            for r in row:
                self._rank_info[r] = (
                    kinds[r] if r < len(kinds) else "?",
                    stages_of_position(pos, mesh.pp, n_stages, style),
                )
        host = socket.gethostname()
        self._position = mesh.position
        self._device = view.root_device  # beside the other checks' flags
        self._ctx = (trainer.global_rank, host, view.device_kind or "?", list(view.stage_ids))
        predicted = ((view.plan.meta.get("predicted") or {}).get("compute_ms") if view.plan is not None else None) or []
        if predicted and all(k < len(predicted) for k in view.stage_ids):
            self._planned_ms = sum(float(predicted[k]) for k in view.stage_ids) * view.n_microbatches
        self._timer = _StepTimer(trainer.global_rank, self._describe_rank, self.timeout_s)
        _TIMERS.append(self._timer)
        self._runner = runner
        runner.schedule_observers.append(self._timer.instrument)
        for sched in runner.schedules:
            self._timer.instrument(sched)
        self._flags = [_Flag(self, "level"), _Flag(self, "compute"), _Flag(self, "transfer")]
        runner.step_checks.extend(self._flags)

    def _describe_rank(self, rank: int) -> str:
        kind, stages = self._rank_info.get(rank, ("?", []))
        host = f"host {self._ctx[1]}, " if rank == self._ctx[0] else ""
        return f"rank {rank} ({host}device kind {kind!r}, stage(s) {stages})"

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self._step = int(trainer.global_step)
        if self._timer is not None:
            self._timer.label = self._step

    # ------------------------------------------------------------------ once per step, inside the step's collective
    def _observe(self) -> None:
        timer = self._timer
        if timer is None or not timer.fresh:
            return
        timer.fresh = False
        step = timer.fresh_label
        if step == self._observed_step:  # one batch per optimizer step (gradient accumulation runs several)
            return
        self._observed_step = step
        rank, host, kind, stages = self._ctx
        compute_ns, wait_ns, wait_peer = timer.fresh_times
        for signal, ms, peer in (("compute", compute_ns / 1e6, None), ("transfer", wait_ns / 1e6, wait_peer)):
            found = self._detectors[signal].observe(step, ms)
            self._found[signal] = (
                None
                if found is None
                else Finding(
                    signal,
                    rank,
                    host,
                    kind,
                    stages,
                    found.since_step,
                    found.step,
                    found.measured_ms,
                    found.baseline_ms,
                    self._planned_ms if signal == "compute" else None,
                    peer,
                )
            )

    def _flag(self, signal: str) -> float:
        self._observe()
        if signal == "level":
            return self._detectors["compute"].current_ratio if self._detectors else 0.0
        found = self._found.get(signal)
        return 0.0 if found is None else max(found.measured_ms / max(found.expected_ms, 1e-9), 1.0 + 1e-6)

    def _resolve(self, signal: str, flags: list[float]) -> None:
        if signal == "level":
            self._levels = list(flags)
            return
        found, self._found[signal] = self._found.get(signal), None
        slow = {p: f for p, f in enumerate(flags) if f > 0}
        if signal == "compute" and len(flags) > 1:
            # a straggler is slow against the other positions too: a load that slows every rank alike is not one
            levels = self._levels if len(self._levels) == len(flags) else [0.0] * len(flags)
            least = min(lv if lv > 0 else flags[p] if flags[p] > 0 else 1.0 for p, lv in enumerate(levels))
            slow = {p: f for p, f in slow.items() if f >= self.options.ratio * least}
            if found is not None and not slow:
                print(
                    f"HPPStrategy: straggler watch: not reported, every pipeline position slowed alike "
                    f"({found.describe()}; the least slowed position runs at {least:.2f}x its baseline).",
                    file=sys.stderr,
                    flush=True,
                )
                found = None
        if not slow:
            return
        if signal == "transfer" and (
            max(self._levels, default=0.0) >= self.options.ratio
            or any(sig == "compute" and self._step - step <= 2 * self.options.steps for step, sig, _ in self.alerts)
        ):
            return  # a rank waits because a peer computes slowly: that peer is the finding
        self.alerts.append((self._step, signal, slow))
        if found is not None and self._position not in slow:
            found = None
        if found is not None:
            self.findings.append(found)
            print(f"HPPStrategy: {found.describe()}.", file=sys.stderr, flush=True)
        if self.options.ends_the_job and self._decided is None:
            self._decided = (signal, slow)

    # ------------------------------------------------------------------ acting: every rank at the same batch
    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self._decided is None or trainer.global_step == self._step:
            return  # nothing decided, or inside a gradient-accumulation window: act once the optimizer stepped
        signal, _ = self._decided
        view = pipeline_view(trainer)
        mine = next((f for f in reversed(self.findings) if f.step == self._observed_step), None)
        everyone = all_gather_object(None if mine is None else dataclasses.asdict(mine))  # once, at the stop
        recorded = (view.plan.meta.get("rank_speeds") if view is not None and view.plan is not None else None) or {}
        speeds = {r: float(recorded.get(str(r), recorded.get(r, 1.0))) for r in range(trainer.world_size)}
        for f in everyone:
            if f is not None and f["signal"] == "compute":
                speeds[f["rank"]] *= f["expected_ms"] / f["measured_ms"]
        step = int(trainer.global_step)
        self.notes[META_KEY] = {
            "action": self.options.action,
            "step": step,
            "signal": signal,
            "speeds": {str(r): round(s, 6) for r, s in speeds.items()},
            "device_kinds": list(
                (view.plan.meta.get("device_kinds") if view is not None and view.plan is not None else None) or []
            ),
            "findings": [f for f in everyone if f is not None],
        }
        path = f"{str(self.checkpoint_dir).rstrip('/')}/step-{step}"
        trainer.save_checkpoint(path)
        code = STOP_EXIT_CODE if self.options.action == "stop" else REPLAN_EXIT_CODE
        said = "; ".join(Finding(**f).describe() for f in everyone if f is not None) or f"slow {signal} on another rank"
        then = (
            "start the same command again with `CheckpointOptions(resume='auto')` (or let torchrun --max-restarts do "
            "it): "
            "plan='auto' re-plans from these speeds"
            if self.options.action == "replan"
            else "take the slow device out of the pool, then resume with `CheckpointOptions(resume='auto')`"
        )
        print(
            f"HPPStrategy: rank {trainer.global_rank} stops at step {step} ({said}). Wrote {path!r} with the measured "
            f"speeds {self.notes[META_KEY]['speeds']}; exit code {code} (watch={self.options.action!r}): {then}.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(code)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._timer is None:
            return
        if self._runner is not None:
            if self._timer.instrument in self._runner.schedule_observers:
                self._runner.schedule_observers.remove(self._timer.instrument)
            for f in self._flags:
                if f in self._runner.step_checks:
                    self._runner.step_checks.remove(f)
        self._timer.enabled = False
        if self._timer in _TIMERS:
            _TIMERS.remove(self._timer)
        _remove_p2p_hooks()
        self._timer, self._runner = None, None


def strategy_timeout_s(timeout: Any) -> float | None:
    """Seconds of a ``timedelta`` (or a number), for messages."""
    if timeout is None:
        return None
    return float(timeout.total_seconds()) if hasattr(timeout, "total_seconds") else float(timeout)
