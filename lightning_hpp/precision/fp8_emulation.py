"""The ``"emulate"`` fp8 backend: quantize-dequantize numerics that run anywhere, CPU included.

:class:`EmulatedFP8Linear` rounds the GEMM inputs and weights to e4m3 and the incoming gradient to e5m2
with per-tensor scales (:class:`~lightning_hpp.precision.fp8_recipe.FP8Recipe`), then multiplies in the
compute dtype; :class:`EmulatedFP8Mode` does the same for the linear and ``addmm`` calls of a traced
stage. It reproduces fp8 *numerics* (rounding, range, saturation), never fp8 *speed*.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_hpp.errors import FP8Error
from lightning_hpp.precision.fp8_recipe import GRAD_OUTPUT, INPUT, SLOT_FORMAT, WEIGHT, FP8Recipe


def fp8_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """Per-tensor scale ``fp8_max / amax / 2**margin``; 1 where ``amax`` is 0 or not finite.

    Args:
        amax: Largest absolute value to represent (a scalar tensor).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        margin: Power-of-two headroom.

    Returns:
        A float32 scalar tensor.
    """
    amax = amax.float()
    fmax = torch.finfo(fp8_dtype).max
    valid = (amax > 0) & torch.isfinite(amax)
    scale = fmax / torch.where(valid, amax, torch.ones_like(amax)) / (2.0**margin)
    return torch.where(valid, scale, torch.ones_like(scale))


def quantize_dequantize(x: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """Round ``x`` through fp8: ``fp8(clamp(x * scale)) / scale``, returned in ``x``'s dtype.

    Values beyond the fp8 range after scaling saturate at ``±fp8_max / scale`` (as Transformer
    Engine's cast does); ``inf`` and ``nan`` in ``x`` pass through unchanged so that non-finite
    guards still see them.

    Args:
        x: Tensor to round.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale: Per-tensor scale (see :func:`fp8_scale`).

    Returns:
        A tensor of ``x``'s shape and dtype holding at most 256 distinct values.
    """
    fmax = torch.finfo(fp8_dtype).max
    xf = x.float()
    q = (xf * scale).clamp(-fmax, fmax).to(fp8_dtype).float() / scale
    return torch.where(torch.isfinite(xf), q, xf).to(x.dtype)


class _FP8LinearFunction(torch.autograd.Function):
    """``y = q4(x) @ q4(w).T + b`` with e4m3 inputs and weights; backward on the e5m2 gradient.

    Mirrors Transformer Engine's fp8 Linear: the GEMMs see quantized operands (the forward
    operands are saved already quantized), the bias gradient is taken from the unquantized
    incoming gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, module, compute_dtype):
        with torch.autocast(device_type=x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            xq = module._fp8_round(INPUT, x2).to(compute_dtype)
            wq = module._fp8_round(WEIGHT, weight).to(compute_dtype)
            out = xq @ wq.t()
            if bias is not None:
                out = out + bias.to(compute_dtype)
        ctx.save_for_backward(xq, wq)
        ctx.module = module
        ctx.shapes_dtypes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        xq, wq = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes_dtypes
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gq = ctx.module._fp8_round(GRAD_OUTPUT, g2).to(xq.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (gq @ wq).reshape(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (gq.t() @ xq).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None


class EmulatedFP8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run on fp8-rounded operands (e4m3 forward, e5m2 gradients).

    Its parameters and ``state_dict`` keys are exactly ``nn.Linear``'s (``weight``, ``bias``), so
    checkpoints move freely between this class, ``nn.Linear`` and other plans. The amax history
    (``amax_history``, shape ``(amax_history_len, 3)``, columns input / weight / grad_output, row 0
    the most recent) is a non-persistent buffer: it follows ``.to()`` but is not checkpointed.

    The GEMM runs in the autocast dtype when autocast is on for the input's device, else in the
    input's dtype. Delayed scaling starts from the tensor's own amax while the history is still
    empty (Transformer Engine starts from scale 1); afterwards the scale lags by one call, and
    values beyond the stale range saturate, as in TE.

    Args:
        in_features: As for ``nn.Linear``.
        out_features: As for ``nn.Linear``.
        bias: As for ``nn.Linear``.
        device: As for ``nn.Linear``.
        dtype: As for ``nn.Linear``.
        recipe: ``"delayed"``, ``"current"`` or an :class:`FP8Recipe`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        recipe: str | FP8Recipe = "delayed",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(FP8Recipe.coerce(recipe))

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str | FP8Recipe = "delayed") -> EmulatedFP8Linear:
        """Turn ``linear`` into an :class:`EmulatedFP8Linear` in place, keeping its parameter objects.

        The same module object is returned, so parents, hooks, optimizers and tied weights that hold
        it or its parameters keep working.
        """
        if type(linear) is not nn.Linear:
            raise FP8Error(f"`EmulatedFP8Linear.from_linear` takes an `nn.Linear`, got {type(linear).__name__}.")
        rc = FP8Recipe.coerce(recipe)
        linear.__class__ = cls
        linear._init_fp8(rc)
        return linear

    def _init_fp8(self, recipe: FP8Recipe) -> None:
        self.fp8_recipe = recipe
        rows = recipe.amax_history_len if recipe.scaling == "delayed" else 1
        self.register_buffer("amax_history", torch.zeros(rows, 3, device=self.weight.device), persistent=False)

    def _fp8_round(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        """Round one GEMM operand through its fp8 format; records its amax in the history."""
        fp8_dtype = SLOT_FORMAT[slot]
        rc = self.fp8_recipe
        amax = t.detach().abs().amax().float()
        column = self.amax_history[:, slot]
        if rc.scaling == "current":
            ref = amax
        else:
            past = column.float().max() if rc.amax_compute_algo == "max" else column[0].float()
            ref = torch.where(past > 0, past, amax)  # empty history: start from this tensor
        scale = fp8_scale(ref, fp8_dtype, rc.margin)
        # A non-finite amax (a step the loss scaler will skip) is recorded as "no information".
        recorded = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        with torch.no_grad():
            column.copy_(torch.roll(column, 1, 0))
            column[0] = recorded.to(column.dtype)
        return quantize_dequantize(t, fp8_dtype, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
        else:
            compute_dtype = x.dtype
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self, compute_dtype)

    def extra_repr(self) -> str:
        rc = self.fp8_recipe
        scaling = (
            rc.scaling if rc.scaling == "current" else f"delayed, history={rc.amax_history_len}, {rc.amax_compute_algo}"
        )
        return f"{super().extra_repr()}, fp8-emulated e4m3/e5m2 ({scaling} scaling)"


class _FP8State(nn.Module):
    """The amax history of one weight's GEMMs, for :class:`EmulatedFP8Mode` (same rule as the layer)."""

    _fp8_round = EmulatedFP8Linear._fp8_round

    def __init__(self, recipe: FP8Recipe, device: torch.device) -> None:
        super().__init__()
        self.fp8_recipe = recipe
        rows = recipe.amax_history_len if recipe.scaling == "delayed" else 1
        self.register_buffer("amax_history", torch.zeros(rows, 3, device=device), persistent=False)


class EmulatedFP8Mode(torch.overrides.TorchFunctionMode):
    """The fp8 emulation for code that has no ``nn.Linear`` to convert (a traced stage's captured graph).

    Inside the mode every linear GEMM on a parameter weight — ``aten.linear`` (``nn.Linear``) and
    ``aten.addmm`` / ``torch.addmm`` with a parameter as its second factor (GPT-2's ``Conv1D``) — runs
    through the same rounding as :class:`EmulatedFP8Linear`, with one amax history per weight;
    GEMMs whose sizes are not multiples of 16 stay in high precision, as they do there.

    A weight's state is created at its first GEMM. :meth:`adopt` names the parameters of the stage
    the mode runs, so that a checkpoint's states can be put back before that
    (:mod:`lightning_hpp.checkpoint.fp8_state`).
    """

    holds_weight_states = True  # a checkpointed stage's recompute replays ``_states`` (pipeline.stage)

    def __init__(self, recipe: str | FP8Recipe = "delayed") -> None:
        super().__init__()
        self.recipe = FP8Recipe.coerce(recipe)
        self._states: dict[int, _FP8State] = {}
        self.weights: dict[int, nn.Parameter] = {}  # the parameters of the stage it runs, by id

    def adopt(self, params: Iterable[nn.Parameter]) -> None:
        """Note ``params`` as the parameters of the stage this mode runs (see :attr:`weights`)."""
        self.weights.update((id(p), p) for p in params)

    def has_state(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` has an amax history yet (it ran a GEMM, or one was restored)."""
        return id(weight) in self._states

    def state_of(self, weight: torch.Tensor) -> _FP8State:
        """The amax history of ``weight``'s GEMMs, created (empty) if it has none yet."""
        state = self._states.get(id(weight))
        if state is None:
            state = self._states[id(weight)] = _FP8State(self.recipe, weight.device)
        return state

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _LINEARS and len(args) >= 2 and isinstance(args[1], nn.Parameter):
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0:
                return self._gemm(x, w, b)
        if func in _ADDMMS and len(args) >= 3 and isinstance(args[2], nn.Parameter) and not kwargs:
            b, x, w = args[0], args[1], args[2]  # out = b + x @ w, w of shape (in, out)
            if w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0:
                return self._gemm(x, w.t(), b, key=w)
        return func(*args, **kwargs)

    def _gemm(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, key: torch.Tensor | None = None
    ) -> torch.Tensor:
        device_type = x.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        return _FP8LinearFunction.apply(x, w, b, self.state_of(w if key is None else key), compute)


_LINEARS = (torch.ops.aten.linear.default, torch.nn.functional.linear)
_ADDMMS = (torch.ops.aten.addmm.default, torch.addmm)
