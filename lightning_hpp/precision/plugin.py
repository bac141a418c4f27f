"""HPPPrecision: every stage in its own precision, with boundary casts, loss scaling and clipping.

Per stage (``StageSpec.precision``, else the Trainer's ``precision``):

=============  ===========  ==============  =============  =========================
precision      parameters   compute         wire dtype     loss scaling
=============  ===========  ==============  =============  =========================
32-true        float32      float32         float32        -
16-mixed       float32      autocast fp16   float16        dynamic
bf16-mixed     float32      autocast bf16   bfloat16       -
16-true        float16      float16         float16        dynamic
bf16-true      bfloat16     bfloat16        bfloat16       -
fp8            float32      fp8 (TE/emul.)  float32        -
=============  ===========  ==============  =============  =========================

The wire dtype is what a stage sends to the next one; it is fixed before the first step (torch
pipelining freezes it then) and written into ``stage_plan.json``. The receiving stage casts to its
own compute dtype inside its forward; gradients flow back in the producer's dtype. The last stage
hands the loss float32 outputs.

One optimizer-step decision covers every rank: gradients are unscaled, checked for inf/NaN, and
the flag is all-reduced over the world, so an overflow in any stage of any replica skips the step
everywhere and backs the scale off.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from lightning_hpp.errors import NonFiniteError, PlanError
from lightning_hpp.planning.plan import normalize_precision
from lightning_hpp.precision import fp8


@dataclass(frozen=True)
class Mode:
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    wire_dtype: torch.dtype
    scaled: bool


MODES: dict[str, Mode] = {
    "32-true": Mode(torch.float32, None, torch.float32, False),
    "16-mixed": Mode(torch.float32, torch.float16, torch.float16, True),
    "bf16-mixed": Mode(torch.float32, torch.bfloat16, torch.bfloat16, False),
    "16-true": Mode(torch.float16, None, torch.float16, True),
    "bf16-true": Mode(torch.bfloat16, None, torch.bfloat16, False),
    "fp8": Mode(torch.float32, None, torch.float32, False),
}

NONFINITE_POLICIES = ("raise", "warn", "sanitize")
CLIP_MODES = ("per-stage", "global")


class DynamicLossScaler:
    """Dynamic loss scaling (the same rule as ``torch.amp.GradScaler``), as plain state."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])


