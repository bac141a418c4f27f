"""Pipeline units of a LightningModule and the sequential-forward check.

The units are the module's top-level children in registration order; an ``nn.Sequential`` or
``nn.ModuleList`` child is expanded into its items (``blocks.0``, ``blocks.1``, ...), so a model
can be cut between any two blocks. Loss modules and torchmetrics metrics are not units: they hold
no pipeline computation and stay on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_hpp.plan import PlanError


class SequentialForwardError(PlanError):
    """``forward`` is not the units applied in order, so the model cannot be cut into stages."""


def _is_excluded(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.loss._Loss):
        return True
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:  # pragma: no cover - torchmetrics ships with lightning
        return False
    return isinstance(module, (Metric, MetricCollection))


def find_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pipeline units of ``module`` in registration order.

    Raises:
        PlanError: when the module has no units, or registers parameters directly on itself
            (such parameters belong to no unit, so no stage could own them).
    """
    direct = [n for n, _ in module.named_parameters(recurse=False)]
    if direct:
        raise PlanError(
            f"`{type(module).__name__}` registers parameters {direct} directly on itself; pipeline "
            f"stages are made of child modules, so move them into a submodule (e.g. an `nn.Module` "
            f"that holds the parameter and applies it in its `forward`)."
        )
    units: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        if _is_excluded(child):
            continue
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            for item_name, item in child.named_children():
                units.append((f"{name}.{item_name}", item))
        else:
            units.append((name, child))
    if not units:
        raise PlanError(
            f"`{type(module).__name__}` has no child modules to cut into stages; define the layers as "
            f"attributes (e.g. `self.encoder = ...`) in `__init__`."
        )
    return units


def get_unit(module: nn.Module, name: str) -> nn.Module:
    return module.get_submodule(name)


def replace_unit(module: nn.Module, name: str, new: nn.Module) -> None:
    """Replace unit ``name`` (``"encoder"`` or ``"blocks.3"``) inside ``module``."""
    parent_name, _, leaf = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    if isinstance(parent, (nn.Sequential, nn.ModuleList)):
        parent[int(leaf)] = new
    else:
        setattr(parent, leaf, new)


def apply_unit(unit: nn.Module, x: Any, first: bool) -> Any:
    """Apply one unit the way the pipeline does: the first unit takes the forward's positional
    arguments, every later unit takes the previous unit's output as one argument."""
    if first:
        return unit(*x)
    return unit(x)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return False


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in x) + ")"
    return type(x).__name__


def check_sequential_forward(
    module: nn.Module, units: Sequence[tuple[str, nn.Module]], args: tuple, boundaries: Sequence[int] = ()
) -> None:
    """Check that ``module(*args)`` equals applying ``units`` in order.

    Runs one real forward in eval mode without gradients and with the RNG state restored
    afterwards, recording each unit's input and output with hooks.

    Args:
        module: The LightningModule.
        units: Its pipeline units (:func:`find_units`).
        args: Positional arguments of one real micro-batch's ``forward`` call.
        boundaries: Indices ``i`` such that a stage boundary lies after unit ``i``; the tensors
            crossing them must be floating point.

    Raises:
        SequentialForwardError: naming the first unit where the forward departs from the chain,
            or a boundary that carries a non-float tensor.
    """
    calls: list[tuple[int, Any, Any]] = []
    handles = []
    for i, (_, unit) in enumerate(units):
        def hook(mod, inputs, output, i=i):
            calls.append((i, inputs, output))

        handles.append(unit.register_forward_hook(hook))
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = module(*args)
    finally:
        module.train(was_training)
        for h in handles:
            h.remove()

    names = [n for n, _ in units]
    order = [i for i, _, _ in calls]
    if order != list(range(len(units))):
        missing = [names[i] for i in range(len(units)) if i not in order]
        if missing:
            raise SequentialForwardError(
                f"`forward` does not call units {missing}; a pipeline needs `forward(x)` to apply every "
                f"unit once, in registration order ({' -> '.join(names)}). Remove unused modules or "
                f"register them in the order `forward` uses them."
            )
        first_bad = next(k for k, i in enumerate(order) if k >= len(units) or i != k)
        got = names[order[first_bad]] if first_bad < len(order) else "-"
        raise SequentialForwardError(
            f"`forward` calls the units in the order {[names[i] for i in order]}; expected each once in "
            f"registration order ({' -> '.join(names)}). The first difference is at position {first_bad}: "
            f"{got!r}. Register modules in the order `forward` applies them."
        )
    for k in range(1, len(units)):
        prev_out = calls[k - 1][2]
        inputs = calls[k][1]
        received = inputs[0] if len(inputs) == 1 else inputs
        if not _same(received, prev_out):
            raise SequentialForwardError(
                f"`forward` is not sequential at unit {names[k]!r}: its input ({_describe(received)}) is not "
                f"the output of {names[k - 1]!r} ({_describe(prev_out)}). Move the computation between "
                f"them into a module (a unit of its own or part of {names[k - 1]!r}), so that "
                f"`forward(x)` equals applying {' -> '.join(names)} in order."
            )
    first_in = calls[0][1]
    if not _same(tuple(first_in), tuple(args)):
        raise SequentialForwardError(
            f"`forward` transforms its input before the first unit {names[0]!r} (it receives "
            f"{_describe(first_in)}, `forward` was called with {_describe(args)}). Move that computation "
            f"into a module so the first unit receives `forward`'s arguments."
        )
    if not _same(out, calls[-1][2]):
        raise SequentialForwardError(
            f"`forward` changes the output of the last unit {names[-1]!r} before returning it "
            f"({_describe(calls[-1][2])} -> {_describe(out)}). Move that computation into a module."
        )
    for b in boundaries:
        value = calls[b][2]
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise SequentialForwardError(
                    f"The stage boundary after unit {names[b]!r} carries {_describe(value)}; pipeline "
                    f"boundaries must carry floating-point tensors (gradients flow back through them). "
                    f"Cut the model elsewhere, or convert the value to float inside {names[b]!r}."
                )
