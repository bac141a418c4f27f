"""Every hook Lightning calls, recorded with its arguments: the hooks are read from Lightning's own classes.

As Lightning's ``tests/tests_pytorch/models/test_hooks.py`` does, the hooks of a ``LightningModule``, a
``Callback`` and a ``LightningDataModule`` are their public methods (those of ``torch.nn.Module`` and a few
helpers the user calls themselves left out), found by introspection, so a hook added to Lightning is recorded
without a line here. :func:`record_hooks` wraps an object's hooks on the instance; each call is appended to a
:class:`HookLog` when it starts, as ``(owner, hook, arguments, depth)`` (``depth``: how many recorded calls it
runs inside: a data module's ``setup`` that its own ``train_dataloader`` calls is one deeper), with the arguments
described as plain data
(:func:`describe`): tensors as CPU copies, optimizers by class and number of groups, the Trainer and the
module as names, a checkpoint by its keys. Two runs' logs compare entry by entry (:mod:`.compare`).

The steps (``training_step`` ...) are not recorded: under a pipeline they run once per micro-batch on the
ranks that replay them, which is their contract, and what they compute is compared through the losses, the
logged values and the parameters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule

STEPS = frozenset({"training_step", "validation_step", "test_step", "predict_step"})
NOT_HOOKS = frozenset({
    # what the user calls, not Lightning
    "optimizers", "log", "log_dict", "all_gather", "print", "freeze", "unfreeze", "toggle_optimizer",
    "untoggle_optimizer", "toggled_optimizer", "lr_schedulers", "manual_backward", "clip_gradients",
    "save_hyperparameters", "remove_ignored_hparams", "load_from_checkpoint", "to_onnx", "to_torchscript",
    "to_tensorrt",
})
"""Public methods of Lightning's classes that are not hooks Lightning calls during a run."""


def _public_functions(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if not name.startswith("_")}


def module_hooks() -> list[str]:
    """The hooks of ``LightningModule``: its public methods but those of ``torch.nn.Module``, the steps and
    :data:`NOT_HOOKS`."""
    return sorted(_public_functions(LightningModule) - _public_functions(torch.nn.Module) - STEPS - NOT_HOOKS)


def callback_hooks() -> list[str]:
    """The hooks of ``Callback``: its public methods."""
    return sorted(_public_functions(Callback))


def datamodule_hooks() -> list[str]:
    """The hooks of ``LightningDataModule``: its public methods but :data:`NOT_HOOKS`."""
    return sorted(_public_functions(LightningDataModule) - NOT_HOOKS)


HookEntry = tuple[str, str, Any, int]
"""``(owner, hook, described arguments, depth)``: owner ``"module"``, ``"callback"`` or ``"datamodule"``."""


class HookLog(list):
    """The hook calls one process (one rank) received, in the order they started: :data:`HookEntry` items."""

    depth = 0


def record_hooks(obj: Any, owner: str, hooks: list[str], log: HookLog) -> Any:
    """Wrap ``hooks`` of ``obj`` (on the instance) so each call is appended to ``log``; returns ``obj``."""
    for name in hooks:
        method = getattr(obj, name, None)
        if method is None or not callable(method):
            continue
        wrapper = functools.partial(_call, log, owner, name, method)
        functools.update_wrapper(wrapper, method)
        object.__setattr__(obj, name, wrapper)
    return obj


def _call(log: HookLog, owner: str, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    log.append((owner, name, describe_arguments(method, name, args, kwargs), log.depth))
    log.depth += 1
    try:
        return method(*args, **kwargs)
    finally:
        log.depth -= 1


_CHECKPOINT_ARGS = ("checkpoint",)


def describe_arguments(method: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name, described (:func:`describe`); a checkpoint by its keys."""
    try:
        bound = inspect.signature(method).bind(*args, **kwargs)
        items = dict(bound.arguments)
    except (TypeError, ValueError):
        items = {**{str(i): a for i, a in enumerate(args)}, **kwargs}
    return {k: sorted(v) if k in _CHECKPOINT_ARGS and isinstance(v, Mapping) else describe(v) for k, v in items.items()}


def describe(value: Any) -> Any:
    """``value`` as plain data two processes can compare: tensors as detached CPU copies, containers entry by
    entry, Lightning's and torch's objects by kind (the Trainer, a module, an optimizer with its number of groups)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, torch.optim.Optimizer) or hasattr(value, "param_groups"):  # or a view of one (one stage's)
        inner = value if isinstance(value, torch.optim.Optimizer) else getattr(value, "optimizer", value)
        return f"<{type(inner).__name__} with {len(value.param_groups)} group(s)>"
    if isinstance(value, LightningModule):
        return "<LightningModule>"
    if isinstance(value, Callback):
        return f"<{type(value).__name__}>"
    if type(value).__name__ == "Trainer":
        return "<Trainer>"
    if callable(value):
        return "<callable>"
    return f"<{type(value).__name__}>"
