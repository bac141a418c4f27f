"""The user's Lightning step around a pipeline: capture the pipeline input from its ``self(...)``
call, replay it on the last stage with the pipeline output, and record what it logs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.step_effects import ModuleState


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("pipeline input captured")
        self.args = args
        self.kwargs = kwargs


_LOG_SIGNATURE = None


_LOG_EXCLUDED = ("self", "name", "value", "sync_dist_group")


def _bind_log(name: Any, value: Any, args: tuple, kwargs: dict) -> dict:
    global _LOG_SIGNATURE
    if not args:  # keyword arguments only (the usual call): what binding would give, without its cost
        return {k: v for k, v in kwargs.items() if k not in _LOG_EXCLUDED}
    if _LOG_SIGNATURE is None:
        from lightning.pytorch import LightningModule

        _LOG_SIGNATURE = inspect.signature(LightningModule.log)
    bound = _LOG_SIGNATURE.bind(None, name, value, *args, **kwargs).arguments
    return {k: v for k, v in bound.items() if k not in _LOG_EXCLUDED}


@contextlib.contextmanager
def redirected(module: nn.Module, forward: Callable[..., Any], log: Callable[..., None] | None) -> Iterator[None]:
    """Replace ``module.forward`` (and ``module.log`` if given) on the instance for the duration.

    Plain instance attributes, set past ``nn.Module.__setattr__`` (which only adds its parameter, buffer and
    submodule bookkeeping; this runs once per micro-batch on the last stage)."""
    object.__setattr__(module, "forward", forward)
    if log is not None:
        object.__setattr__(module, "log", log)
    try:
        yield
    finally:
        object.__delattr__(module, "forward")
        if log is not None:
            object.__delattr__(module, "log")


def no_log(*args: Any, **kwargs: Any) -> None:
    return None


def capture_input(module: nn.Module, step_fn: Callable[..., Any], batch: Any, *step_args: Any) -> tuple[tuple, dict]:
    """Run ``step_fn(batch, ...)`` until it calls ``module(...)``; return that call's ``(args, kwargs)``."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)

    with redirected(module, forward, no_log):
        try:
            step_fn(batch, *step_args)
        except _Captured as c:
            return c.args, c.kwargs
    raise PlanError(
        f"`{getattr(step_fn, '__name__', 'step')}` never calls `self(...)`; under HPPStrategy the step must call "
        f"the module's forward exactly once with the batch's inputs."
    )


@dataclass(frozen=True)
class DryRun:
    """What running a step once showed (:func:`dry_run`).

    Attributes:
        calls: How many times the step called ``self(...)`` (counting stops at the second call).
        changes_state: Whether the step changed the module's state (see :class:`ModuleState`); ``True`` too where
            the step could not run this way, as nothing then shows that it does not.
    """

    calls: int
    changes_state: bool


def dry_run(module: nn.Module, step_fn: Callable[..., Any], batch: Any, *step_args: Any) -> DryRun:
    """Run ``step_fn(batch, ...)`` once with the module's real ``forward``, in eval mode and without gradients,
    logging nothing, then put back every state it changed (torchmetrics states, the modules' attributes: a list
    of outputs it appends to, a counter), so the run starts as without this check.

    A step that fails this way (it may need gradients) counts as one call (the run-time check on the last stage
    still applies) and as changing state.
    """
    calls = [0]
    real = type(module).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:
            raise _Captured(args, kwargs)
        return real(module, *args, **kwargs)

    state = ModuleState(module)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    failed = False
    try:
        with torch.no_grad(), redirected(module, forward, no_log):
            step_fn(batch, *step_args)
    except _Captured:
        pass
    except Exception:  # noqa: BLE001 - the user's step may need gradients; the run-time check covers it
        failed = True
    finally:
        for m, training in modes:
            m.training = training
        changed = failed or state.changed()
        state.restore()
    return DryRun(min(calls[0], 1) if failed else calls[0], changed)


def second_call_error(fn_name: str) -> PlanError:
    return PlanError(
        f"`{fn_name}` calls `self(...)` more than once; under HPPStrategy the step must call the module's "
        f"forward exactly once per batch (a pipeline runs one forward per micro-batch). Combine the "
        f"inputs into one call, or compute the second result from the first call's output."
    )


def replay_forward(output: Any, fn_name: str) -> Callable[..., Any]:
    """A ``forward`` that returns ``output`` to the step's one ``self(...)`` call and refuses a second."""
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:
            raise second_call_error(fn_name)
        return output

    return forward