class HPPPrecision(Precision):
    """Lightning precision plugin for heterogeneous pipelines (installed by :class:`HPPStrategy`).

    Args:
        default: Precision of stages whose spec leaves it unset (default: the Trainer's ``precision``).
        clip: ``"per-stage"`` (each stage clips its own norm with its ``clip_norm``, default the
            Trainer's ``gradient_clip_val``) or ``"global"`` (one norm over all stages).
        fp8_backend: ``"te"`` (Transformer Engine, compute capability >= 8.9) or ``"emulate"``.
        fp8_recipe: ``"delayed"`` or ``"current"`` scaling.
        nonfinite: What a NaN/Inf at a stage boundary does: ``"raise"``, ``"warn"`` or
            ``"sanitize"`` (``nan_to_num`` after the stage's compute, before the next stage).
        init_scale: Initial loss scale when a stage runs in fp16.
    """

    def __init__(
        self,
        default: str | None = None,
        clip: Literal["per-stage", "global"] = "per-stage",
        fp8_backend: Literal["te", "emulate"] | None = None,
        fp8_recipe: Literal["delayed", "current"] = "delayed",
        nonfinite: Literal["raise", "warn", "sanitize"] = "raise",
        init_scale: float = 2.0**16,
    ) -> None:
        if clip not in CLIP_MODES:
            raise PlanError(f"`clip={clip!r}` is not supported; use one of {CLIP_MODES}.")
        if nonfinite not in NONFINITE_POLICIES:
            raise PlanError(f"`nonfinite={nonfinite!r}` is not supported; use one of {NONFINITE_POLICIES}.")
        if fp8_backend not in (None, "te", "emulate"):
            raise PlanError(f"`fp8_backend={fp8_backend!r}` is not supported; use 'te', 'emulate' or None.")
        self.default = normalize_precision(default, "`HPPPrecision(default=...)`")
        self.clip = clip
        self.fp8_backend = fp8_backend
        self.fp8_recipe = fp8_recipe
        self.nonfinite = nonfinite
        self.scaler = DynamicLossScaler(init_scale)
        self.precision = "hpp"
        self.skipped_steps = 0
        self.last_grad_norms: dict[int, float] = {}
        self._strategy: Any = None
        self._stage_precision: list[str] = []
        self._scaled = False

    # ------------------------------------------------------------------ setup
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self._scaled else 1.0

    def stage_precisions(self, plan: Any, trainer_precision: str | None) -> list[str]:
        default = self.default or normalize_precision(trainer_precision or "32-true", "`Trainer(precision=...)`")
        if default not in MODES:
            raise PlanError(f"Trainer precision {default!r} cannot be a stage default; use one of {tuple(MODES)}.")
        return [s.precision or default for s in plan.stages]

    def configure_stages(self, strategy: Any, plan: Any, trainer_precision: str | None, stage_modules: dict[int, Any], device: torch.device, device_kind: str) -> None:
        """Set dtypes, casts, autocast/fp8 contexts and boundary guards of this rank's stages.

        Called on every rank after the cut and before the optimizers are built.
        """


        self._strategy = strategy
        precs = self.stage_precisions(plan, trainer_precision)
        self._stage_precision = precs
        self._scaled = any(MODES[p].scaled for p in precs)
        last = len(precs) - 1
        labels: list[str] = []
        for k, p in enumerate(precs):
            if p == "fp8":
                backend = fp8.check_fp8_stage(k, device, device_kind, self.fp8_backend)
                labels.append(fp8.describe_backend(backend, self.fp8_recipe, device.type))
            else:
                labels.append(p)
        for k, sm in stage_modules.items():
            mode = MODES[precs[k]]
            if precs[k] == "fp8":
                backend = fp8.check_fp8_stage(k, device, device_kind, self.fp8_backend)
                fp8.convert_module_to_fp8(sm, backend, self.fp8_recipe)
                group = strategy.dp_group if backend == "te" else None
                sm.context = _fp8_context(backend, self.fp8_recipe, group)
            elif mode.autocast_dtype is not None:
                sm.context = _autocast(device.type, mode.autocast_dtype)
            if mode.param_dtype != torch.float32:
                sm.to(mode.param_dtype)
            sm.input_dtype = mode.param_dtype
            sm.output_dtype = torch.float32 if k == last else mode.wire_dtype
            sm.output_hooks.append(self._boundary_guard)
        plan.meta["precision"] = labels
        plan.meta["boundary_dtypes"] = [str(MODES[p].wire_dtype).replace("torch.", "") for p in precs[:-1]]
        if self._scaled:
            plan.meta["loss_scaling"] = "dynamic (fp16 stages present)"

    # ------------------------------------------------------------------ non-finite guard
    def _boundary_guard(self, stage: int, x: Any) -> Any:
        step = self._step()
        mb = self._strategy.runner.current_microbatch(stage) if self._strategy is not None else -1
        tensors = x if isinstance(x, (tuple, list)) else (x,)
        if any(not bool(torch.isfinite(t).all()) for t in tensors if isinstance(t, Tensor) and t.is_floating_point()):
            x = self._on_nonfinite(x, f"forward activation leaving stage {stage} (micro-batch {mb}, step {step})")
        for t in (x if isinstance(x, (tuple, list)) else (x,)):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(lambda g, stage=stage, mb=mb, step=step: self._grad_guard(g, stage, mb, step))
        return x

    def _grad_guard(self, grad: Tensor, stage: int, mb: int, step: int) -> Tensor | None:
        if self._scaled:  # overflowing fp16 gradients are the loss scaler's business
            return None
        if not bool(torch.isfinite(grad).all()):
            return self._on_nonfinite(grad, f"gradient arriving at stage {stage} from stage {stage + 1} (micro-batch {mb}, step {step})")
        return None

    def _on_nonfinite(self, x: Any, where: str) -> Any:
        msg = f"NaN/Inf in the {where}."
        if self.nonfinite == "raise":
            raise NonFiniteError(
                msg + " Lower the learning rate, check the inputs, or use `HPPStrategy(nonfinite='warn')` / "
                "`'sanitize'` to continue (sanitize replaces NaN/Inf with finite values)."
            )
        warnings.warn(msg + (" Replaced with finite values (nonfinite='sanitize')." if self.nonfinite == "sanitize" else ""), RuntimeWarning, stacklevel=2)
        if self.nonfinite == "sanitize":
            if isinstance(x, (tuple, list)):
                return type(x)(torch.nan_to_num(t) if isinstance(t, Tensor) else t for t in x)
            return torch.nan_to_num(x)
        return x

    def _step(self) -> int:
        try:
            return int(self._strategy.lightning_module.trainer.global_step)
        except Exception:  # noqa: BLE001 - outside a Trainer the step is unknown
            return -1

    # ------------------------------------------------------------------ Lightning hooks
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        found_inf = self._unscale_and_check()
        if found_inf:
            for p in self._params():
                p.grad = None
            self.scaler.update(True)
            self.skipped_steps += 1
            model.log("precision/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)
            model.log("precision/loss_scale", float(self.scaler.scale), on_step=True, on_epoch=False)
            return closure_result
        self._after_closure(model, optimizer)
        out = optimizer.step(**kwargs)
        if self._scaled:
            self.scaler.update(False)
            model.log("precision/loss_scale", float(self.scaler.scale), on_step=True, on_epoch=False)
        return out

    def _params(self) -> list[Tensor]:
        return self._strategy.runner.parameters() if self._strategy is not None and self._strategy.runner is not None else []

    def _unscale_and_check(self) -> bool:
        """Unscale fp16-scaled gradients and decide, on every rank together, whether to skip the step.

        Only plans with fp16 stages need the decision (an overflow is expected there now and then);
        without them non-finite values are caught by the boundary guard instead.
        """
        if not self._scaled:
            return False
        grads = [p.grad for p in self._params() if p.grad is not None]
        bad = torch.zeros(1)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
            norms = torch._foreach_norm(grads)
            bad = (~torch.isfinite(torch.stack(norms).float())).any().float().reshape(1).cpu()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item() > 0)

    def _clip_gradients(self, model: Any, optimizer: Any, clip_val: float | None = None, gradient_clip_algorithm: Any = None) -> None:
        strategy = self._strategy
        if strategy is None or strategy.runner is None or not getattr(model, "automatic_optimization", True):
            return
        algorithm = str(gradient_clip_algorithm or "norm").lower().replace("gradclipalgorithmtype.", "")
        plan = strategy.plan
        num = plan.num_stages
        per_stage = {k: [p.grad for p in sm.parameters() if p.grad is not None] for k, sm in strategy.runner.stage_modules.items()}
        norms = torch.zeros(num, dtype=torch.float64)
        for k, grads in per_stage.items():
            if grads:
                norms[k] = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double()))
        if strategy.mesh is not None and strategy.mesh.pp > 1:
            dist.all_reduce(norms, group=strategy.mesh.pp_group)  # each stage's entry comes from one rank
        if algorithm == "value":
            for k, grads in per_stage.items():
                limit = plan.stages[k].clip_norm or clip_val
                if limit and grads:
                    torch._foreach_clamp_min_(grads, -limit)
                    torch._foreach_clamp_max_(grads, limit)
        elif self.clip == "global":
            total = math.sqrt(float((norms**2).sum()))
            if clip_val and total > clip_val:
                coef = clip_val / (total + 1e-6)
                for grads in per_stage.values():
                    if grads:
                        torch._foreach_mul_(grads, coef)
        else:
            for k, grads in per_stage.items():
                limit = plan.stages[k].clip_norm or clip_val
                if limit and grads and float(norms[k]) > limit:
                    torch._foreach_mul_(grads, limit / (float(norms[k]) + 1e-6))
        self.last_grad_norms = {k: float(v) for k, v in enumerate(norms)}
        for k, v in self.last_grad_norms.items():
            model.log(f"grad_norm/stage_{k}", v, on_step=True, on_epoch=False)
        if num > 1:
            model.log("grad_norm/spread", float(norms.std()), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
            self.skipped_steps = int(state_dict.get("skipped_steps", 0))


def _autocast(device_type: str, dtype: torch.dtype) -> Callable[[], contextlib.AbstractContextManager]:
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


def _fp8_context(backend: str, recipe: str, group: Any) -> Callable[[], contextlib.AbstractContextManager]:


    return lambda: fp8.fp8_autocast_context(backend, recipe, group=group)
