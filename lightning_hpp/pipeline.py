"""Running a LightningModule's steps through torch.distributed.pipelining.

:class:`StageModule` holds the units of one stage. :class:`PipelineRunner` owns this rank's stages
and runs one batch through a schedule: on the first stage it captures the pipeline input by
calling the user's step with ``forward`` redirected; on the last stage it calls the user's step
once per micro-batch with ``forward`` returning that micro-batch's pipeline output, so the user's
own loss, metrics and ``self.log`` calls run there. What the last stage logged reaches the other
stages of the pipeline by one broadcast per step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from lightning_hpp.mesh import Mesh
from lightning_hpp.microbatch import batch_size_of, largest_divisor_at_most, split_batch
from lightning_hpp.plan import PlanError


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule name and how its stages are placed on ranks."""

    cls: type
    multi: bool  # several stages per rank
    style: str  # "loop" or "v" placement


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(S.ScheduleGPipe, False, "loop"),
    "1f1b": ScheduleKind(S.Schedule1F1B, False, "loop"),
    "interleaved1f1b": ScheduleKind(S.ScheduleInterleaved1F1B, True, "loop"),
    "looped_bfs": ScheduleKind(S.ScheduleLoopedBFS, True, "loop"),
    "interleaved_zb": ScheduleKind(S.ScheduleInterleavedZeroBubble, True, "loop"),
    "zbv": ScheduleKind(S.ScheduleZBVZeroBubble, True, "v"),
    "dualpipev": ScheduleKind(S.ScheduleDualPipeV, True, "v"),
}


class ScheduleError(PlanError):
    """A schedule that cannot run with the requested stages, ranks and micro-batches."""


