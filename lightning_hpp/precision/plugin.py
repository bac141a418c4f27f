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
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn

from lightning_hpp._dist import group_device, initialized
from lightning_hpp.errors import PlanError
from lightning_hpp.planning.plan import normalize_precision
from lightning_hpp.precision import fp8, fp8_verdict
from lightning_hpp.precision.clipping import (
    StageOptimizer,
    algorithm_name,
    clip_stages,
    overrides_clipping,
    pipeline_sq_norms,
    stage_grads,
    stage_norm,
)
from lightning_hpp.precision.fp8_emulation import EmulatedFP8Mode
from lightning_hpp.precision.fp8_recipe import SCALINGS
from lightning_hpp.precision.guards import BoundaryGuard
from lightning_hpp.precision.modes import CLIP_MODES, MODES, NONFINITE_POLICIES
from lightning_hpp.precision.scaler import DynamicLossScaler
from lightning_hpp.validation import check_choice, check_number


@dataclass
class StageView:
    """What the plugin needs to know about this rank's part of the pipeline, handed over at setup.

    Attributes:
        stages: This rank's stage modules, by stage index.
        eval_stages: Their counterparts for forward-only passes (the traced frontend captures eval mode
            separately); default ``stages``.
        pp_group: The pipeline group (stage norms are summed over it); ``None`` when pp is 1.
        dp_group: The data-parallel group of this rank's stages (Transformer Engine's amax reduction).
        shard_group: The ranks this rank's stages are sharded over (FSDP2), ``None`` for unsharded stages: a
            stage's gradient norm is then the square root of its shards' squared norms summed over it.
        microbatch: The index of the micro-batch a held stage is computing, ``stage -> index``.
        step: The optimizer step being run.
        step_checks: The runner's per-step checks (:class:`~lightning_hpp.pipeline.runner.StepCheck`); the
            boundary guard joins them, so its flags are decided once per step on every rank.
        repeated_names: For each held stage, the parameters (by the LightningModule's names) an earlier stage
            holds too: tied weights, counted once in the pipeline's gradient norm.
        named_parameters: The LightningModule's parameters by name (read at first use, after the casts).
        rank: This process's global rank.
        stage_ranks: The global ranks holding each stage (every replica): an fp8 stage's verdict is taken for
            their devices (:mod:`~lightning_hpp.precision.fp8_verdict`); empty: this rank holds every stage.
        recompute: Whether each stage recomputes its activations in the backward (activation checkpointing).
    """

    stages: dict[int, nn.Module]
    eval_stages: dict[int, nn.Module] | None = None
    pp_group: Any = None
    dp_group: Any = None
    shard_group: Any = None
    microbatch: Callable[[int], int] = lambda stage: -1
    step: Callable[[], int] = lambda: -1
    step_checks: list[Any] = field(default_factory=list)
    repeated_names: dict[int, set[str]] = field(default_factory=dict)
    named_parameters: Callable[[], dict[str, Tensor]] = dict
    rank: int = 0
    stage_ranks: dict[int, list[int]] = field(default_factory=dict)
    recompute: list[bool] = field(default_factory=list)

    @functools.cached_property
    def params(self) -> list[Tensor]:
        """The stages' parameters, each once (taken at first use: after fp8 conversion and dtype casts)."""
        seen: dict[int, Tensor] = {}
        for _, sm in sorted(self.stages.items()):
            for p in sm.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    @functools.cached_property
    def stage_params(self) -> dict[int, list[Tensor]]:
        """Each held stage's parameters (taken at first use, like :attr:`params`)."""
        return {k: list(sm.parameters()) for k, sm in self.stages.items()}

    @functools.cached_property
    def repeated_params(self) -> dict[int, list[Tensor]]:
        """Each held stage's copies of parameters an earlier stage holds too (taken at first use)."""
        if not any(self.repeated_names.values()):
            return {}
        named = self.named_parameters()
        return {k: [named[n] for n in sorted(names) if n in named] for k, names in self.repeated_names.items()}


