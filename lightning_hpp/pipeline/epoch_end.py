"""Epoch ends under a pipeline: every rank ends an epoch with the last stage's values.

The user's steps run on the last stage's ranks (the other ranks capture or forward their share of
the pipeline), so whatever a step collects — a list of outputs, ``metric.update(...)`` — exists
there only. :func:`replay_epoch_ends` wraps the LightningModule's ``on_train_epoch_end``,
``on_validation_epoch_end`` and ``on_test_epoch_end`` on this instance:

* on the last stage's ranks the user's hook runs as written; a ``self.log(..., sync_dist=True)``
  in it is reduced over the data-parallel group (the last stages of the replicas), not the world;
* the epoch's values of every ``self.log`` of the epoch (the steps' and the hook's, torchmetrics
  ``Metric`` objects computed as Lightning computes them) are then taken on the last stage and
  sent to the pipeline's other ranks, which run no user code in the hook: they log what the hook
  logged and end the epoch with the last stage's values.

So ``trainer.callback_metrics``, ``logged_metrics``, the progress bar, ``ModelCheckpoint``,
``EarlyStopping`` and plateau schedulers see the same values on every rank, as under DDP. Other
state a hook changes is changed on the last stage's ranks only. Lightning keeps the epoch values in
its loops' result collections (``trainer._results``, a private attribute: there is no public way
to hand a value computed elsewhere to them); this module is the one place that reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpp._dist import group_device

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


def replay_epoch_ends(module: nn.Module, *, holds_last: bool, pp_group: Any, last_position: int, dp_group: Any) -> None:
    """Wrap the epoch-end hooks of ``module`` (this instance only) as the module docstring says.

    Args:
        module: The LightningModule.
        holds_last: Whether this rank holds the last stage.
        pp_group: This replica's pipeline group (``None`` with one pipeline position: nothing to send).
        last_position: The last stage's rank in ``pp_group``.
        dp_group: This rank's data-parallel group (what a hook's ``sync_dist=True`` reduces over).
    """
    for name in EPOCH_END_HOOKS:
        user_hook = getattr(module, name)
        if getattr(user_hook, "_hpp_epoch_end", False):
            user_hook = user_hook.__wrapped__
        wrapped = functools.partial(_epoch_end, module, user_hook, holds_last, pp_group, last_position, dp_group)
        wrapped = functools.update_wrapper(wrapped, user_hook)
        wrapped._hpp_epoch_end = True  # type: ignore[attr-defined]
        object.__setattr__(module, name, wrapped)


def _epoch_end(module: nn.Module, user_hook: Callable[[], Any], holds_last: bool, pp_group: Any, last_position: int,
               dp_group: Any) -> None:
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        user_hook()
        return
    results = module.trainer._results
    payload = None
    if holds_last:
        with _hook_sync_over(module, dp_group) as logged:
            user_hook()
        fx = module._current_fx_name
        # what differs on the other ranks: what the hook logged, and the torchmetrics the steps logged (values the
        # steps replayed as tensors are equal everywhere; callbacks log on every rank: Lightning ends those itself)
        payload = [(key, rm.meta.name, rm.meta.fx, _log_kwargs(rm.meta), _epoch_value(rm))
                   for key, rm in results.items() if rm.meta.on_epoch and not rm.has_reset
                   and (not rm.is_tensor or (rm.meta.name in logged and _same_hook(rm.meta.fx, fx)))]
        payload = [(key, *rest) for key, *rest in payload if rest[-1] is not None]
        payload = (fx, payload)
    box = [payload]
    dist.broadcast_object_list(box, group_src=last_position, group=pp_group, device=group_device(pp_group))
    if holds_last:
        return
    fx, entries = box[0]
    for key, name, key_fx, kwargs, value in entries:
        value = torch.as_tensor(value)
        if key not in results or results[key].has_reset:  # not logged on this rank this epoch
            if not _same_hook(key_fx, fx):
                continue  # a step's value this rank never logged (the step's last calls differ): nothing to end
            module.log(name, value, **kwargs)
        results[key]._computed = value


def _same_hook(key_fx: str, fx: str) -> bool:
    return key_fx == fx or key_fx.startswith(fx + ".")  # "<hook>.<dataloader_idx>"


def _epoch_value(rm: Any) -> Any:
    """The epoch value Lightning would compute for ``rm`` (cached there, so it is computed once)."""
    value = rm.compute()
    return value.detach().cpu() if isinstance(value, torch.Tensor) else None


def _log_kwargs(meta: Any) -> dict[str, Any]:
    """``self.log`` arguments that recreate an epoch-level entry on a rank that did not log it."""
    return {"prog_bar": meta.prog_bar, "logger": meta.logger, "on_step": False, "on_epoch": True,
            "add_dataloader_idx": meta.add_dataloader_idx, "batch_size": 1}


class _hook_sync_over:
    """``self.log(..., sync_dist=True)`` inside a last-stage epoch-end hook: reduced over ``dp_group``; the
    names the hook logs are collected."""

    def __init__(self, module: nn.Module, dp_group: Any) -> None:
        self.module, self.dp_group = module, dp_group
        self.logged: set[str] = set()

    def __enter__(self) -> set[str]:
        log = type(self.module).log.__get__(self.module)
        group, logged = self.dp_group, self.logged

        def hook_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
                kwargs["sync_dist_group"] = group
            logged.add(name)
            log(name, value, *args, **kwargs)

        object.__setattr__(self.module, "log", hook_log)
        return logged

    def __exit__(self, *exc: Any) -> None:
        object.__delattr__(self.module, "log")