def check_schedule(name: str, num_stages: int, pp: int, n_microbatches: int) -> ScheduleKind:
    """Validate a schedule against the plan before any process group or step exists."""
    if name not in SCHEDULES:
        raise ScheduleError(f"Unknown schedule {name!r}. Valid schedules: {', '.join(SCHEDULES)}.")
    kind = SCHEDULES[name]
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ScheduleError(f"`n_microbatches` must be a positive integer, got {n_microbatches!r}.")
    if kind.multi:
        if num_stages % pp or num_stages // pp < 2:
            raise ScheduleError(
                f"Schedule {name!r} runs several stages per rank: the plan's {num_stages} stages must be a "
                f"multiple (>= 2x) of pp_degree={pp}. Use pp_degree={max(1, num_stages // 2)} or a plan with "
                f"{2 * pp} stages, or a single-stage schedule ('gpipe', '1f1b')."
            )
        if kind.style == "v" and num_stages != 2 * pp:
            raise ScheduleError(
                f"Schedule {name!r} needs exactly 2 stages per rank (V placement); the plan has {num_stages} "
                f"stages for pp_degree={pp}. Use pp_degree={num_stages // 2} or a plan with {2 * pp} stages."
            )
        if name in ("interleaved1f1b", "interleaved_zb"):
            rounds = max(1, n_microbatches // pp)
            if n_microbatches % rounds:
                raise ScheduleError(
                    f"Schedule {name!r} needs n_microbatches to be a multiple of the number of rounds "
                    f"({rounds} for pp_degree={pp}); got n_microbatches={n_microbatches}. Use a multiple of {pp}."
                )
    elif num_stages != pp:
        raise ScheduleError(
            f"Schedule {name!r} runs one stage per rank, but the plan has {num_stages} stages and "
            f"pp_degree={pp}. Set pp_degree={num_stages}, or use 'interleaved1f1b' for several stages per rank."
        )
    if name in ("1f1b", "dualpipev") and n_microbatches < num_stages:
        raise ScheduleError(
            f"Schedule {name!r} needs at least as many micro-batches as stages: n_microbatches={n_microbatches} "
            f"< {num_stages} stages. Set `n_microbatches` >= {num_stages}, or use 'gpipe'."
        )
    return kind


class StageModule(nn.Module):
    """The units of one stage, applied in order.

    The first stage's first unit receives the pipeline's positional inputs; every later unit gets the
    previous output as one argument (a tuple crossing a stage boundary arrives as several positional
    arguments and is passed on as one tuple). ``input_dtype`` casts floating inputs to the stage's
    compute dtype inside its own forward; ``output_dtype`` fixes the wire dtype of what it sends;
    ``context`` wraps the computation (autocast, fp8).
    """

    def __init__(
        self,
        names: list[str],
        units: list[nn.Module],
        index: int,
        first: bool,
        input_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
        context: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        super().__init__()
        self.names = list(names)
        self.units = nn.ModuleList(units)
        self.index = index
        self.first = first
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype
        self.context = context
        self.output_hooks: list[Callable[[int, Any], Any]] = []
        self.microbatch = -1  # index of the micro-batch being computed; reset by the runner each step
        self.inferring = False  # set while torch pipelining infers boundary metadata

    def forward(self, *args: Any) -> Any:
        if self.inferring:
            return self._infer(*args)
        self.microbatch += 1
        return self._run(*args, guards=True)

    def _infer(self, *args: Any) -> Any:
        # torch pipelining infers boundary shapes by running the stage on uninitialised tensors:
        # run it on zeros instead, and leave every buffer (running stats, fp8 amax history) untouched.
        args = tuple(_zeros_like(a) for a in args)
        saved = [(b, b.detach().clone()) for _, b in self.named_buffers()]
        try:
            return self._run(*args, guards=False)
        finally:
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)

    def _run(self, *args: Any, guards: bool) -> Any:
        x: Any = args if self.first else (args[0] if len(args) == 1 else tuple(args))
        if self.input_dtype is not None:
            x = _cast(x, self.input_dtype)
        with self.context() if self.context is not None else contextlib.nullcontext():
            for i, unit in enumerate(self.units):
                x = unit(*x) if (self.first and i == 0) else unit(x)
        if self.output_dtype is not None:
            x = _cast(x, self.output_dtype)
        # torch pipelining sizes receive buffers from the sent tensor's strides: send dense tensors
        x = _contiguous(x)
        if guards:
            for hook in self.output_hooks:
                x = hook(self.index, x)
        return x


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _zeros_like(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x).requires_grad_(x.requires_grad)
    if isinstance(x, (tuple, list)):
        return type(x)(_zeros_like(v) for v in x)
    return x


class _Stage(PipelineStage):
    """A PipelineStage that tells its StageModule when a pass only infers metadata."""

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self.submod.inferring = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.inferring = False


def _contiguous(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.contiguous()
    if isinstance(x, (tuple, list)):
        return type(x)(_contiguous(v) for v in x)
    return x


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("pipeline input captured")
        self.args = args
        self.kwargs = kwargs


_LOG_SIGNATURE = None


def _bind_log(name: Any, value: Any, args: tuple, kwargs: dict) -> dict:
    global _LOG_SIGNATURE
    if _LOG_SIGNATURE is None:
        from lightning.pytorch import LightningModule

        _LOG_SIGNATURE = inspect.signature(LightningModule.log)
    bound = _LOG_SIGNATURE.bind(None, name, value, *args, **kwargs).arguments
    return {k: v for k, v in bound.items() if k not in ("self", "name", "value", "sync_dist_group")}


@contextlib.contextmanager
def redirected(module: nn.Module, forward: Callable[..., Any], log: Callable[..., None] | None) -> Iterator[None]:
    """Replace ``module.forward`` (and ``module.log`` if given) on the instance for the duration."""
    module.forward = forward
    if log is not None:
        module.log = log
    try:
        yield
    finally:
        del module.forward
        if log is not None:
            del module.log


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def capture_input(module: nn.Module, step_fn: Callable[..., Any], batch: Any, *step_args: Any) -> tuple:
    """Run ``step_fn(batch, ...)`` until it calls ``module(...)`` and return those positional args."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)

    with redirected(module, forward, _no_log):
        try:
            step_fn(batch, *step_args)
        except _Captured as c:
            if c.kwargs:
                raise PlanError(
                    f"The step calls `self(...)` with keyword arguments {sorted(c.kwargs)}; a pipeline's first "
                    f"stage takes positional tensors only. Pass them positionally."
                ) from None
            return c.args
    raise PlanError(
        f"`{getattr(step_fn, '__name__', 'step')}` never calls `self(...)`; under HPPStrategy the step must call "
        f"the module's forward exactly once with the batch's inputs."
    )


class _LogRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, dict]] = []

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, value, _bind_log(name, value, args, kwargs)))


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean())
    if hasattr(value, "compute"):  # a torchmetrics Metric
        return float(value.compute())
    return float(value)


def merge_logs(recorders: list[_LogRecorder]) -> list[tuple[str, float, dict]]:
    """Average what each micro-batch logged under one name, keeping first-seen order."""
    order: list[str] = []
    values: dict[str, list[float]] = {}
    kwargs: dict[str, dict] = {}
    for rec in recorders:
        for name, value, kw in rec.calls:
            if name not in values:
                order.append(name)
                values[name] = []
                kwargs[name] = kw
            values[name].append(_to_float(value))
    return [(n, sum(values[n]) / len(values[n]), kwargs[n]) for n in order]


def extract_loss(output: Any, fn_name: str) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise PlanError(
        f"`{fn_name}` returned {type(output).__name__}; under HPPStrategy it must return the loss tensor or a "
        f"dict with a 'loss' tensor (returning None to skip a batch is not supported in a pipeline)."
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
    ) -> None:
        self.module = module
        self.stage_modules = dict(sorted(stage_modules.items()))
        self.num_stages = num_stages
        self.mesh = mesh
        self.kind = SCHEDULES[schedule]
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.device = device
        self.loss_multiplier: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
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
        for sm in self.stage_modules.values():
            sm.microbatch = -1

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for sm in self.stage_modules.values():
            for p in sm.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    # ----------------------------------------------------------------- schedules
    def _schedule(self, train: bool, batch_size: int) -> tuple[Any, int]:
        n = self.n_microbatches if train else largest_divisor_at_most(batch_size, self.n_microbatches)
        key = (train, batch_size, n)
        if key not in self._schedules:
            stages = [
                _Stage(sm, idx, self.num_stages, self.device, group=self.mesh.pp_group)
                for idx, sm in self.stage_modules.items()
            ]
            loss_fn = self._loss_fn if train else None
            if self.kind.multi:
                cls = self.kind.cls
                if not train and self.kind.style == "loop":
                    cls = S.ScheduleLoopedBFS
                sched = cls(stages, n, loss_fn=loss_fn, scale_grads=True)
            else:
                cls = self.kind.cls if train else S.ScheduleGPipe
                sched = cls(stages[0], n, loss_fn=loss_fn, scale_grads=True)
            for observe in self.schedule_observers:
                observe(sched)
            self._schedules[key] = sched
        return self._schedules[key], n

    def _loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        mb = int(target[0]) // self._mb_size
        rec = _LogRecorder()
        with redirected(self.module, lambda *a, **k: output, rec):
            result = self._step_fn(self._mb[mb], *self._step_args)
        loss = extract_loss(result, getattr(self._step_fn, "__name__", "training_step"))
        self._recorders.append(rec)
        self._losses.append(loss.detach())
        self._mb_seen.append(mb)
        return self.loss_multiplier(loss)

    # ----------------------------------------------------------------- steps
    def train_step(self, step_fn: Callable[..., Any], batch: Any, *step_args: Any) -> tuple[torch.Tensor, list]:
        """Forward and backward of one batch; gradients accumulate into the stage parameters.

        Returns:
            The batch's mean loss (same value on every rank of the pipeline) and what the last stage
            logged, averaged over micro-batches.
        """
        size = batch_size_of(batch)
        self._mb = split_batch(batch, self.n_microbatches)
        self._mb_size = size // self.n_microbatches
        sched, _ = self._schedule(True, size)
        self._step_fn, self._step_args = step_fn, step_args
        self._recorders, self._losses, self._mb_seen = [], [], []
        args = capture_input(self.module, step_fn, batch, *step_args) if self.holds_first else ()
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
        args = capture_input(self.module, step_fn, batch, *step_args) if self.holds_first else ()
        self._reset_counters()
        with torch.no_grad():
            out = sched.step(*args)
        payload = None
        if self.holds_last:
            rec = _LogRecorder()
            with redirected(self.module, lambda *a, **k: out, rec):
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