class HPPPrecision(Precision):
    """Lightning precision plugin for heterogeneous pipelines.

    :class:`~lightning_hpp.HPPStrategy` installs one with these defaults; to change them pass your
    own, as ``Trainer(plugins=[HPPPrecision(...)])`` or ``HPPStrategy(precision_plugin=HPPPrecision(...))``.

    Args:
        default: Precision of stages whose spec leaves it unset (default: the Trainer's ``precision``;
            giving both, different, is an error).
        clip: What the Trainer's ``gradient_clip_val`` limits: ``"global"`` (default, Lightning's
            meaning: the one norm over every stage's parameters) or ``"per-stage"`` (each stage's own
            norm, for stages without a ``clip_norm``). A stage's ``clip_norm`` in the plan always clips
            that stage's own norm (first, under ``"global"``).
        fp8_backend: ``"te"`` (Transformer Engine, compute capability >= 8.9) or ``"emulate"``.
        fp8_recipe: ``"delayed"`` or ``"current"`` scaling.
        nonfinite: What a NaN/Inf at a stage boundary does: ``"raise"``, ``"warn"`` or
            ``"sanitize"`` (``nan_to_num`` after the stage's compute, before the next stage).
        init_scale: Initial loss scale when a stage runs in fp16.
        log_grad_norms: Take and log ``grad_norm/stage_{k}`` every step even when nothing clips (with
            clipping on, the norms are needed and always logged).
    """

    def __init__(
        self,
        default: str | None = None,
        clip: Literal["global", "per-stage"] = "global",
        fp8_backend: Literal["te", "emulate"] | None = None,
        fp8_recipe: Literal["delayed", "current"] = "delayed",
        nonfinite: Literal["raise", "warn", "sanitize"] = "raise",
        init_scale: float = 2.0**16,
        log_grad_norms: bool = False,
    ) -> None:
        check_choice(clip, "HPPPrecision(clip=...)", CLIP_MODES, error=PlanError)
        check_choice(nonfinite, "HPPPrecision(nonfinite=...)", NONFINITE_POLICIES, error=PlanError)
        check_choice(fp8_backend, "HPPPrecision(fp8_backend=...)", ("te", "emulate"), optional=True, error=PlanError)
        check_choice(fp8_recipe, "HPPPrecision(fp8_recipe=...)", SCALINGS, error=PlanError)
        check_number(init_scale, "HPPPrecision(init_scale=...)", error=PlanError,
                     hint="It is the first fp16 loss scale, e.g. `init_scale=65536.0`.")
        self.default = normalize_precision(default, "`HPPPrecision(default=...)`")
        self.clip = clip
        self.fp8_backend = fp8_backend
        self.fp8_recipe = fp8_recipe
        self.nonfinite = nonfinite
        self.scaler = DynamicLossScaler(init_scale)
        self.log_grad_norms = bool(log_grad_norms)
        self.precision = "hpp"
        self.skipped_steps = 0
        self._grad_norms: Tensor | None = None
        self._repeated_sq: Tensor | None = None
        self._view: StageView | None = None
        self._fp8_emulations: tuple[EmulatedFP8Mode, ...] = ()
        self._plan: Any = None
        self._stage_precision: list[str] = []
        self._scaled = False

    # ------------------------------------------------------------------ setup
    @property
    def last_grad_norms(self) -> dict[int, float]:
        """The last step's gradient norm per stage (after the dp reduction, before clipping)."""
        return {} if self._grad_norms is None else dict(enumerate(self._grad_norms.tolist()))

    @property
    def fp8_emulations(self) -> tuple[EmulatedFP8Mode, ...]:
        """The fp8 emulations of this rank's traced fp8 stages: their amax histories live there, outside the modules."""
        return self._fp8_emulations

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self._scaled else 1.0

    def stage_precisions(self, plan: Any, trainer_precision: str | None) -> list[str]:
        default = self.default or normalize_precision(trainer_precision or "32-true", "`Trainer(precision=...)`")
        if default not in MODES:
            raise PlanError(f"Trainer precision {default!r} cannot be a stage default; use one of {tuple(MODES)}.")
        return [s.precision or default for s in plan.stages]

    def configure_stages(
        self, plan: Any, view: StageView, trainer_precision: str | None, device: torch.device, device_kind: str
    ) -> None:
        """Set dtypes, casts, autocast/fp8 contexts and boundary guards of this rank's stages.

        Called on every rank after the cut and before the optimizers are built.
        """
        self._view, self._plan = view, plan
        precs = self.stage_precisions(plan, trainer_precision)
        self._stage_precision = precs
        self._scaled = any(MODES[p].scaled for p in precs)
        last = len(precs) - 1
        guard = BoundaryGuard(self.nonfinite, view.microbatch, view.step, self._scaled, last_stage=last)
        view.step_checks.append(guard)
        captured = any(getattr(sm, "captured", False) for sm in view.stages.values())  # one frontend for all stages
        verdicts = self._fp8_verdicts(precs, view, device, device_kind)  # every fp8 stage, the same on every rank
        for k, v in verdicts.items():
            if v.backend == "te" and captured:
                raise PlanError(
                    f"Stage {k} runs in fp8 through Transformer Engine, which replaces `nn.Linear` modules, but the "
                    f"traced frontend runs stage {k} as a captured graph. Use `HPPPrecision(fp8_backend='emulate')` "
                    f"(fp8 numerics, not fp8 speed), precision='bf16-mixed' for stage {k}, or cut it between "
                    f"top-level modules so that the sequential frontend runs it as written."
                )
        labels = [verdicts[k].label if k in verdicts else p for k, p in enumerate(precs)]
        held = [
            *view.stages.items(),
            *((k, sm) for k, sm in (view.eval_stages or {}).items() if sm is not view.stages.get(k)),
        ]
        emulations: dict[int, EmulatedFP8Mode] = {}  # one per stage: its train and eval graphs share amaxes
        for k, sm in held:
            mode = MODES[precs[k]]
            if precs[k] == "fp8" and getattr(sm, "captured", False):
                emulation = emulations.setdefault(k, EmulatedFP8Mode(self.fp8_recipe))
                emulation.adopt(sm.parameters())
                sm.context = lambda emulation=emulation: emulation
            elif precs[k] == "fp8":
                backend = verdicts[k].run_as
                fp8.convert_module_to_fp8(sm, backend, self.fp8_recipe)
                sm.context = _fp8_context(backend, self.fp8_recipe, view.dp_group if backend == "te" else None)
            elif mode.autocast_dtype is not None:
                sm.context = _autocast(device.type, mode.autocast_dtype)
            if mode.param_dtype != torch.float32:
                sm.to(mode.param_dtype)
            sm.input_dtype = mode.param_dtype
            sm.output_dtype = torch.float32 if k == last else mode.wire_dtype
            sm.output_hooks.append(guard)
            sm.grad_hooks.append(guard.before_backward)
        self._fp8_emulations = tuple(emulations.values())
        plan.meta["precision"] = labels
        plan.meta["boundary_dtypes"] = [str(MODES[p].wire_dtype).replace("torch.", "") for p in precs[:-1]]
        if self._scaled:
            plan.meta["loss_scaling"] = "dynamic (fp16 stages present)"

    def _fp8_verdicts(
        self, precs: list[str], view: StageView, device: torch.device, device_kind: str
    ) -> dict[int, fp8_verdict.Verdict]:
        """Each fp8 stage's backend, decided for the devices of the ranks that hold it (collective over the world
        where Transformer Engine is asked for: every rank reports its device's capabilities)."""
        stages = [k for k, p in enumerate(precs) if p == "fp8"]
        if not stages:
            return {}
        ranks = view.stage_ranks or {k: [view.rank] for k in stages}
        caps = [] if self.fp8_backend == "emulate" else fp8_verdict.gather_capabilities(view.rank, device_kind, device)
        return fp8_verdict.decide(stages, ranks, caps, self.fp8_backend, self.fp8_recipe, view.recompute, device.type)

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
        return self._view.params if self._view is not None else []

    def _unscale_and_check(self) -> bool:
        """Unscale fp16-scaled gradients and decide, on every rank together, whether to skip the step.

        Only plans with fp16 stages need the decision (an overflow is expected there now and then);
        without them non-finite values are caught by the boundary guard instead.
        """
        if not self._scaled:
            return False
        grads = stage_grads(self._params())  # a sharded parameter's local shard: each rank checks its own
        bad = torch.zeros(1)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
            norms = torch._foreach_norm(grads)
            bad = (~torch.isfinite(torch.stack(norms).float())).any().float().reshape(1)
        if initialized():  # one decision over the whole world: every stage of every replica
            bad = bad.to(group_device())
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item() > 0)

    def _clip_gradients(
        self, model: Any, optimizer: Any, clip_val: float | None = None, gradient_clip_algorithm: Any = None
    ) -> None:
        """Clip per stage (or globally), or hand each stage to the module's own ``configure_gradient_clipping``."""
        view, plan = self._view, self._plan
        if view is None or not getattr(model, "automatic_optimization", True):
            return
        num = plan.num_stages
        custom = overrides_clipping(model)
        if not (custom or clip_val or any(s.clip_norm for s in plan.stages) or self.log_grad_norms):
            self._grad_norms = norms = None  # nothing clips and nobody asked for the norms: no pass over the gradients
        else:
            per_stage = {k: stage_grads(ps) for k, ps in view.stage_params.items()}
            norms, self._repeated_sq = self._stage_norms(per_stage, num, view)
            self._grad_norms = norms
        # the hook, as Lightning calls it every step (its default clips with the Trainer's value through
        # clip_gradients below), once per stage this rank holds
        for k in sorted(view.stage_params):
            stage_opt = StageOptimizer(optimizer, k, view.stage_params[k], plan.stages[k].clip_norm)
            self._call_clipping_hook(model, stage_opt, clip_val, gradient_clip_algorithm)
        if norms is None:
            return
        for k in range(num):
            model.log(f"grad_norm/stage_{k}", norms[k].float(), on_step=True, on_epoch=False)
        if num > 1:
            model.log("grad_norm/spread", norms.std().float(), on_step=True, on_epoch=False)

    @staticmethod
    def _call_clipping_hook(model: Any, stage_opt: StageOptimizer, clip_val: Any, algorithm: Any) -> None:
        """``model.configure_gradient_clipping(stage_opt, ...)`` as Lightning calls its hooks (its name set for
        ``self.log``, under the Trainer's profiler)."""
        previous = model._current_fx_name
        model._current_fx_name = "configure_gradient_clipping"
        try:
            with model.trainer.profiler.profile(f"[LightningModule]{type(model).__name__}.configure_gradient_clipping"):
                model.configure_gradient_clipping(
                    stage_opt, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm
                )
        finally:
            model._current_fx_name = previous

    @staticmethod
    def _stage_norms(per_stage: dict[int, list[Tensor]], num: int, view: StageView) -> tuple[Tensor, Tensor]:
        """``[norm of stage k's gradients]`` for every stage, and ``[squared norm of stage k's copies of tied
        weights an earlier stage holds]``, on every rank (one all-reduce over the pipeline group)."""
        pp_group = view.pp_group
        reduce = pp_group is not None and dist.get_world_size(pp_group) > 1
        held = next((gs[0].device for gs in per_stage.values() if gs), torch.device("cpu"))
        # every gradient with its shards (FSDP2, tensor parallel), then over the pipeline
        return pipeline_sq_norms(
            view.stage_params, view.repeated_params, num, pp_group, group_device(pp_group) if reduce else held
        )

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        """What ``LightningModule.clip_gradients`` calls (from a ``configure_gradient_clipping`` override).

        With a :class:`~lightning_hpp.precision.clipping.StageOptimizer` it clips that stage, else every
        stage of this rank. A stage with ``clip_norm`` in the plan clips at it; ``clip_val`` limits, with
        ``clip="global"``, the pipeline's norm taken before the hook ran (no collective here, so a hook that
        clips only on some steps cannot leave a rank waiting), with ``clip="per-stage"`` each other stage's own.
        """
        view, plan = self._view, self._plan
        if view is None:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        stages = [optimizer.stage] if isinstance(optimizer, StageOptimizer) else sorted(view.stage_params)
        limits = {k: s.clip_norm for k, s in enumerate(plan.stages)}
        if not clip_val and all(limits[k] is None for k in stages):
            return  # nothing clips these stages (Lightning's default hook with no gradient_clip_val)
        per_stage = {k: stage_grads(view.stage_params[k]) for k in stages}
        if self.clip == "global":
            if self._grad_norms is None:
                raise PlanError(
                    "`clip_gradients` with `HPPPrecision(clip='global')` scales by the whole pipeline's gradient norm, "
                    "which is taken only before `configure_gradient_clipping`; call it from that hook."
                )
            norms: Any = self._grad_norms
            repeated = self._repeated_sq
        else:
            repeated = None
            norms = {k: stage_norm(view.stage_params[k]) for k in per_stage}
        clip_stages(per_stage, norms, limits, algorithm_name(gradient_clip_algorithm), self.clip, clip_val, repeated)

    def state_dict(self) -> dict[str, Any]:
        """The fp16 loss scaler's state where a stage scales its loss; empty otherwise, so that a checkpoint holds
        what one process's holds (Lightning saves a precision plugin's state under its name only when there is any)."""
        if not self._scaled and not self.skipped_steps:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
            self.skipped_steps = int(state_dict.get("skipped_steps", 0))


def _autocast(device_type: str, dtype: torch.dtype) -> Callable[[], contextlib.AbstractContextManager]:
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


def _fp8_context(backend: str, recipe: str, group: Any) -> Callable[[], contextlib.AbstractContextManager]:
    return lambda: fp8.fp8_autocast_context(backend, recipe, group=group)
