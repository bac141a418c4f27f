"""The NaN/Inf guard at every stage boundary: forward activations leaving a stage and gradients
arriving at it, named by stage, micro-batch and step."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_hpp.errors import NonFiniteError


class BoundaryGuard:
    """Installed as an output hook of every stage (``StageModule.output_hooks``).

    Args:
        policy: ``"raise"``, ``"warn"`` or ``"sanitize"`` (``nan_to_num`` before the next stage).
        microbatch: The micro-batch a held stage is computing (``stage -> index``).
        step: The optimizer step being run.
        scaled: fp16 loss scaling is on; overflowing gradients are then the scaler's business.
    """

    def __init__(self, policy: str, microbatch: Callable[[int], int], step: Callable[[], int], scaled: bool) -> None:
        self.policy = policy
        self._microbatch = microbatch
        self._step = step
        self._scaled = scaled

    def __call__(self, stage: int, x: Any) -> Any:
        step, mb = self._step(), self._microbatch(stage)
        tensors = x if isinstance(x, (tuple, list)) else (x,)
        if any(not bool(torch.isfinite(t).all()) for t in tensors if isinstance(t, Tensor) and t.is_floating_point()):
            x = self._on_nonfinite(x, f"forward activation leaving stage {stage} (micro-batch {mb}, step {step})")
        for t in (x if isinstance(x, (tuple, list)) else (x,)):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(lambda g, stage=stage, mb=mb, step=step: self._grad_guard(g, stage, mb, step))
        return x

    def _grad_guard(self, grad: Tensor, stage: int, mb: int, step: int) -> Tensor | None:
        if self._scaled:
            return None
        if not bool(torch.isfinite(grad).all()):
            return self._on_nonfinite(grad, f"gradient arriving at stage {stage} from stage {stage + 1} (micro-batch {mb}, step {step})")
        return None

    def _on_nonfinite(self, x: Any, where: str) -> Any:
        msg = f"NaN/Inf in the {where}."
        if self.policy == "raise":
            raise NonFiniteError(
                msg + " Lower the learning rate, check the inputs, or use `HPPPrecision(nonfinite='warn')` / "
                "`'sanitize'` to continue (sanitize replaces NaN/Inf with finite values)."
            )
        warnings.warn(msg + (" Replaced with finite values (nonfinite='sanitize')." if self.policy == "sanitize" else ""), RuntimeWarning, stacklevel=2)
        if self.policy == "sanitize":
            if isinstance(x, (tuple, list)):
                return type(x)(torch.nan_to_num(t) if isinstance(t, Tensor) else t for t in x)
            return torch.nan_to_num(x)
        return x
