"""One pipeline stage of the sequential frontend: the user's units applied in order, with the
stage's input cast, compute context, wire dtype and output hooks; and the ``PipelineStage`` that
tells it when torch only infers boundary metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage


class StageModule(nn.Module):
    """The units of one stage, applied in order (the sequential frontend: the user's modules; the
    traced frontend: one :class:`~lightning_hpp.model.traced.TracedStage`).

    With ``spread`` (the sequential frontend's first stage, every traced stage) the first unit receives
    the stage's inputs as positional arguments; otherwise it gets them as one argument (a tuple
    crossing a stage boundary arrives as several positional arguments and is passed on as one
    tuple), and every later unit gets the previous output as one argument. ``input_dtype`` casts floating inputs to the stage's
    compute dtype inside its own forward; ``output_dtype`` fixes the wire dtype of what it sends;
    ``context`` wraps the computation (autocast, fp8); ``captured`` marks a traced stage.
    """

    def __init__(
        self,
        names: list[str],
        units: list[nn.Module],
        index: int,
        spread: bool,
        input_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
        context: Callable[[], contextlib.AbstractContextManager] | None = None,
        captured: bool = False,
    ) -> None:
        super().__init__()
        self.captured = captured  # its unit is a captured graph (traced frontend), not the user's modules
        self.names = list(names)
        self.units = nn.ModuleList(units)
        self.index = index
        self.spread = spread
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
        x: Any = args if self.spread else (args[0] if len(args) == 1 else tuple(args))
        if self.input_dtype is not None:
            x = _cast(x, self.input_dtype)
        with self.context() if self.context is not None else contextlib.nullcontext():
            for i, unit in enumerate(self.units):
                x = unit(*x) if (self.spread and i == 0) else unit(x)
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
    """A PipelineStage that tells its StageModule when a pass only infers metadata (forward, and
    backward: torch then calls the loss function once on the inference outputs)."""

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self.submod.inferring = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.inferring = False

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self.submod.inferring = True
        try:
            return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.inferring = False


def _contiguous(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.contiguous()
    if isinstance(x, (tuple, list)):
        return type(x)(_contiguous(v) for v in x)
    return x
