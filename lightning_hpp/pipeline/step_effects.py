"""What the user's step leaves behind besides its loss: the module state it changes, and the outputs it returns.

A Lightning step may record things on the module (``self.outputs.append(...)``, a counter, a torchmetrics
``update``) that the epoch-end hooks read, and may return a dict whose keys ``on_train_batch_end`` receives.
Under a pipeline the step runs on the last stage, once per micro-batch; every other rank must end up holding
what one process holds.

* :class:`ModuleState` takes a snapshot of the state a step can change (public attributes of every module, the
  LightningModule's own private ones, torchmetrics states), tells whether it changed, and puts it back. The
  setup runs each step once on one micro-batch inside it (:func:`lightning_hpp.pipeline.steps.dry_run`): a
  step that changes state is replayed on every rank of the pipeline with the last stage's outputs.
* :func:`merge_outputs` makes the step's returned extras over the micro-batches what the step returns for the
  whole batch.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_hpp.errors import PlanError

_CONTAINERS = (list, dict, set, collections.deque)
_BASELINE_PRIVATE: set[str] | None = None


def _lightning_private_names() -> set[str]:
    """The private attributes a bare LightningModule holds (Lightning's own bookkeeping, not the user's)."""
    global _BASELINE_PRIVATE
    if _BASELINE_PRIVATE is None:
        from lightning.pytorch import LightningModule

        _BASELINE_PRIVATE = {k for k in vars(LightningModule()) if k.startswith("_")}
    return _BASELINE_PRIVATE


def is_metric(module: Any) -> bool:
    """A torchmetrics ``Metric`` (duck-typed: torchmetrics is Lightning's dependency, not ours)."""
    return hasattr(module, "_defaults") and hasattr(module, "_update_count")


class ModuleState:
    """A snapshot of the state a step can change on ``root`` and its submodules.

    Held: every public attribute of every module (containers — lists, dicts, sets, deques — with a shallow copy of
    their contents; tensors with their version counter, which in-place updates bump); the LightningModule's own
    private attributes other than Lightning's bookkeeping; every torchmetrics ``Metric``'s states. Not held: the
    parameters and buffers (Lightning's optimizer step changes them, not the step) and ``training``.
    """

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        self._modules = [(m, {k: _held(v) for k, v in vars(m).items() if _tracked(k, m is root)})
                         for m in root.modules()]
        self._metrics = [(m, _metric_state(m)) for m in root.modules() if is_metric(m)]

    def changed(self) -> bool:
        """Whether anything held differs from the snapshot: an attribute set, rebound or removed, a container's
        contents, a tensor changed in place, a metric updated."""
        for m, held in self._modules:
            now = vars(m)
            if any(k not in held for k in now if _tracked(k, m is self._root)):
                return True
            if any(now.get(k, _MISSING) is not obj or _differs(obj, contents) for k, (obj, contents) in held.items()):
                return True
        return any(m._update_count != state.get("_update_count") for m, state in self._metrics)

    def restore(self) -> None:
        """Put every held attribute and metric state back as it was at the snapshot."""
        for m, held in self._modules:
            now = vars(m)
            for k in [k for k in now if k not in held and _tracked(k, m is self._root)]:
                object.__delattr__(m, k)  # set by the step
            for k, (obj, contents) in held.items():
                if now.get(k, _MISSING) is not obj:
                    object.__setattr__(m, k, obj)
                if isinstance(obj, (list, collections.deque)):
                    obj.clear()
                    obj.extend(contents)
                elif isinstance(obj, (dict, set)):
                    obj.clear()
                    obj.update(contents)
        for m, state in self._metrics:
            for k, v in state.items():
                setattr(m, k, v)

    def merge_appends(self, sizes: list[int], fn_name: str) -> None:
        """After the step ran once per micro-batch (``sizes``: their sizes): what it appended to a list as one process
        appends it for the whole batch. A list the step grew by ``k`` entries per micro-batch gets ``k`` entries, each
        the micro-batches' entries merged as the step's returned values are (:func:`merge_outputs`: per-sample
        tensors concatenated, floating numbers averaged, counts summed); a list whose growth cannot be merged so is
        left as the micro-batches made it."""
        n = len(sizes)
        for m, held in self._modules:
            for k, (obj, contents) in held.items():
                if not isinstance(obj, list) or vars(m).get(k) is not obj or len(obj) <= len(contents):
                    continue
                grown = len(obj) - len(contents)
                if grown % n or any(a is not b for a, b in zip(obj, contents)):
                    continue
                per = grown // n
                new = obj[len(contents):]
                try:
                    merged = [_merge([new[i * per + j] for i in range(n)], sizes, f"{fn_name}: self.{k}")
                              for j in range(per)]
                except PlanError:
                    continue
                obj[len(contents):] = merged


def _tracked(name: str, root: bool) -> bool:
    if name == "training":
        return False
    return not name.startswith("_") or (root and name not in _lightning_private_names())


_MISSING = object()


def _held(obj: Any) -> tuple[Any, Any]:
    if isinstance(obj, _CONTAINERS):
        return obj, copy.copy(obj)
    if isinstance(obj, torch.Tensor):
        return obj, obj._version
    return obj, None


def _differs(obj: Any, contents: Any) -> bool:
    if isinstance(obj, dict):
        return obj.keys() != contents.keys() or any(obj[k] is not contents[k] for k in obj)
    if isinstance(obj, (list, collections.deque)):
        return len(obj) != len(contents) or any(a is not b for a, b in zip(obj, contents))
    if isinstance(obj, set):
        return obj != contents
    if isinstance(obj, torch.Tensor):
        return obj._version != contents
    return False


def _metric_state(metric: Any) -> dict[str, Any]:
    keys = [*metric._defaults, "_update_count", "_computed"]
    return {k: copy.deepcopy(getattr(metric, k)) for k in keys if hasattr(metric, k)}


# ------------------------------------------------------------------------------------------------ returned outputs
def step_extras(result: Any) -> dict[str, Any] | None:
    """The keys other than ``"loss"`` of a step's returned mapping, detached (``None``: a tensor, or no other key)."""
    if not isinstance(result, Mapping):
        return None
    extras = {k: _detach(v) for k, v in result.items() if k != "loss"}
    return extras or None


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return type(value)((k, _detach(v)) for k, v in value.items()) if isinstance(value, dict) else {
            k: _detach(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_detach(v) for v in value)
    return value


def merge_outputs(parts: list[dict[str, Any] | None], sizes: list[int], fn_name: str) -> dict[str, Any] | None:
    """The extras the step returned for each micro-batch (``parts``, micro-batch ``i`` of ``sizes[i]`` samples) as
    the step returns them for the whole batch:

    * a tensor whose dim 0 is its micro-batch's size (per-sample predictions, targets, losses): concatenated;
    * a floating-point number (a 0-d tensor or a Python float: an accuracy, an auxiliary loss): the mean over the
      micro-batches weighted by their sizes, as the loss;
    * an integer or boolean number (a count): the sum;
    * anything else (a string, ``None``, an object): the same in every micro-batch, kept;
    * dicts, lists and tuples: merged entry by entry.

    Raises:
        PlanError: micro-batches disagree on the keys, on the structure, or on a value that is neither a number
            nor per-sample (named, with the rule).
    """
    if all(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    if any(p is None for p in parts) or len({tuple(p) for p in parts}) != 1:
        raise PlanError(
            f"`{fn_name}` returned different keys for the micro-batches of one batch "
            f"({[sorted(p or ()) for p in parts]}); "
            f"under HPPStrategy the step runs once per micro-batch and its returned dict is merged key by key, so "
            f"every micro-batch must return the same keys."
        )
    return {k: _merge([p[k] for p in parts], sizes, f"{fn_name}: output {k!r}") for k in parts[0]}


def _merge(values: list[Any], sizes: list[int], where: str) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) for v in values):
        if first.dim() >= 1 and all(v.dim() >= 1 and v.shape[0] == n for v, n in zip(values, sizes)):
            return torch.cat(values, dim=0)
        if all(v.numel() == 1 for v in values):
            stacked = torch.stack([v.reshape(()) for v in values])
            if stacked.is_floating_point() or stacked.is_complex():
                weights = torch.tensor(sizes, dtype=stacked.dtype, device=stacked.device)
                return (stacked * weights).sum() / weights.sum()
            return stacked.sum()
        return _refuse(values, where)
    if isinstance(first, bool) and all(isinstance(v, bool) for v in values):
        return sum(values) if len(set(values)) > 1 else first
    if isinstance(first, (int, float)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if any(isinstance(v, float) for v in values):
            return sum(v * n for v, n in zip(values, sizes)) / sum(sizes)
        return sum(values)
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
        return (
            type(first)((k, _merge([v[k] for v in values], sizes, f"{where}[{k!r}]")) for k in first)
            if isinstance(first, dict)
            else {k: _merge([v[k] for v in values], sizes, f"{where}[{k!r}]") for k in first}
        )
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) and len(v) == len(first) for v in values):
        merged = [_merge([v[i] for v in values], sizes, f"{where}[{i}]") for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    if all(_same(v, first) for v in values[1:]):
        return first
    return _refuse(values, where)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a plain equality is not the same
        return a is b


def _refuse(values: list[Any], where: str) -> Any:
    kinds = [tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]
    raise PlanError(
        f"{where} cannot be merged over the micro-batches ({kinds}): under HPPStrategy the step runs once per "
        f"micro-batch, and its returned values are merged into the whole batch's — tensors whose dim 0 is the "
        f"micro-batch's size are concatenated, floating-point numbers averaged, integer numbers summed, other values "
        f"kept where every micro-batch returns the same. Return per-sample tensors or numbers, or log the value."
    )
