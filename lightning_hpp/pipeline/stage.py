"""One pipeline stage of the sequential frontend: the user's units applied in order, with the
stage's input cast, compute context, wire dtype, output hooks and optional activation
checkpointing; and the ``PipelineStage`` that tells it when torch only infers boundary metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.utils.checkpoint import checkpoint

from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.shapes import StageBoundary


class StageModule(nn.Module):
    """The units of one stage, applied in order (the sequential frontend: the user's modules; the
    traced frontend: one :class:`~lightning_hpp.model.traced.TracedStage`).

    With ``spread`` (the sequential frontend's first stage, every traced stage) the first unit receives
    the stage's inputs as positional arguments; otherwise it gets them as one argument (a tuple
    crossing a stage boundary arrives as several positional arguments and is passed on as one
    tuple), and every later unit gets the previous output as one argument. ``input_dtype`` casts floating inputs to the
    stage's
    compute dtype inside its own forward; ``output_dtype`` fixes the wire dtype of what it sends;
    ``context`` wraps the computation (autocast, fp8); ``captured`` marks a traced stage.

    ``checkpoint_activations`` runs each unit (the traced frontend: the whole captured stage) under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: only the unit's inputs are kept,
    and its forward runs again during the backward, with the same results, bit for bit: the RNG state
    of the forward is replayed (dropout draws the same mask), the recompute runs in the stage's
    ``context`` again (autocast, fp8 emulation) and reads the buffers as the forward read them
    (``_BufferReplay``), and what it writes to buffers (BatchNorm running statistics, fp8 amax
    histories) is discarded, so they are updated once per micro-batch. It is off while torch infers
    metadata and when gradients are off (``torch.no_grad()``: evaluation, prediction). Forward hooks
    of the user's modules inside a checkpointed unit also run during the recompute (pre-hooks always,
    post-hooks unless torch stops the recompute once it has what the backward needs).
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
        checkpoint_activations: bool = False,
    ) -> None:
        super().__init__()
        self.checkpoint_activations = bool(checkpoint_activations)
        self._te_checked = False
        self.captured = captured  # its unit is a captured graph (traced frontend), not the user's modules
        self.names = list(names)
        self.units = nn.ModuleList(units)
        self.index = index
        self.spread = spread
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype
        self.context = context
        self.output_hooks: list[Callable[[int, Any], Any]] = []
        # called by the pipeline stage before each backward with (stage, micro-batch, what the stage's forward of
        # that micro-batch returned, the gradients arriving at it: ``None`` on the last stage); a hook may change
        # the gradients in place
        self.grad_hooks: list[Callable[[int, int, Any, tuple | None], None]] = []
        self.microbatch = -1  # index of the micro-batch being computed; reset by the runner each step
        self.inferring = False  # set while torch pipelining infers boundary metadata

    def forward(self, *args: Any) -> Any:
        if self.inferring:
            return self._infer(*args)
        self.microbatch += 1
        return self._run(*args, guards=True)

    def _infer(self, *args: Any) -> Any:
        # torch pipelining infers boundary shapes by running the stage on uninitialised tensors:
        # run it on zeros instead, and leave every buffer (running stats, fp8 amax history) untouched,
        # the amax histories a traced stage's fp8 emulation keeps outside the modules included.
        args = tuple(_zeros_like(a) for a in args)
        mode = _fp8_emulation(self.context()) if self.captured and self.context is not None else None
        states = {} if mode is None else dict(mode._states)
        buffers = [*(b for _, b in self.named_buffers()), *(b for s in states.values() for b in s.buffers())]
        saved = [(b, b.detach().clone()) for b in buffers]
        try:
            return self._run(*args, guards=False)
        finally:
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)
            if mode is not None:  # states the inference created: the first real GEMM creates them afresh
                for key in [k for k in mode._states if k not in states]:
                    del mode._states[key]

    def _run(self, *args: Any, guards: bool) -> Any:
        x: Any = args if self.spread else (args[0] if len(args) == 1 else tuple(args))
        if self.input_dtype is not None:
            x = _cast(x, self.input_dtype)
        recompute = self.checkpoint_activations and not self.inferring and torch.is_grad_enabled()
        if recompute and not self._te_checked:
            self._refuse_te()
        context = self.context() if self.context is not None else contextlib.nullcontext()
        with context:
            for i, unit in enumerate(self.units):
                inputs = tuple(x) if (self.spread and i == 0) else (x,)
                x = self._checkpointed(unit, inputs, context) if recompute else unit(*inputs)
        if self.output_dtype is not None:
            x = _cast(x, self.output_dtype)
        # torch pipelining sizes receive buffers from the sent tensor's strides: send dense tensors
        x = _contiguous(x)
        if guards:
            for hook in self.output_hooks:
                x = hook(self.index, x)
        return x

    def _checkpointed(self, unit: nn.Module, inputs: tuple, context: Any) -> Any:
        replay = _BufferReplay(unit, context)
        recompute = _RecomputeContext(replay, self.context)
        out = checkpoint(
            unit,
            *inputs,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=lambda: (contextlib.nullcontext(), recompute),
        )
        replay.settle()
        return out

    def _refuse_te(self) -> None:
        for m in self.units.modules():
            if type(m).__module__.startswith("transformer_engine"):
                raise PlanError(
                    f"Stage {self.index} runs `{type(m).__name__}` from Transformer Engine (fp8) with activation "
                    f"checkpointing; its recompute would advance TE's fp8 scaling state a second time. Turn "
                    f"`StageSpec(activation_checkpointing=False)` for stage {self.index}, or use "
                    f"`HPPPrecision(fp8_backend='emulate')`."
                )
        self._te_checked = True


