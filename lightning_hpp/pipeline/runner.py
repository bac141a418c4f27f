"""Running a LightningModule's steps through torch.distributed.pipelining.

:class:`PipelineRunner` owns this rank's stages and runs one batch through a schedule: on the
first stage it captures the pipeline input by calling the user's step with ``forward``
redirected; on the last stage it calls the user's step once per micro-batch with ``forward``
returning that micro-batch's pipeline output, so the user's own loss, metrics and ``self.log``
calls run there. The loss and what the last stage logged (reduced on the device over the
micro-batches) reach every rank with every rank's check flags in one collective per step
(:mod:`lightning_hpp.pipeline.exchange`), started before the rank's last backward of the step so that
it runs beside that backward; the names of the logged values travel only when they change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules as S

from lightning_hpp._dist import group_device
from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.exchange import StepExchange
from lightning_hpp.pipeline.fsdp import ShardedStages
from lightning_hpp.pipeline.loss import LossWeights, step_loss
from lightning_hpp.pipeline.mesh import Mesh
from lightning_hpp.pipeline.microbatch import batch_size_of, largest_divisor_at_most, split_batch
from lightning_hpp.pipeline.schedules import ForwardOnlyV, schedule_kind
from lightning_hpp.pipeline.shapes import BoundaryShapes
from lightning_hpp.pipeline.stage import StageModule, _Stage
from lightning_hpp.pipeline.steps import (
    MetricBatches,
    StepLogs,
    _LogRecorder,
    capture_input,
    extract_loss,
    redirected,
    reduce_logs,
    replay_forward,
)


class StepCheck(Protocol):
    """A per-step check decided together (the non-finite guard): a device flag per rank, read once per step."""

    def reset(self) -> None:
        """Start a step."""

    def flag(self) -> torch.Tensor:
        """This rank's 0-dim float32 flag on its device (0: nothing to report)."""

    def resolve(self, flags: list[float]) -> None:
        """Act on every pipeline position's flag (the maximum over the ranks there), the same on every rank."""


