"""The NaN/Inf guard at every stage boundary: forward activations leaving a stage and gradients
arriving at it, named by stage, micro-batch and step.

The check stays on the device while the schedule runs (one flag per boundary crossing, no host
sync per micro-batch); the pipeline runner reduces the flags of every rank once per step and the
guard then raises, warns or reports on every rank alike.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_hpp.errors import NonFiniteError


class BoundaryGuard:
    """Installed as an output hook of every stage (``StageModule.output_hooks``: the activations leaving it),
    as a gradient hook (``StageModule.grad_hooks``: the gradients arriving at it, checked by the pipeline stage
    before its backward) and as a step check of the runner (:class:`~lightning_hpp.pipeline.runner.StepCheck`).

    Args:
        policy: ``"raise"``, ``"warn"`` or ``"sanitize"`` (``nan_to_num`` before the next stage).
        microbatch: The micro-batch a held stage is computing (``stage -> index``).
        step: The optimizer step being run.
        scaled: fp16 loss scaling is on; overflowing gradients are then the scaler's business.
        last_stage: The pipeline's last stage: its output goes to the user's loss, not to another stage, so
            the gradient coming back into it crosses no boundary and is not checked (a NaN there reaches
            the previous stage's boundary, where it is).
    """

    def __init__(self, policy: str, microbatch: Callable[[int], int], step: Callable[[], int], scaled: bool,
                 last_stage: int | None = None) -> None:
        self.policy = policy
        self._last_stage = last_stage
        self._microbatch = microbatch
        self._step = step
        self._scaled = scaled
        self._events: list[tuple[tuple, int, int]] = []  # (where, first and past-last index into _ends)
        self._ends: list[Tensor] = []  # min and max of every checked tensor of the step
        self._now: int | None = None  # the step being checked (read at its first crossing)

    # ------------------------------------------------------------------ during the schedule
    def __call__(self, stage: int, x: Any) -> Any:
        """The activations ``x`` leaving ``stage`` (an output hook). In a training forward they are checked before
        the stage's backward of the micro-batch instead (:meth:`before_backward`, from the output the stage keeps
        for it), within the same step: one call per micro-batch and stage instead of two. ``"sanitize"`` replaces
        them here, before they are sent."""
        if self.policy != "sanitize" and torch.is_grad_enabled():
            return x
        self._check_forward(stage, self._microbatch(stage), x)
        return _sanitize(x) if self.policy == "sanitize" else x

    def _check_forward(self, stage: int, microbatch: int, x: Any) -> None:
        tensors = x if isinstance(x, (tuple, list)) else (x,)
        checked = [t for t in tensors if isinstance(t, Tensor) and t.is_floating_point()]
        if checked:
            self._record(("forward", stage, microbatch, self._current_step()), checked)

    def before_backward(
        self, stage: int, microbatch: int, output: Any, grads: tuple[Tensor | None, ...] | None
    ) -> None:
        """Before ``stage``'s backward of ``microbatch`` (a gradient hook): the activations that left the stage in
        its forward (``output``; checked there already under ``"sanitize"``), and the gradients arriving at them
        from the next stage (``"sanitize"`` replaces non-finite values in place). The last stage's gradients come
        from the user's loss, not from another stage, and are not checked (a NaN there reaches the previous
        stage's boundary, where it is); with fp16 loss scaling, overflowing gradients are the scaler's business."""
        if self.policy != "sanitize":
            self._check_forward(stage, microbatch, output)
        if self._scaled or stage == self._last_stage:
            return
        checked = [g for g in grads if isinstance(g, Tensor) and g.is_floating_point()]
        if not checked:
            return
        self._record(("gradient", stage, microbatch, self._current_step()), checked)
        if self.policy == "sanitize":
            for g in checked:
                torch.nan_to_num_(g)

    def _current_step(self) -> int:
        if self._now is None:  # the step is the same for every crossing of it: asked once
            self._now = self._step()
        return self._now

    def _record(self, where: tuple, tensors: list[Tensor]) -> None:
        # min and max carry any NaN (both) or Inf (one of them): one reduction per tensor, no full-size mask;
        # what they say is looked at once per step (flag), and per crossing only when something was found
        start = len(self._ends)
        for t in tensors:
            if t.numel():
                self._ends.extend(torch.aminmax(t.detach()))
        if len(self._ends) > start:
            self._events.append((where, start, len(self._ends)))

    # ------------------------------------------------------------------ once per step
    def reset(self) -> None:
        self._events, self._ends, self._now = [], [], None

    def flag(self) -> Tensor:
        """1.0 where a boundary on this rank saw a NaN/Inf in this step, else 0.0 (on the device)."""
        if not self._ends:
            return torch.zeros(())
        return (~torch.isfinite(torch.stack(self._ends)).all()).float()

    def resolve(self, flags: list[float]) -> None:
        """Raise, or warn, for what any pipeline position flagged (``flags[position]``, max over replicas)."""
        if not any(flags):
            self.reset()
            return
        mine = [
            _describe(where)
            for where, lo, hi in self._events
            if not bool(torch.isfinite(torch.stack(self._ends[lo:hi])).all())
        ]
        self.reset()
        if mine:
            more = f" (and {len(mine) - 1} more boundary crossings in this step)" if len(mine) > 1 else ""
            msg = f"NaN/Inf in the {mine[0]}{more}."
        else:
            positions = [p for p, f in enumerate(flags) if f]
            msg = (
                f"NaN/Inf at a stage boundary on pipeline position(s) {positions} (in this or another replica) in "
                f"step {self._step()}; the rank that holds it names the stage and micro-batch."
            )
        if self.policy == "raise":
            raise NonFiniteError(
                msg + " Lower the learning rate, check the inputs, or use `HPPPrecision(nonfinite='warn')` / "
                "`'sanitize'` to continue (sanitize replaces NaN/Inf with finite values)."
            )
        if mine:
            suffix = " Replaced with finite values (nonfinite='sanitize')." if self.policy == "sanitize" else ""
            warnings.warn(msg + suffix, RuntimeWarning, stacklevel=2)


def _describe(where: tuple) -> str:
    kind, stage, mb, step = where
    if kind == "forward":
        return f"forward activation leaving stage {stage} (micro-batch {mb}, step {step})"
    return f"gradient arriving at stage {stage} from stage {stage + 1} (micro-batch {mb}, step {step})"


def _sanitize(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(torch.nan_to_num(t) if isinstance(t, Tensor) and t.is_floating_point() else t for t in x)
    return torch.nan_to_num(x) if isinstance(x, Tensor) and x.is_floating_point() else x