class _BufferReplay:
    """The buffers of one checkpointed unit call as they were before it.

    Taken before the forward: every buffer of the unit, and the amax histories of a traced stage's
    fp8 emulation. While the recompute runs, the buffers are replaced by copies of these values (the
    recompute reads what the forward read, even after later micro-batches updated them: delayed fp8
    scaling) and afterwards put back untouched (the recompute's own updates, BatchNorm's running
    statistics and ``num_batches_tracked`` for one, land in the copies): each buffer is updated once
    per micro-batch, as without checkpointing. All buffers are kept, not only those the forward
    changed: kernels such as BatchNorm's update buffers in place without bumping their version, and
    comparing values would synchronise the device; buffers are small next to the activations saved.
    """

    def __init__(self, unit: nn.Module, context: Any) -> None:
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[nn.Module, str]]]] = {}
        self._mode = _fp8_emulation(context)  # a traced stage's fp8 emulation: its per-weight states live there
        self._states: dict[Any, nn.Module] = {} if self._mode is None else self._mode._states
        self._before, self._new = set(self._states), set()
        modules = [*unit.modules(), *self._states.values()]
        for m in modules:
            for name, b in m._buffers.items():
                if b is not None:
                    slot = self._slots.get(id(b))
                    if slot is None:
                        slot = self._slots[id(b)] = (b, b.detach().clone(), [])
                    slot[2].append((m, name))

    def settle(self) -> None:
        """After the forward: note the fp8 states it created."""
        self._new = set(self._states) - self._before

    def swap_in(self) -> Any:
        put_back = []
        for b, before, owners in self._slots.values():
            copy = before.clone()
            for m, name in owners:
                m._buffers[name] = copy
            put_back.append((b, owners))
        if self._mode is not None:  # states the forward created are created afresh by the recompute, then dropped
            self._mode._states = {k: v for k, v in self._states.items() if k not in self._new}
        return put_back

    def swap_out(self, put_back: Any) -> None:
        for b, owners in put_back:
            for m, name in owners:
                m._buffers[name] = b
        if self._mode is not None:
            self._mode._states = self._states


class _RecomputeContext:
    """What a checkpointed unit's recompute runs in: the stage's ``context`` and the buffers as the
    forward saw them (reusable: a backward with ``retain_graph`` may recompute again)."""

    def __init__(self, replay: _BufferReplay, context: Callable[[], contextlib.AbstractContextManager] | None) -> None:
        self.replay, self.context = replay, context
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.callback(self.replay.swap_out, self.replay.swap_in())
        try:
            if self.context is not None:
                stack.enter_context(self.context())
        except BaseException:
            stack.close()
            raise
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        return self._stacks.pop().__exit__(*exc)


def _fp8_emulation(context: Any) -> Any:
    """A stage context that keeps per-weight state modules of its own in ``_states`` (the traced
    frontend's fp8 emulation marks itself with ``holds_weight_states = True``), else ``None``."""
    return context if getattr(context, "holds_weight_states", False) else None


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


