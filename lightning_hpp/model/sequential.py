"""The sequential-forward check: ``forward(x)`` must equal applying the units in order for the
sequential frontend to cut the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_hpp.errors import SequentialForwardError
from lightning_hpp.model.materialize import is_fake


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if is_fake(a) or is_fake(b):  # a model built on the meta device has no values: only the tensor itself counts
            return False
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