class LogRecorder:
    """What one micro-batch's step logged (``self.log`` calls, torchmetrics objects), for :func:`reduce_logs`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, dict]] = []
        self.metrics: set[str] = set()  # names logged with a torchmetrics Metric
        self.metric_objects: dict[str, Any] = {}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        kw = _bind_log(name, value, args, kwargs)
        if hasattr(value, "compute") and hasattr(value, "_forward_cache"):  # a torchmetrics Metric
            self.metrics.add(name)
            self.metric_objects[name] = value
            if value._forward_cache is not None:  # this micro-batch's value, before the next one replaces it
                value = value._forward_cache.detach()
        elif isinstance(value, torch.Tensor):  # the value, not its graph: freed with the micro-batch's backward
            value = value.detach()
        self.calls.append((name, value, kw))


class _Reduced:
    """The ``sync_dist_group`` of a replayed value already reduced over the data-parallel replicas."""

    def __repr__(self) -> str:
        return "REDUCED"


REDUCED = _Reduced()
"""Replayed ``self.log(..., sync_dist=True)`` values carry it as their ``sync_dist_group``: the strategy's
``reduce`` hands them back unchanged (they are equal on every replica already)."""

class MetricBatches:
    """The value each torchmetrics ``Metric``'s ``forward`` gives for the whole step, over its micro-batches.

    A metric's ``forward`` computes its value on one micro-batch (macro accuracy, F1, AUROC: not the mean of
    the micro-batches' values); one process computes it on the whole batch. Inside this context every
    micro-batch's state is also merged into a copy kept for the step (torchmetrics merges it into the
    epoch's state in ``_reduce_states``, with the micro-batch's state in the metric), and :meth:`value`
    computes the step's value from it, unsynced as ``forward`` is. Metrics whose ``forward`` updates twice
    (``full_state_update=True``) merge no state there; their step value stays the micro-batches' mean.
    """

    def __init__(self, module: nn.Module) -> None:
        self._metrics = [m for m in module.modules() if hasattr(m, "_reduce_states") and hasattr(m, "_defaults")]
        self._steps: dict[int, Any] = {}

    def __enter__(self) -> MetricBatches:
        self._steps.clear()
        for m in self._metrics:
            object.__setattr__(
                m, "_reduce_states", functools.partial(self._merge, m, type(m)._reduce_states.__get__(m))
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in self._metrics:
            m.__dict__.pop("_reduce_states", None)

    def _merge(self, metric: Any, reduce_states: Callable[[dict], None], incoming: dict[str, Any]) -> None:
        batch, count = metric._copy_state_dict(), metric._update_count  # this micro-batch's state, then the epoch's
        held = self._steps.get(id(metric))
        if held is None:
            self._steps[id(metric)] = (batch, 1)
        else:  # the step's state so far merged with this micro-batch's, by the metric's own rule
            state, n = held
            metric._update_count = n + 1
            type(metric)._reduce_states(metric, state)
            self._steps[id(metric)] = (metric._copy_state_dict(), n + 1)
            _set_states(metric, batch)
            metric._update_count = count
        reduce_states(incoming)

    def value(self, metric: Any) -> torch.Tensor | None:
        """The step's value of ``metric``, unsynced (``None``: nothing merged for it this step)."""
        held = self._steps.get(id(metric))
        if held is None:
            return None
        epoch, count, computed = metric._copy_state_dict(), metric._update_count, metric._computed
        to_sync, sync_on_compute = metric._to_sync, metric.sync_on_compute
        _set_states(metric, held[0])
        metric._update_count, metric._computed, metric._to_sync, metric.sync_on_compute = held[1], None, False, False
        try:
            return metric.compute()
        finally:
            _set_states(metric, epoch)
            metric._update_count, metric._computed, metric._to_sync, metric.sync_on_compute = (
                count,
                computed,
                to_sync,
                sync_on_compute,
            )


def _set_states(metric: Any, state: dict[str, Any]) -> None:
    for attr, value in state.items():
        setattr(metric, attr, value)


REDUCE_FX = ("mean", "sum", "max", "min")
_TORCH_FX = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


def reduce_fx_name(name: str, fx: Any) -> str:
    """``self.log(..., reduce_fx=fx)`` as one of :data:`REDUCE_FX` (the reductions Lightning accepts).

    Raises:
        PlanError: For any other reduction (Lightning refuses it too).
    """
    if isinstance(fx, str) and fx.lower() in (*REDUCE_FX, "avg"):
        return "mean" if fx.lower() == "avg" else fx.lower()
    if fx in _TORCH_FX:
        return _TORCH_FX[fx]
    raise PlanError(
        f"`self.log({name!r}, ..., reduce_fx={fx!r})`: Lightning reduces logged values with 'mean', 'sum', 'max' or "
        f"'min' (or torch.mean / torch.sum / torch.max / torch.min) only. Use one of these, or log a torchmetrics "
        f"`Metric` for a custom reduction."
    )