class HookedStage(PipelineStage):
    """A PipelineStage that tells its StageModule when a pass only infers metadata (forward, and
    backward: torch then calls the loss function once on the inference outputs), runs the step's
    last full backward of the stage inside ``on_last_backward(stage_index)`` when set (where the
    gradient hand-over starts the data-parallel all-reduce of finished gradients), and before each
    backward of a micro-batch hands the gradients that arrived from the next stage to the
    StageModule's ``grad_hooks`` and then calls ``on_backward(stage_index)``, and before each separate
    weight pass (zero-bubble schedules) ``on_backward_weight(stage_index)``: the runner counts them, to
    post the step's exchange as soon as this rank's part of it is final. The last stage's backward of a
    micro-batch starts from ``loss_grad(loss, micro-batch)`` (the runner's scale of the loss: the micro-batch's
    share of the step's loss and the fp16 loss scale) where torch would start it from ones. With ``shapes``
    (:class:`~lightning_hpp.pipeline.shapes.StageBoundary`) its boundary shapes follow the batch: new ones are
    handed over before the step's first activation, and a forward that fails on them raises a
    :class:`~lightning_hpp.errors.ShapeError`.

    An FSDP2 stage's last full backward runs as FSDP2 runs outside a pipeline: each unit is resharded
    and its gradients reduce-scattered as soon as its backward is done. torch 2.13 runs every backward of
    a stage with ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` and
    reduces only in the schedule's ``REDUCE_GRAD`` after it, so the stage's whole parameters and unsharded
    gradients coexist at the end of the backward; here the units free them one after another (the
    schedule's reduction then finds nothing left to reduce and only scales). With one micro-batch a step
    that is FSDP's own peak (one unit gathered with ``reshard_after_forward=True``); with several, the
    gradients accumulated over the earlier micro-batches are still whole when the last backward starts."""

    on_last_backward: Callable[[int], contextlib.AbstractContextManager] | None = None
    on_backward: Callable[[int], None] | None = None
    on_backward_weight: Callable[[int], None] | None = None
    loss_grad: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    shapes: StageBoundary | None = None  # boundary shapes that change between steps (lightning_hpp.pipeline.shapes)
    _bwd_chunk = 0  # the micro-batch whose backward runs (the last stage's loss gradient depends on it)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        if self.shapes is not None:
            self.shapes.receive(fwd_chunk_id)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        if self.shapes is not None:
            self.shapes.send(fwd_chunk_id)
        return super().get_fwd_send_ops(fwd_chunk_id)

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        shapes = self.shapes
        if shapes is None or not shapes.fresh:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        shapes.local_inputs(fwd_chunk_id, args)
        try:
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        except Exception as err:
            refusal = shapes.failed(err)
            if refusal is None:
                raise
            raise refusal from err
        shapes.learn_outputs(fwd_chunk_id)
        return out

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> Any:
        self._bwd_chunk = bwd_chunk_id
        # every schedule's backward of a micro-batch comes through here, once (a zero-bubble schedule's input
        # pass; the weight pass follows in backward_weight_one_chunk), after its gradients were received
        if self.has_backward:
            hooks = getattr(self.submod, "grad_hooks", None)
            if hooks:
                output = self.fwd_cache.get(bwd_chunk_id, ((),))[0]
                grads = (
                    None
                    if self.is_last
                    else tuple(getattr(i, "buffer", None) for i in self.grad_recv_info[bwd_chunk_id])
                )
                for hook in hooks:
                    hook(self.stage_index, bwd_chunk_id, output, grads)
            if self.on_backward is not None:
                self.on_backward(self.stage_index)
        return super().backward_one_chunk(
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
        )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        if self.has_backward and self.on_backward_weight is not None:
            self.on_backward_weight(self.stage_index)
        return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if self.is_last and self.loss_grad is not None and bwd_kwargs.get("output_grads") is None:
            # the last stage's backward starts from the loss; torch seeds it with ones, ours with the loss's scale
            # (the dict is the one torch keeps for a zero-bubble schedule's weight pass)
            out = bwd_kwargs["stage_output"]
            if isinstance(out, torch.Tensor):
                bwd_kwargs["output_grads"] = self.loss_grad(out, self._bwd_chunk)
            elif isinstance(out, (tuple, list)) and len(out) == 1 and isinstance(out[0], torch.Tensor):
                bwd_kwargs["output_grads"] = (self.loss_grad(out[0], self._bwd_chunk),)
            else:  # never trained on an unscaled loss
                raise RuntimeError(
                    f"internal: stage {self.stage_index}'s backward starts from a "
                    f"{type(out).__name__}, not from the loss"
                )
        run = super().backward_maybe_with_nosync
        if last_backward and backward_type == "full" and isinstance(self.submod, FSDPModule):
            run = self._fsdp_last_backward
        if not (last_backward and backward_type == "full" and self.on_last_backward is not None):
            return run(backward_type, bwd_kwargs, last_backward=last_backward)
        with self.on_last_backward(self.stage_index):
            return run(backward_type, bwd_kwargs, last_backward=last_backward)

    def _fsdp_last_backward(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = True) -> Any:
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self.submod.inferring = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        except Exception as err:  # the schedule's first step: the first forward on this batch's shapes
            refusal = self.shapes.failed(err) if self.shapes is not None else None
            if refusal is None:
                raise
            raise refusal from err
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
