"""Running a LightningModule's steps through torch.distributed.pipelining.

:class:`PipelineRunner` owns this rank's stages and runs one batch through a schedule: on the
first stage it captures the pipeline input by calling the user's step with ``forward``
redirected; on the last stage it calls the user's step once per micro-batch with ``forward``
returning that micro-batch's pipeline output, so the user's own loss, metrics and ``self.log``
calls run there. The loss and what the last stage logged (reduced on the device over the
micro-batches) reach every rank with every rank's check flags in one collective per step
(:mod:`lightning_hpp.pipeline.exchange`), started before the rank's last backward of the step so that
it runs beside that backward; the names of the logged values travel only when they change, and what the step
returns besides its loss (a dict's other keys, merged over the micro-batches) only when there is any.

A step that changes the module's state (it appends outputs to a list the epoch-end hooks read, updates a
torchmetrics metric, counts) is also replayed on every other rank of the pipeline with the last stage's outputs
(:attr:`PipelineRunner.replayed_steps`), so that every rank holds what one process holds and runs the hooks
on it, as under DDP; the other steps run on the last stage only and cost nothing elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from torch.distributed.pipelining import schedules as S

from lightning_hpp._dist import all_gather_object, group_device
from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.collectives import OutputBroadcast
from lightning_hpp.pipeline.exchange import StepExchange
from lightning_hpp.pipeline.fsdp import ShardedStages
from lightning_hpp.pipeline.loss import LossWeights, step_loss
from lightning_hpp.pipeline.mesh import Mesh
from lightning_hpp.pipeline.microbatch import batch_size_of, largest_divisor_at_most, split_batch
from lightning_hpp.pipeline.schedules import ForwardOnlyV, schedule_kind
from lightning_hpp.pipeline.shapes import BoundaryShapes
from lightning_hpp.pipeline.stage import HookedStage, StageModule
from lightning_hpp.pipeline.step_effects import ModuleState, merge_outputs, step_extras
from lightning_hpp.pipeline.steps import (
    LogRecorder,
    MetricBatches,
    StepLogs,
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
        self._recorders: list[LogRecorder | None] = []
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
        # the steps (by name) every rank of the pipeline replays with the last stage's outputs
        self.replayed_steps: frozenset[str] = frozenset()
        self._replay = False  # whether the running training step is replayed
        self._trainable: tuple[bool, ...] | None = None  # per stage, whether it has parameters to train (agreed)
        self._extras: list[dict | None] = []  # what each micro-batch's step returned besides its loss
        self._outputs: list[Any] = []  # each micro-batch's pipeline output, kept for a replayed step
        self._output_broadcast: OutputBroadcast | None = None
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
        key = (train, batch_size, n, self._trainable if train else None)
        if key not in self._schedules:
            modules = self.stage_modules if train else self.eval_stage_modules
            stages = [
                HookedStage(sm, idx, self.num_stages, self.device, group=self.mesh.pp_group)
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
        rec = LogRecorder()
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
        self._extras[mb] = step_extras(result)
        if self._replay:
            self._outputs[mb] = _detached(output)
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
        if (
            self._target is not None
            and target.untyped_storage().data_ptr() == self._target.untyped_storage().data_ptr()
        ):
            return target.storage_offset() // self._mb_size
        return int(target[0]) // self._mb_size

    # ----------------------------------------------------------------- steps
    def train_step(
        self, step_fn: Callable[..., Any], batch: Any, *step_args: Any, loss_scale: float = 1.0
    ) -> tuple[torch.Tensor, StepLogs, dict[str, Any] | None]:
        """Forward and backward of one batch; gradients accumulate into the stage parameters.

        ``loss_scale`` multiplies each micro-batch's loss before its backward (the fp16 loss scale over
        the gradient-accumulation steps); the returned loss is unscaled.

        Returns:
            The batch's mean loss (same value on every rank of the pipeline, a device tensor), what the
            last stage logged, reduced over micro-batches with each value's ``reduce_fx`` and, for
            ``sync_dist=True`` values, over the data-parallel replicas, and what the step returned besides the
            loss (``None``: nothing), merged over the micro-batches (:func:`~lightning_hpp.pipeline.step_effects.
            merge_outputs`).
        """
        size = batch_size_of(batch)
        n = self.n_microbatches
        self._check_trainable()
        self._mb = split_batch(batch, n)
        self._mb_size = size // n
        sched, _ = self._schedule(True, size)
        self._step_fn, self._step_args, self._loss_scale = step_fn, step_args, loss_scale
        self._replay = self._replayed(step_fn)
        self._loss_grad = None
        if self.loss_weights is not None and self.holds_last:
            self.loss_weights.start(self._mb, loss_scale, self.device)
        self._recorders, self._losses, self._extras = [None] * n, [None] * n, [None] * n
        self._outputs = [None] * n if self._replay and self.holds_last else []
        self._backwards = 0
        for check in self.step_checks:
            check.reset()
        args = self._capture(step_fn, batch, step_args) if self.holds_first else ()
        self._reset_counters()
        self._target = torch.arange(size, device=self.device) if self.holds_last else None
        exchange = self._exchanges["train"]
        micro_batches, sizes = self._mb, [self._mb_size] * n
        # what a step that changes state appends per micro-batch is merged into what one process appends per batch
        appends = ModuleState(self.module) if self.holds_last and self._stateful(step_fn) else None
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
            outputs, self._outputs = self._outputs, []
            self._step_fn, self._mb, self._target = None, [], None
            self._recorders, self._losses, self._extras = [], [], []
            if self.sharded is not None:  # the schedule's gradient reduction freed them; a failed step may not have
                self.sharded.reshard()
        if appends is not None:
            appends.merge_appends(sizes, getattr(step_fn, "__name__", "training_step"))
        loss, logs, flags = exchange.finish()
        self._resolve_checks(flags)
        if self._replay and not self.holds_last:
            outputs = self._receive_outputs(None)
            appends = ModuleState(self.module)
            with self._metric_batches:
                recorders = [
                    self._replay_step(step_fn, mb, out, step_args)[1] for mb, out in zip(micro_batches, outputs)
                ]
            appends.merge_appends(sizes, getattr(step_fn, "__name__", "training_step"))
            self._step_metrics = {name: m for rec in recorders for name, m in rec.metric_objects.items()}
        elif self._replay:
            self._receive_outputs(outputs)
        logs.metrics = self._step_metrics
        return loss, logs, exchange.outputs

    # ----------------------------------------------------------------- what trains
    def agree_trainable(self) -> None:
        """Agree over the pipeline which stages have parameters to train (collective over the pipeline group).

        torch's stages fix at their first step whether the activations crossing a boundary carry gradients: a
        stage after frozen ones (a frozen backbone, fine-tuning) receives none and sends none back. Freezing or
        unfreezing a stage (between two fits, or in a hook at an epoch's start, as ``BackboneFinetuning`` does)
        changes that on every rank of the pipeline, so the training schedules are kept per agreement."""
        mine = {k: _trains(sm) for k, sm in self.stage_modules.items()}
        merged: dict[int, bool] = {}
        for part in all_gather_object(mine, group=self.mesh.pp_group) if self.mesh.pp > 1 else [mine]:
            merged.update(part)
        self._trainable = tuple(merged[k] for k in range(self.num_stages))

    def _check_trainable(self) -> None:
        """A stage frozen or unfrozen since the last agreement (mid-epoch) is refused, naming when it may change."""
        if self._trainable is None:
            return
        changed = [k for k, sm in self.stage_modules.items() if _trains(sm) != self._trainable[k]]
        if changed:
            raise PlanError(
                f"Stage(s) {changed} {'now' if not self._trainable[changed[0]] else 'no longer'} have parameters to "
                "train "
                f"(`requires_grad` changed) since the epoch began. Under HPPStrategy every rank of the pipeline must "
                f"know which stages train before a step (their boundaries carry gradients or not): freeze or unfreeze "
                "parameters between fits or at an epoch's start (`on_train_epoch_start`, as `BackboneFinetuning` "
                "does)."
            )

    def _replayed(self, step_fn: Callable[..., Any]) -> bool:
        """Whether every rank of the pipeline runs ``step_fn`` with the last stage's outputs."""
        return self.mesh.pp > 1 and self._stateful(step_fn)

    def _stateful(self, step_fn: Callable[..., Any]) -> bool:
        return getattr(step_fn, "__name__", None) in self.replayed_steps

    def _capture(self, step_fn: Callable[..., Any], batch: Any, step_args: tuple) -> tuple:
        """The first stage's inputs: the step run up to its ``self(...)`` call. What a step that changes state did
        before that call is put back: the step runs whole on the micro-batches, here too."""
        state = ModuleState(self.module) if self._stateful(step_fn) else None
        try:
            return self._flatten(*capture_input(self.module, step_fn, batch, *step_args))
        finally:
            if state is not None:
                state.restore()

    def _receive_outputs(self, outputs: list[Any] | None) -> list[Any]:
        """The last stage's pipeline outputs of the step (``outputs`` there) on every rank of the pipeline."""
        if self._output_broadcast is None:
            self._output_broadcast = OutputBroadcast(self.mesh.pp_group, self.last_position, self.device)
        return self._output_broadcast(outputs)

    def _replay_step(
        self, step_fn: Callable[..., Any], batch: Any, output: Any, step_args: tuple
    ) -> tuple[Any, LogRecorder]:
        """The user's step on ``batch`` with ``output`` as what its ``self(...)`` returns, as the last stage ran it:
        its effects on the module's state happen here too. Returns what it returned and what it logged (recorded
        only for its torchmetrics objects: the last stage's values reached every rank through the exchange)."""
        rec = LogRecorder()
        with (
            torch.no_grad(),
            redirected(self.module, replay_forward(self._unflatten(output), getattr(step_fn, "__name__", "step")), rec),
        ):
            result = step_fn(batch, *step_args)
        return result, rec

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
        if self._backwards == self.n_microbatches * len(self.stage_modules) and not self._exchanges["train"].started:
            self._start_exchange("at a weight pass")

    def _start_exchange(self, where: str) -> None:
        self.exchange_posted = where
        loss, logs, error, extras = None, None, None, None
        self._step_metrics = {}
        if self.holds_last:
            if any(x is None for x in self._losses):
                raise RuntimeError(f"internal: the schedule computed the loss of micro-batches {self._losses} only")
            loss = step_loss(self._losses, self.loss_weights)
            try:
                logs = reduce_logs(self._recorders, self.device, self._metric_batches)
                self._step_metrics = logs.metrics
                extras = merge_outputs(
                    self._extras,
                    [self._mb_size] * len(self._extras),
                    getattr(self._step_fn, "__name__", "training_step"),
                )
            except PlanError as e:
                error = str(e)
        self._exchanges["train"].start(loss, logs, error, self._check_flags(), last=self.holds_last, outputs=extras)

    def eval_step(self, step_fn: Callable[..., Any], batch: Any, *step_args: Any) -> tuple[Any, StepLogs]:
        """A forward-only pass; the user's step runs once on the last stage with the whole output.

        Returns:
            The step's return value and what it logged (both from the last stage, on every rank).
        """
        size = batch_size_of(batch)
        sched, _ = self._schedule(False, size)
        for check in self.step_checks:
            check.reset()
        args = self._capture(step_fn, batch, step_args) if self.holds_first else ()
        self._reset_counters()
        # sharded stages are gathered for the pass (a traced stage's evaluation graph reads the full parameters)
        with torch.no_grad(), self.sharded.gathered() if self.sharded is not None else contextlib.nullcontext():
            out = sched.step(*args)
        payload, metrics = None, {}
        replay = self._replayed(step_fn)
        if self.holds_last:
            rec = LogRecorder()
            with redirected(
                self.module, replay_forward(self._unflatten(out), getattr(step_fn, "__name__", "step")), rec
            ):
                result = step_fn(batch, *step_args)
            try:
                logs = reduce_logs([rec], self.device)
                metrics = logs.metrics
                # a replayed step's result is computed again on every rank: its pipeline output travels instead
                payload = ("logs", _to_cpu(out) if replay else _to_cpu(result), logs.schema, logs.values.tolist())
            except PlanError as e:
                payload = ("error", str(e))
        if self.mesh.pp > 1:
            box = [payload]
            dist.broadcast_object_list(
                box, group_src=self.last_position, group=self.mesh.pp_group, device=group_device(self.mesh.pp_group)
            )
            payload = box[0]
        if replay and not self.holds_last and payload[0] != "error":
            result, rec = self._replay_step(step_fn, batch, move_data_to_device(payload[1], self.device), step_args)
            metrics = dict(rec.metric_objects)
        if payload[0] != "error":  # the step's own result where it ran here, else the last stage's, on this device
            payload = (
                payload[0],
                result if replay or self.mesh.pp == 1 else move_data_to_device(payload[1], self.device),
                *payload[2:],
            )
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
        logs.metrics = metrics  # the last stage's objects, or a replaying rank's own
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


def _trains(stage: nn.Module) -> bool:
    return any(p.requires_grad for p in stage.parameters())


def _detached(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detached(v) for v in obj)
    return obj


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
