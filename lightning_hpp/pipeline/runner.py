"""Running a LightningModule's steps through torch.distributed.pipelining.

:class:`PipelineRunner` owns this rank's stages and runs one batch through a schedule: on the
first stage it captures the pipeline input by calling the user's step with ``forward``
redirected; on the last stage it calls the user's step once per micro-batch with ``forward``
returning that micro-batch's pipeline output, so the user's own loss, metrics and ``self.log``
calls run there. What the last stage logged reaches the other stages of the pipeline by one
broadcast per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules as S

from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.mesh import Mesh
from lightning_hpp.pipeline.microbatch import batch_size_of, largest_divisor_at_most, split_batch
from lightning_hpp.pipeline.schedules import SCHEDULES
from lightning_hpp.pipeline.stage import StageModule, _Stage
from lightning_hpp.pipeline.steps import (
    _LogRecorder,
    capture_input,
    extract_loss,
    merge_logs,
    redirected,
    replay_forward,
)


class PipelineRunner:
    """Runs batches through this rank's stages.

    Args:
        module: The LightningModule (its ``forward`` and ``log`` are redirected during steps).
        stage_modules: This rank's stages, by stage index.
        num_stages: Stages in the whole pipeline.
        mesh: The world layout (pipeline group used for sends and the log broadcast).
        schedule: A name from :data:`SCHEDULES`.
        n_microbatches: Micro-batches per training batch.
        device: This rank's device.
        eval_stage_modules: The stages for forward-only passes (the traced frontend captures the model
            in eval mode for them); default ``stage_modules``.
        flatten: ``(args, kwargs)`` of the step's ``self(...)`` call → the first stage's positional
            inputs. Default: the positional arguments (keyword arguments refused).
        unflatten: The last stage's output → what ``self(...)`` returns to the step. Default: itself.
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
    ) -> None:
        self.module = module
        self.stage_modules = dict(sorted(stage_modules.items()))
        self.eval_stage_modules = dict(sorted((eval_stage_modules or stage_modules).items()))
        self._flatten = flatten or _positional_only
        self._unflatten = unflatten or (lambda out: out)
        self.num_stages = num_stages
        self.mesh = mesh
        self.kind = SCHEDULES[schedule]
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.device = device
        self._loss_scale = 1.0
        self.schedule_observers: list[Callable[[Any], None]] = []
        self._schedules: dict[tuple, Any] = {}
        self._mb: list[Any] = []
        self._mb_size = 0
        self._step_fn: Callable[..., Any] | None = None
        self._step_args: tuple = ()
        self._recorders: list[_LogRecorder] = []
        self._losses: list[torch.Tensor] = []
        self._mb_seen: list[int] = []

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
            loss_fn = self._loss_fn if train else None
            if self.kind.multi:
                cls = self.kind.cls
                if not train and self.kind.style == "loop":
                    cls = S.ScheduleLoopedBFS
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
        mb = int(target[0]) // self._mb_size
        rec = _LogRecorder()
        name = getattr(self._step_fn, "__name__", "training_step")
        with redirected(self.module, replay_forward(self._unflatten(output), name), rec):
            result = self._step_fn(self._mb[mb], *self._step_args)
        loss = extract_loss(result, name)
        self._recorders.append(rec)
        self._losses.append(loss.detach())
        self._mb_seen.append(mb)
        # the mean over micro-batches, taken here rather than by torch's scale_grads: torch divides each stage's
        # gradients after its last backward, twice for a parameter two stages on this rank share (tied weights)
        return loss * (self._loss_scale / self.n_microbatches)

    # ----------------------------------------------------------------- steps
    def train_step(self, step_fn: Callable[..., Any], batch: Any, *step_args: Any, loss_scale: float = 1.0) -> tuple[torch.Tensor, list]:
        """Forward and backward of one batch; gradients accumulate into the stage parameters.

        ``loss_scale`` multiplies each micro-batch's loss before its backward (the fp16 loss scale over
        the gradient-accumulation steps); the returned loss is unscaled.

        Returns:
            The batch's mean loss (same value on every rank of the pipeline) and what the last stage
            logged, averaged over micro-batches.
        """
        size = batch_size_of(batch)
        self._mb = split_batch(batch, self.n_microbatches)
        self._mb_size = size // self.n_microbatches
        sched, _ = self._schedule(True, size)
        self._step_fn, self._step_args, self._loss_scale = step_fn, step_args, loss_scale
        self._recorders, self._losses, self._mb_seen = [], [], []
        args = self._flatten(*capture_input(self.module, step_fn, batch, *step_args)) if self.holds_first else ()
        self._reset_counters()
        target = torch.arange(size, device=self.device) if self.holds_last else None
        try:
            sched.step(*args, target=target)
        finally:
            self._step_fn, self._mb = None, []
        payload = None
        if self.holds_last:
            loss = torch.stack([self._losses[self._mb_seen.index(i)].float() for i in range(self.n_microbatches)]).mean()
            payload = {"loss": float(loss), "logs": merge_logs([self._recorders[self._mb_seen.index(i)] for i in range(self.n_microbatches)])}
        payload = self._from_last(payload)
        return torch.tensor(payload["loss"], device=self.device), payload["logs"]

    def eval_step(self, step_fn: Callable[..., Any], batch: Any, *step_args: Any) -> tuple[Any, list]:
        """A forward-only pass; the user's step runs once on the last stage with the whole output.

        Returns:
            The step's return value and what it logged (both from the last stage, on every rank).
        """
        size = batch_size_of(batch)
        sched, _ = self._schedule(False, size)
        args = self._flatten(*capture_input(self.module, step_fn, batch, *step_args)) if self.holds_first else ()
        self._reset_counters()
        with torch.no_grad():
            out = sched.step(*args)
        payload = None
        if self.holds_last:
            rec = _LogRecorder()
            with redirected(self.module, replay_forward(self._unflatten(out), getattr(step_fn, "__name__", "step")), rec):
                result = step_fn(batch, *step_args)
            payload = {"output": _to_cpu(result), "logs": merge_logs([rec])}
        payload = self._from_last(payload)
        return payload["output"], payload["logs"]

    def _from_last(self, payload: Any) -> Any:
        if self.mesh.pp == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, group_src=self.last_position, group=self.mesh.pp_group, device=_comm_device(self.device))
        return box[0]


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


def _comm_device(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None