class PipelineRunner:
    """Runs batches through this rank's stages.

    Args:
        module: The LightningModule (its ``forward`` and ``log`` are redirected during steps).
        stage_modules: This rank's stages, by stage index.
        num_stages: Stages in the whole pipeline.
        mesh: The world layout (pipeline group used for sends and the log broadcast).
        schedule: A name of :data:`lightning_hpp.pipeline.schedules.SCHEDULE_NAMES`.
        n_microbatches: Micro-batches per training batch.
        device: This rank's device.
        eval_stage_modules: The stages for forward-only passes (the traced frontend captures the model
            in eval mode for them); default ``stage_modules``.
        flatten: ``(args, kwargs)`` of the step's ``self(...)`` call → the first stage's positional
            inputs. Default: the positional arguments (keyword arguments refused).
        unflatten: The last stage's output → what ``self(...)`` returns to the step. Default: itself.
        loss_weights: How the micro-batches' losses weigh in the step's loss (default: equally).
    """

    def __init__(
        self,
        module: nn.Module,
        stage_modules: dict[int, StageModule],
        num_stages: int,
        mesh: Mesh,
        schedule: str,
        n_microbatches: int,
        device: torch.device,
        eval_stage_modules: dict[int, StageModule] | None = None,
        flatten: Callable[[tuple, dict], tuple] | None = None,
        unflatten: Callable[[Any], Any] | None = None,
        loss_weights: LossWeights | None = None,
    ) -> None:
        self.module = module
        self.stage_modules = dict(sorted(stage_modules.items()))
        self.eval_stage_modules = dict(sorted((eval_stage_modules or stage_modules).items()))
        self._flatten = flatten or _positional_only
        self._unflatten = unflatten or (lambda out: out)
        self.num_stages = num_stages
        self.mesh = mesh
        self.kind = schedule_kind(schedule)
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.device = device
        self._loss_scale = 1.0
        self._loss_grad: torch.Tensor | None = None  # the step's d(scaled loss)/d(loss), by the loss's dtype and device
        self.loss_weights = loss_weights
        # the first observer: each step's boundary shapes handed over (lightning_hpp.pipeline.shapes)
        shapes = BoundaryShapes(mesh.pp_group, 0 in stage_modules)
        self.schedule_observers: list[Callable[[Any], None]] = [shapes.instrument]
        # wraps each stage's last backward of a training step (the gradient hand-over's overlap window)
        self.last_backward_window: Callable[[int], Any] | None = None
        self._schedules: dict[tuple, Any] = {}
        # this rank's FSDP2 stages (:mod:`lightning_hpp.pipeline.fsdp`), ``None`` when unsharded
        self.sharded: ShardedStages | None = None
        self._mb: list[Any] = []
        self._mb_size = 0
        self._step_fn: Callable[..., Any] | None = None
        self._step_args: tuple = ()
        self._recorders: list[_LogRecorder | None] = []
        self._losses: list[torch.Tensor | None] = []
        self._target: torch.Tensor | None = None
        # the step's one collective, for training and for evaluation steps (their logged names differ)
        self._exchanges = {mode: StepExchange(mesh, mesh.step_group, device) for mode in ("train", "eval")}
        self._backwards = 0  # backward passes of micro-batches this rank ran in the current training step
        self._step_metrics: dict[str, Any] = {}  # the torchmetrics objects the last stage logged in this step
        # where the last training step's exchange was posted: "before the last backward" (the first stage's rank),
        # "at a weight pass" (zero-bubble schedules) or "after the schedule"
        self.exchange_posted: str | None = None
        self.step_checks: list[StepCheck] = []
        self._metric_batches = MetricBatches(module)
        _sync_metrics_over(module, mesh.dp_group)

    # ----------------------------------------------------------------- placement
    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_modules

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.stage_modules

    @property
    def last_position(self) -> int:
        from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

        return generate_stage_to_rank_mapping(self.mesh.pp, self.num_stages, style=self.kind.style)[self.num_stages - 1]

    @property
    def schedules(self) -> list[Any]:
        """Every schedule built so far (one per mode and batch size)."""
        return list(self._schedules.values())

    def current_microbatch(self, stage: int) -> int:
        return self.stage_modules[stage].microbatch

    def _reset_counters(self) -> None:
        for sm in (*self.stage_modules.values(), *self.eval_stage_modules.values()):
            sm.microbatch = -1

    # ----------------------------------------------------------------- schedules
    def _schedule(self, train: bool, batch_size: int) -> tuple[Any, int]:
        n = self.n_microbatches if train else largest_divisor_at_most(batch_size, self.n_microbatches)
        key = (train, batch_size, n)
        if key not in self._schedules:
            modules = self.stage_modules if train else self.eval_stage_modules
            stages = [
                _Stage(sm, idx, self.num_stages, self.device, group=self.mesh.pp_group)
                for idx, sm in modules.items()
            ]
            if train:
                for stage in stages:
                    stage.on_last_backward = self.last_backward_window
                    stage.on_backward = self._on_backward
                    stage.on_backward_weight = self._on_backward_weight
                    stage.loss_grad = self._loss_grad_of
            loss_fn = self._loss_fn if train else None
            if self.kind.multi:
                cls = self.kind.cls
                if not train and self.kind.style == "loop":
                    cls = S.ScheduleLoopedBFS
                elif not train:  # the V placement
                    cls = ForwardOnlyV
                sched = cls(stages, n, loss_fn=loss_fn, scale_grads=False)
            else:
                cls = self.kind.cls if train else S.ScheduleGPipe
                sched = cls(stages[0], n, loss_fn=loss_fn, scale_grads=False)
            for observe in self.schedule_observers:
                observe(sched)
            self._schedules[key] = sched
        return self._schedules[key], n

    def _loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if self.stage_modules[self.num_stages - 1].inferring:
            # torch's backward-metadata pass calls the loss once on its own outputs: answer with a
            # loss of the right graph without running (and logging from) the user's step
            return sum((t.float().sum() * 0 for t in _tensors(output) if t.requires_grad), torch.zeros(()))
        mb = self._microbatch_of(target)
        rec = _LogRecorder()
        name = getattr(self._step_fn, "__name__", "training_step")
        with redirected(self.module, replay_forward(self._unflatten(output), name), rec):
            result = self._step_fn(self._mb[mb], *self._step_args)
        loss = extract_loss(result, name)
        if loss.numel() != 1:
            raise PlanError(
                f"`{name}` returned a loss of shape {tuple(loss.shape)}; the loss must hold one value (Lightning "
                f"backpropagates it with `loss.backward()`). Reduce it in the step, e.g. `loss.mean()`."
            )
        self._recorders[mb] = rec
        self._losses[mb] = loss.detach()
        # the mean over micro-batches and the fp16 loss scale enter the backward as the loss's gradient
        # (_loss_grad_of), not as a product here: a multiply and its backward node cost ~50 µs a micro-batch on the
        # last stage's path. Not torch's scale_grads either: torch divides each stage's gradients after its last
        # backward, twice for a parameter two stages on this rank share (tied weights)
        return loss

    def _loss_grad_of(self, loss: torch.Tensor, microbatch: int) -> torch.Tensor:
        """The gradient the last stage's backward starts from: ``loss_scale / n_microbatches`` in the loss's dtype (what
        a backward of ``loss * scale`` hands the loss), one tensor a step for every micro-batch's loss; with
        ``loss_weights`` the micro-batch's weighted share instead."""
        if self.loss_weights is not None:
            return self.loss_weights.seed(loss, microbatch)
        grad = self._loss_grad
        if grad is None or grad.dtype != loss.dtype or grad.device != loss.device:
            grad = self._loss_grad = torch.full((), self._loss_scale / self.n_microbatches, dtype=loss.dtype,
                                                device=loss.device)
        return grad if loss.dim() == 0 else grad.reshape(loss.shape)

    def _microbatch_of(self, target: torch.Tensor) -> int:
        # torch hands the loss a view of our ``arange`` target: its offset names the micro-batch without
        # reading the device (``int(target[0])`` would synchronise once per micro-batch)
        if self._target is not None and target.untyped_storage().data_ptr() == self._target.untyped_storage().data_ptr():
            return target.storage_offset() // self._mb_size
        return int(target[0]) // self._mb_size

    # ----------------------------------------------------------------- steps
    def train_step(self, step_fn: Callable[..., Any], batch: Any, *step_args: Any, loss_scale: float = 1.0) -> tuple[torch.Tensor, StepLogs]:
        """Forward and backward of one batch; gradients accumulate into the stage parameters.

        ``loss_scale`` multiplies each micro-batch's loss before its backward (the fp16 loss scale over
        the gradient-accumulation steps); the returned loss is unscaled.

        Returns:
            The batch's mean loss (same value on every rank of the pipeline, a device tensor) and what the
            last stage logged, reduced over micro-batches with each value's ``reduce_fx`` and, for
            ``sync_dist=True`` values, over the data-parallel replicas.
        """
        size = batch_size_of(batch)
        n = self.n_microbatches
        self._mb = split_batch(batch, n)
        self._mb_size = size // n
        sched, _ = self._schedule(True, size)
        self._step_fn, self._step_args, self._loss_scale = step_fn, step_args, loss_scale
        self._loss_grad = None
        if self.loss_weights is not None and self.holds_last:
            self.loss_weights.start(self._mb, loss_scale, self.device)
        self._recorders, self._losses = [None] * n, [None] * n
        self._backwards = 0
        for check in self.step_checks:
            check.reset()
        args = self._flatten(*capture_input(self.module, step_fn, batch, *step_args)) if self.holds_first else ()
        self._reset_counters()
        self._target = torch.arange(size, device=self.device) if self.holds_last else None
        exchange = self._exchanges["train"]
        try:
            with self._metric_batches if self.holds_last else contextlib.nullcontext():
                # the loss is taken per micro-batch (_loss_fn): torch's merge of the last stage's outputs
                # (a concatenation of every micro-batch's output, logits for an LM) is not needed
                sched.step(*args, target=self._target, return_outputs=False)
                if not exchange.started:  # a rank without the first stage, its schedule done
                    self._start_exchange("after the schedule")
        except BaseException:
            exchange.abandon()
            raise
        finally:
            self._step_fn, self._mb, self._target = None, [], None
            self._recorders, self._losses = [], []
            if self.sharded is not None:  # the schedule's gradient reduction freed them; a failed step may not have
                self.sharded.reshard()
        loss, logs, flags = exchange.finish()
        self._resolve_checks(flags)
        logs.metrics = self._step_metrics
        return loss, logs

    def _on_backward(self, stage: int) -> None:
        """Before each backward of a micro-batch on this rank. At the rank's last one its part of the step's exchange
        is final (every forward and loss ran, every arriving gradient was checked). The first stage's last backward
        ends every training schedule (it waits for every other stage's), and nothing waits for what it computes:
        the first stage's rank posts its part before it, so the collective runs beside that backward. Another rank
        would delay the gradients the stages before it wait for: it posts at its next weight pass (zero-bubble
        schedules, once the gradients are sent), else when its schedule is done."""
        self._backwards += 1
        if self.holds_first and self._backwards == self.n_microbatches * len(self.stage_modules):
            self._start_exchange("before the last backward")

    def _on_backward_weight(self, stage: int) -> None:
        if (self._backwards == self.n_microbatches * len(self.stage_modules)
                and not self._exchanges["train"].started):
            self._start_exchange("at a weight pass")

    def _start_exchange(self, where: str) -> None:
        self.exchange_posted = where
        loss, logs, error = None, None, None
        self._step_metrics = {}
        if self.holds_last:
            if any(x is None for x in self._losses):
                raise RuntimeError(f"internal: the schedule computed the loss of micro-batches {self._losses} only")
            loss = step_loss(self._losses, self.loss_weights)
            try:
                logs = reduce_logs(self._recorders, self.device, self._metric_batches)
                self._step_metrics = logs.metrics
            except PlanError as e:
                error = str(e)
        self._exchanges["train"].start(loss, logs, error, self._check_flags(), last=self.holds_last)

    def eval_step(self, step_fn: Callable[..., Any], batch: Any, *step_args: Any) -> tuple[Any, StepLogs]:
        """A forward-only pass; the user's step runs once on the last stage with the whole output.

        Returns:
            The step's return value and what it logged (both from the last stage, on every rank).
        """
        size = batch_size_of(batch)
        sched, _ = self._schedule(False, size)
        for check in self.step_checks:
            check.reset()
        args = self._flatten(*capture_input(self.module, step_fn, batch, *step_args)) if self.holds_first else ()
        self._reset_counters()
        # sharded stages are gathered for the pass (a traced stage's evaluation graph reads the full parameters)
        with torch.no_grad(), self.sharded.gathered() if self.sharded is not None else contextlib.nullcontext():
            out = sched.step(*args)
        payload, metrics = None, {}
        if self.holds_last:
            rec = _LogRecorder()
            with redirected(self.module, replay_forward(self._unflatten(out), getattr(step_fn, "__name__", "step")), rec):
                result = step_fn(batch, *step_args)
            try:
                logs = reduce_logs([rec], self.device)
                metrics = logs.metrics
                payload = ("logs", _to_cpu(result), logs.schema, logs.values.tolist())
            except PlanError as e:
                payload = ("error", str(e))
        if self.mesh.pp > 1:
            box = [payload]
            dist.broadcast_object_list(box, group_src=self.last_position, group=self.mesh.pp_group,
                                       device=group_device(self.mesh.pp_group))
            payload = box[0]
        # an error of the last stage's logs goes through the exchange, so every replica raises it, not only this one
        error = payload[1] if payload[0] == "error" else None
        output, logs = None, None
        if error is None:
            _, output, schema, values = payload
            if self.holds_last:
                logs = StepLogs(schema, torch.tensor(values, dtype=torch.float32, device=self.device))
        exchange = self._exchanges["eval"]
        exchange.start(None, logs, error if self.holds_last else None, self._check_flags(), last=self.holds_last)
        _, logs, flags = exchange.finish()
        self._resolve_checks(flags)
        logs.metrics = metrics if self.holds_last else {}
        return output, logs

    # ----------------------------------------------------------------- the step's checks
    def _check_flags(self) -> list[torch.Tensor]:
        return [check.flag() for check in self.step_checks]

    def _resolve_checks(self, flags: list[list[float]]) -> None:
        """Hand each check what every position flagged (``flags[position][check]``)."""
        for i, check in enumerate(self.step_checks):
            check.resolve([row[i] for row in flags])


def _positional_only(args: tuple, kwargs: dict) -> tuple:
    if kwargs:
        raise PlanError(
            f"The step calls `self(...)` with keyword arguments {sorted(kwargs)}; the sequential frontend's first "
            f"stage takes positional inputs only. Pass them positionally, or use `HPPStrategy(frontend='traced')`, "
            f"which keeps keyword arguments."
        )
    return tuple(args)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _sync_metrics_over(module: nn.Module, group: Any) -> None:
    """Make the module's torchmetrics ``Metric`` objects sync over ``group`` (the data-parallel group).

    The user's step runs on the last stage only, so a metric's default sync over the world would wait
    for ranks that never update it; over the data-parallel group it meets the last stages of the other
    replicas, which run the same step. A ``process_group`` the user chose is kept.
    """
    if group is None:
        return
    for m in module.modules():
        if hasattr(m, "_defaults") and hasattr(m, "process_group") and m.process_group is None:
            m.process_group = group
