"""The pipeline's own options as the user gave them, and the plan they resolve to.

:class:`PipelineSpec` holds ``HPPStrategy``'s flat pipeline arguments, validated when it is built and
never overwritten; :class:`ResolvedPlan` is what they come to on a running job, once: the plan
before the cut, its schedule, micro-batches, pipeline degree and (for ``plan="auto"``) rank grid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_hpp.errors import PlanError, ScheduleError
from lightning_hpp.model.frontend import FRONTENDS
from lightning_hpp.model.units import find_units
from lightning_hpp.options import ShardingOptions
from lightning_hpp.pipeline.compile import compile_options
from lightning_hpp.pipeline.dims import ParallelDims
from lightning_hpp.pipeline.schedules import SCHEDULES, ScheduleKind
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.validation import check_bool, check_choice, check_int

DEFAULT_SCHEDULE = "1f1b"
DEFAULT_MICROBATCHES = 4
STEP_REPLAYS = ("auto", "every_rank", "last_stage")


@dataclass(frozen=True)
class PipelineSpec:
    """``HPPStrategy``'s pipeline arguments, validated when built (a path of a plan is loaded here).

    Args:
        plan: ``None`` (the ``@stage`` decorators, else a cut balanced by parameter count), a
            :class:`StagePlan`, the path of a ``stage_plan.json``, or ``"auto"`` (profile the units and the step's
            overheads on the ranks' devices and search the whole plan: pp × dp_replicate × dp_shard × tp, pp = 1
            included, micro-batches, every schedule, cuts, kinds and precisions; ``schedule``, ``n_microbatches``
            and ``pp_degree``, when given, are constraints of the search, and so is a given ``ShardingOptions``; the
            global batch stays the DataLoader's batch times its replicas before setup (1 without ``pp_degree``),
            split between replicas as needed).
        schedule: One of ``gpipe``, ``1f1b``, ``interleaved1f1b``, ``looped_bfs``,
            ``interleaved_zb``, ``zbv``, ``dualpipev``. Default ``1f1b`` (searched under ``plan="auto"``).
        n_microbatches: Micro-batches per training batch (the batch size must be divisible by it).
            Default 4 (searched under ``plan="auto"``).
        pp_degree: Pipeline positions per replica. Default: the number of stages for one-stage-per-rank
            schedules, half of it for the multi-stage ones. ``world_size / pp_degree`` replicas train
            data-parallel.
        frontend: How the model is cut: ``"sequential"`` (the user's modules run as written; cuts between
            the top-level units of a chain forward), ``"traced"`` (``torch.export`` captures the model,
            cuts at modules of any depth) or ``"auto"`` (sequential where it applies, else traced).
        activation_checkpointing: Recompute each unit's activations in the backward instead of keeping
            them (per stage: ``StageSpec(activation_checkpointing=...)`` overrides this default).
        loss_weight: How a training step's micro-batch losses combine: ``None`` (default) counts them equally
            (the step's loss is the mean of the micro-batches' losses, one process's for a loss averaged over
            samples); a function ``batch -> number of units`` the step's loss averages over in that batch (tokens:
            ``lambda batch: (batch["labels"] != -100).sum()``) weighs them by it, so that a loss averaged over
            the batch's tokens is the mean over the whole (global) batch's tokens, as one process computes it
            (:mod:`lightning_hpp.pipeline.loss`).
        step_replay: Which of the user's steps every rank of a pipeline runs with the last stage's outputs, so that
            what a step records on the module (outputs appended to a list, a counter, a torchmetrics update) is
            there for the hooks every rank runs: ``"auto"`` (default: the steps that change the module's state when
            the setup runs each once on one micro-batch), ``"every_rank"`` (all of them) or ``"last_stage"`` (none;
            the other ranks then hold no state the steps record).
        compile: ``torch.compile`` each block of the model's block list in its stage (after tensor parallel, before
            FSDP2, as torchtitan does): ``True`` (torch.compile's defaults) or a dict of its keyword arguments
            (``{"backend": "inductor", "mode": "max-autotune"}``); ``False``: only the modules the user compiled in
            place (``nn.Module.compile()``) run compiled (:mod:`lightning_hpp.pipeline.compile`).
    """

    plan: Any = None
    schedule: str | None = None
    n_microbatches: int | None = None
    pp_degree: int | None = None
    frontend: str = "auto"
    activation_checkpointing: bool = False
    loss_weight: Any = None
    step_replay: str = "auto"
    compile: Any = False

    def __post_init__(self) -> None:
        if self.schedule is not None and (not isinstance(self.schedule, str) or self.schedule not in SCHEDULES):
            raise ScheduleError(
                f"`HPPStrategy(schedule={self.schedule!r})` is unknown. Valid schedules: {', '.join(SCHEDULES)}."
            )
        check_int(self.n_microbatches, "HPPStrategy(n_microbatches=...)", optional=True)
        check_int(self.pp_degree, "HPPStrategy(pp_degree=...)", optional=True)
        check_choice(self.frontend, "HPPStrategy(frontend=...)", FRONTENDS)
        check_bool(self.activation_checkpointing, "HPPStrategy(activation_checkpointing=...)")
        check_choice(self.step_replay, "HPPStrategy(step_replay=...)", STEP_REPLAYS)
        compile_options(self.compile)
        if self.loss_weight is not None and not callable(self.loss_weight):
            raise PlanError(
                f"`HPPStrategy(loss_weight={self.loss_weight!r})` must be None or a function of a batch "
                f"giving the number of units (tokens) its loss averages over, e.g. "
                f"`lambda batch: (batch['labels'] != -100).sum()`."
            )
        plan = self.plan
        if isinstance(plan, (str, os.PathLike)) and plan != "auto":
            object.__setattr__(self, "plan", StagePlan.load(os.fspath(plan)))
        elif plan is not None and plan != "auto" and not isinstance(plan, StagePlan):
            raise PlanError(
                f"`HPPStrategy(plan=...)` must be None (use `@stage` decorators), a `StagePlan`, a path to a "
                f"stage_plan.json or 'auto'; got {type(plan).__name__}."
            )

    @property
    def auto(self) -> bool:
        return isinstance(self.plan, str) and self.plan == "auto"

    @property
    def kind(self) -> ScheduleKind:
        """The schedule asked for (the default where none is)."""
        return SCHEDULES[self.schedule or DEFAULT_SCHEDULE]

    def decorated_plan(self, module: nn.Module) -> StagePlan | None:
        """The plan of the module's ``@stage`` decorators, when no plan is given and it has any."""
        if self.plan is not None:
            return None
        try:
            return StagePlan.from_decorators(find_units(module))
        except PlanError:
            return None

    def pp_before_setup(self, world_size: int, module: nn.Module | None, tp: int = 1) -> int:
        """The pipeline degree as far as it is known before the plan is resolved: ``pp_degree``, the plan's (or the
        decorators') stages per position, else one position per tensor-parallel group (``world_size / tp``)."""
        if self.pp_degree is not None:
            return self.pp_degree
        plan = self.plan if isinstance(self.plan, StagePlan) else None
        if plan is None and module is not None:
            plan = self.decorated_plan(module)
        if plan is None:
            return max(1, world_size // tp)
        return plan.num_stages // self.kind.stages_per_rank

    def dims_before_setup(
        self, world_size: int, module: nn.Module | None, sharding: ShardingOptions | None
    ) -> ParallelDims:
        """The degrees as far as they are known before the plan is resolved (what Lightning's samplers read
        before setup); one replica where they do not divide the world (setup refuses that, naming the sizes)."""
        sharding = sharding or ShardingOptions()
        try:
            return sharding.dims(world_size, self.pp_before_setup(world_size, module, sharding.tp_degree))
        except PlanError:
            return ParallelDims(pp=max(1, world_size))


@dataclass(frozen=True)
class ResolvedPlan:
    """What the spec resolves to on this job (the same on every rank).

    Attributes:
        plan: The plan to cut with.
        schedule: The schedule's name.
        n_microbatches: Micro-batches per (possibly split) loader batch.
        split: ``plan="auto"`` with more replicas than the loader's batches were made for: each loader
            batch is this much smaller (1 otherwise).
        grid: ``plan="auto"``'s rank grid ``grid[position][replica]`` (``None``: from the stages' kinds).
        pp_degree: The pipeline degree asked for or chosen (``None``: from the plan's stages).
        sharding: The ``ShardingOptions`` ``plan="auto"`` chose where the user gave none (``None``: as given,
            or ddp).
    """

    plan: StagePlan
    schedule: str
    n_microbatches: int
    split: int = 1
    grid: list[list[int]] | None = None
    pp_degree: int | None = None
    sharding: Any = None

    @property
    def kind(self) -> ScheduleKind:
        return SCHEDULES[self.schedule]

    def pp(self, plan: StagePlan) -> int:
        """The pipeline degree for the cut ``plan``."""
        if self.pp_degree is not None:
            return self.pp_degree
        return plan.num_stages // self.kind.stages_per_rank