@dataclass
class StepLogs:
    """What the user's step logged in one pipeline step, reduced over its micro-batches.

    Attributes:
        schema: ``(name, self.log keyword arguments)`` per value, in first-logged order.
        values: One float32 value per entry of ``schema``, on the pipeline's device.
        metrics: On the last stage, the torchmetrics ``Metric`` logged under a name (``{}`` elsewhere): replayed
            as the object, so Lightning computes its epoch value and resets it as it does without a pipeline.
    """

    schema: list[tuple[str, dict]] = field(default_factory=list)
    values: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    metrics: dict[str, Any] = field(default_factory=dict)


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).mean()
    if hasattr(value, "compute"):  # a torchmetrics Metric only updated: its value so far
        return _as_tensor(value.compute(), device)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def reduce_logs(recorders: list[LogRecorder], device: torch.device, batches: MetricBatches | None = None) -> StepLogs:
    """Reduce what each micro-batch logged under one name with its ``reduce_fx``, on ``device``.

    Equal micro-batches make the result what one step over the whole batch logs for values that
    are the ``reduce_fx`` of per-sample terms (a mean loss, a sum of counts, a max): no host sync,
    the values stay on the device. A torchmetrics ``Metric`` contributes its value on each
    micro-batch (``forward``'s result; ``compute()`` when only ``update`` ran), averaged.
    """
    order: list[str] = []
    values: dict[str, list[torch.Tensor]] = {}
    kwargs: dict[str, dict] = {}
    for rec in recorders:
        for name, value, kw in rec.calls:
            if name not in values:
                order.append(name)
                values[name] = []
                kwargs[name] = kw
            values[name].append(_as_tensor(value, device))
    if not order:
        return StepLogs([], torch.zeros(0, device=device))
    metrics = {n: m for rec in recorders for n, m in rec.metric_objects.items()}
    reduced = []
    for n in order:
        whole = batches.value(metrics[n]) if batches is not None and n in metrics else None
        if whole is not None:  # a Metric's value on the whole step, as one process computes it
            reduced.append(_as_tensor(whole, device))
            continue
        fx = (
            "mean"
            if any(n in rec.metrics for rec in recorders)
            else reduce_fx_name(n, kwargs[n].get("reduce_fx", "mean"))
        )
        stacked = torch.stack(values[n])
        reduced.append(getattr(torch, fx)(stacked) if fx != "mean" else stacked.mean())
    return StepLogs([(n, kwargs[n]) for n in order], torch.stack(reduced), metrics)


def replay_logs(module: nn.Module, logs: StepLogs) -> None:
    """Log on this rank what the last stage logged (so rank 0's loggers and callbacks see it), inside the
    strategy's step hook. On the last stage a torchmetrics ``Metric`` is logged as itself, its step value the
    micro-batches' reduced one: Lightning computes its epoch value and resets it as without a pipeline."""
    for (name, kw), value in zip(logs.schema, logs.values.unbind(0)):
        metric = logs.metrics.get(name)
        if metric is None:
            if not _log_again(module, name, value, kw):
                module.log(name, value, **kw)
                _remember_log(module, name, value, kw)
        else:
            metric._forward_cache = value
            module.log(name, metric, **{k: v for k, v in kw.items() if k not in ("sync_dist", "sync_dist_group")})


# Lightning 2.6's ``LightningModule.log`` costs about 1 ms of host time per key and step on a CPU, most of it in
# ``_ResultCollection.log`` moving the key's stored state to the value's device again (a walk of its dataclasses).
# A replayed key that Lightning already took once, in the same hook, with the same options and on the same
# device, goes straight to the update those calls end in; anything else (a new key or hook, new options, an
# epoch's first batch, where Lightning resets the hook's values) takes the whole ``log``.
_REPLAYED = "_hpp_replayed"


def _result_key(module: Any, results: Any, name: str, kw: dict) -> str:
    key = f"{module._current_fx_name}.{name}"
    if kw.get("add_dataloader_idx", True) and results.dataloader_idx is not None:
        key += f".{results.dataloader_idx}"
    return key


def _remember_log(module: Any, name: str, value: torch.Tensor, kw: dict) -> None:
    trainer = getattr(module, "_trainer", None)
    results = trainer._results if trainer is not None else None
    if results is None or module._current_fx_name is None:
        return
    key = _result_key(module, results, name, kw)
    if key in results:
        results.__dict__.setdefault(_REPLAYED, {})[key] = (dict(kw), results[key], value.device)


def _log_again(module: Any, name: str, value: torch.Tensor, kw: dict) -> bool:
    """``module.log(name, value, **kw)`` by its last step, when Lightning took the same call before (see above)."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or module._current_fx_name is None or getattr(module, "_fabric", None) is not None:
        return False
    results = trainer._results
    if results is None or trainer._logger_connector.should_reset_tensors(module._current_fx_name):
        return False
    key = _result_key(module, results, name, kw)
    seen = results.__dict__.get(_REPLAYED, {}).get(key)
    if seen is None or seen[1] is not results.get(key) or seen[2] != value.device or seen[0] != kw:
        return False
    metric = seen[1]
    value = value.detach()
    results.update_metrics(key, value, results._extract_batch_size(metric, kw.get("batch_size"), metric.meta))
    trainer._logger_connector._current_fx = module._current_fx_name
    return True


def extract_loss(output: Any, fn_name: str) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise PlanError(
        f"`{fn_name}` returned {type(output).__name__}; under HPPStrategy it must return the loss tensor or a "
        f"dict with a 'loss' tensor (returning None to skip a batch is not supported in a pipeline)."
    )
