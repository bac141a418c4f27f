"""HPPStrategy: the Lightning strategy that wires Lightning's hooks to the pipeline layers.

It holds no pipeline logic of its own; each hook hands over to the layer that owns the concern:

* ``_configure_launcher`` / ``setup_environment``: :mod:`lightning_hpp.launch` (processes, the
  process group) and :mod:`lightning_hpp.bias` (determinism, the guard callback);
* ``setup``: :mod:`lightning_hpp.model` (units, the sequential check, keeping only this rank's
  stages), :mod:`lightning_hpp.planning` (the plan, ``plan="auto"``, device kinds),
  :mod:`lightning_hpp.pipeline` (mesh, stages, runner), :class:`~lightning_hpp.HPPPrecision`;
* ``training_step`` → ``backward``: one schedule step; :class:`~lightning_hpp.pipeline.grads.GradHandover`
  keeps its gradients apart from Lightning's ``zero_grad`` and hands them over (dp all-reduce) in
  ``backward``;
* ``validation_step`` / ``test_step`` / ``predict_step``: forward-only schedules;
* checkpoints: :mod:`lightning_hpp.checkpoint` (sharded save/load, resume resolution, mid-epoch
  skipping).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.seed import isolate_rng
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_hpp import _dist
from lightning_hpp.bias.determinism import determinism_seed, enable_determinism, ensure_hash_seed
from lightning_hpp.bias.guard import BiasGuard
from lightning_hpp.bias.samplers import pin_wrapped_generator
from lightning_hpp.checkpoint import resume as _resume
from lightning_hpp.checkpoint.lightning_state import load_lightning_checkpoint, save_lightning_checkpoint
from lightning_hpp.errors import CheckpointError, PlanError, ScheduleError
from lightning_hpp.launch import Launcher, init_process_group
from lightning_hpp.model.frontend import FRONTENDS, balanced_plan, cut_model, planning_units
from lightning_hpp.model.materialize import fake_parameters, has_meta_parameters, init_on_meta, materialize_stages
from lightning_hpp.model.units import find_units
from lightning_hpp.options import (
    BiasOptions,
    CheckpointOptions,
    InitOptions,
    PlacementOptions,
    TelemetryOptions,
    moved_option_hint,
    section,
)
from lightning_hpp.pipeline.data import (
    can_rebatch,
    first_loader,
    peek_batch,
    rebatch,
    resume_mid_epoch,
    seed_workers_per_replica,
    shard_over_replicas,
)
from lightning_hpp.pipeline.grads import GradHandover, shared_gradient_groups
from lightning_hpp.pipeline.mesh import Mesh, stages_of_position
from lightning_hpp.pipeline.microbatch import batch_size_of, split_batch
from lightning_hpp.pipeline.runner import PipelineRunner
from lightning_hpp.pipeline.schedules import SCHEDULES, check_schedule
from lightning_hpp.pipeline.stage import StageModule
from lightning_hpp.pipeline.steps import capture_input, count_forward_calls, second_call_error
from lightning_hpp.planning.placement import auto_plan, gather_kinds, kind_grid, loss_probe
from lightning_hpp.planning.plan import PLAN_FILENAME, StagePlan
from lightning_hpp.precision.plugin import HPPPrecision, StageView
from lightning_hpp.redaction import redact_loggers


class HPPStrategy(ParallelStrategy):
    """Pipeline-parallel (× data-parallel) training of an unchanged LightningModule.

    Args:
        plan: ``None`` (the ``@stage`` decorators), a :class:`StagePlan`, the path of a
            ``stage_plan.json``, or ``"auto"`` (profile the units and the step's overheads on the ranks'
            devices and search the whole plan: pp × dp, pp = 1 included, micro-batches, gpipe or 1f1b,
            cuts, kinds and precisions; ``schedule``, ``n_microbatches`` and ``pp_degree``, when given,
            are constraints of the search; the global batch stays the DataLoader's batch times
            ``world_size / pp_degree`` (1 without ``pp_degree``), split between replicas as needed).
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
        checkpoint: :class:`~lightning_hpp.options.CheckpointOptions` (or a dict of its fields): the
            strategy's own ``step-<N>`` checkpoints and where to resume from.
        bias: :class:`~lightning_hpp.options.BiasOptions`: the coded-bias audit, fingerprints, determinism.
        telemetry: :class:`~lightning_hpp.options.TelemetryOptions`, ``True`` (its defaults) or ``None``.
        placement: :class:`~lightning_hpp.options.PlacementOptions`: device kinds, ``plan="auto"`` profile.
        init: :class:`~lightning_hpp.options.InitOptions`: initial weights of a model built on the meta
            device (``configure_model()``, ``Trainer.init_module(empty_init=True)``), materialized per rank.
        timeout: Timeout of every collective and pipeline send/recv (a ``timedelta`` or seconds); a
            rank that stops answering ends the job after at most this long.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default by device.
        precision_plugin: An :class:`~lightning_hpp.HPPPrecision` (precision options live there);
            default one is installed with the Trainer's ``precision`` as the stages' default.
    """

    strategy_name = "hpp"

    def __init__(
        self,
        plan: StagePlan | str | os.PathLike | None = None,
        schedule: str | None = None,
        n_microbatches: int | None = None,
        pp_degree: int | None = None,
        frontend: str = "auto",
        activation_checkpointing: bool = False,
        *,
        checkpoint: CheckpointOptions | dict | None = None,
        bias: BiasOptions | dict | None = None,
        telemetry: TelemetryOptions | dict | bool | None = None,
        placement: PlacementOptions | dict | None = None,
        init: InitOptions | dict | None = None,
        timeout: timedelta | float = timedelta(minutes=5),
        process_group_backend: str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: HPPPrecision | None = None,
        **moved: Any,
    ) -> None:
        if moved:
            name = next(iter(moved))
            raise PlanError(f"`HPPStrategy` got an unexpected keyword argument {name!r}.{moved_option_hint(name)}")
        if precision_plugin is not None and not isinstance(precision_plugin, HPPPrecision):
            raise PlanError(f"`HPPStrategy(precision_plugin=...)` must be an `HPPPrecision`, got {type(precision_plugin).__name__}.")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        if schedule is not None and (not isinstance(schedule, str) or schedule not in SCHEDULES):
            raise ScheduleError(f"`HPPStrategy(schedule={schedule!r})` is unknown. Valid schedules: {', '.join(SCHEDULES)}.")
        if n_microbatches is not None and (not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1):
            raise PlanError(f"`HPPStrategy(n_microbatches={n_microbatches!r})`: must be a positive integer.")
        if pp_degree is not None and (not isinstance(pp_degree, int) or isinstance(pp_degree, bool) or pp_degree < 1):
            raise PlanError(f"`HPPStrategy(pp_degree={pp_degree!r})`: must be a positive integer or None.")
        if isinstance(plan, (str, os.PathLike)) and plan != "auto":
            plan = StagePlan.load(os.fspath(plan))
        if plan is not None and plan != "auto" and not isinstance(plan, StagePlan):
            raise PlanError(f"`HPPStrategy(plan=...)` must be None (use `@stage` decorators), a `StagePlan`, a path to a "
                            f"stage_plan.json or 'auto'; got {type(plan).__name__}.")
        if frontend not in FRONTENDS:
            raise PlanError(f"`HPPStrategy(frontend={frontend!r})` is not supported; use one of {', '.join(map(repr, FRONTENDS))}.")
        self._frontend = frontend
        if not isinstance(activation_checkpointing, bool):
            raise PlanError(f"`HPPStrategy(activation_checkpointing={activation_checkpointing!r})`: must be True or False.")
        self._activation_checkpointing = activation_checkpointing
        self._timeout = _timeout(timeout)
        if process_group_backend is not None and process_group_backend not in _BACKENDS:
            raise PlanError(f"`HPPStrategy(process_group_backend={process_group_backend!r})` is not a torch.distributed "
                            f"backend; use one of {', '.join(map(repr, _BACKENDS))} or None (gloo on CPU, nccl on CUDA).")
        self._checkpoint = section(CheckpointOptions, checkpoint, "checkpoint")
        self._bias = section(BiasOptions, bias, "bias")
        self._telemetry = None if telemetry in (None, False) else section(TelemetryOptions, None if telemetry is True else telemetry, "telemetry")
        self._placement = section(PlacementOptions, placement, "placement")
        self._init = section(InitOptions, init, "init")
        self._guard = BiasGuard(fingerprint=self._bias.fingerprint, audit=self._bias.audit)
        self._active_guard: BiasGuard | None = None
        self._deterministic = self._bias.deterministic
        if self._deterministic:
            ensure_hash_seed(self._seed())  # before Lightning launches the other ranks
        self._plan_arg = plan
        self._schedule_arg, self._m_arg = schedule, n_microbatches
        self._schedule = schedule or "1f1b"
        self._n_microbatches = n_microbatches or 4
        self._split = 1  # plan="auto" with more replicas than loader batches: each loader batch is this much smaller
        self._pp_arg = pp_degree
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._plan: StagePlan | None = None
        self._mesh: Mesh | None = None
        self._runner: PipelineRunner | None = None
        self._grads: GradHandover | None = None
        self._stage_ids: list[int] = []
        self._step_stats: dict[str, Any] = {}
        self._resumed_from: str | None = None
        self._pending_rng: dict | None = None
        self._resume_batches = 0
        self._resume_epoch = 0
        self._fit_request: Any = None
        self._preloaded: _resume.Chosen | None = None
        self._run_id: str | None = None

    # ------------------------------------------------------------------ read-only state
    @property
    def plan(self) -> StagePlan | None:
        """The resolved plan (unit names expanded), once set up."""
        return self._plan

    @property
    def mesh(self) -> Mesh | None:
        return self._mesh

    @property
    def runner(self) -> PipelineRunner | None:
        return self._runner

    @property
    def stage_ids(self) -> list[int]:
        """The stages this rank holds."""
        return list(self._stage_ids)

    @property
    def schedule(self) -> str:
        return self._schedule

    @property
    def n_microbatches(self) -> int:
        return self._n_microbatches

    @property
    def dp_group(self) -> Any:
        return self._mesh.dp_group if self._mesh else None

    @property
    def dp_size(self) -> int:
        return self._mesh.dp if self._mesh else 1

    @property
    def dp_rank(self) -> int:
        return self._mesh.replica if self._mesh else 0

    @property
    def step_stats(self) -> dict[str, Any]:
        """The last training step's ``{"loss": float, "local_grad_norms": {stage: norm before the dp all-reduce}}``
        (what ``BiasMonitor`` compares across replicas; the local norms are taken only when one is among the
        Trainer's callbacks). Read on the host when asked, not every step."""
        return {k: (float(v) if k == "loss" else {s: float(n) for s, n in v.items()}) for k, v in self._step_stats.items()}

    def _wants_local_norms(self) -> bool:
        from lightning_hpp.bias.monitor import BiasMonitor

        return any(isinstance(cb, BiasMonitor) for cb in self.lightning_module.trainer.callbacks)

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this run resumed from (never deleted by retention or top-k cleanup)."""
        return self._resumed_from

    # ------------------------------------------------------------------ process topology
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:  # read by Lightning to inject distributed samplers
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # shard over replicas only: every stage of one pipeline must see the same batch
        pp = self._pp_degree()
        replica = self._mesh.replica if self._mesh is not None else self.global_rank % (self.world_size // pp)
        return {"num_replicas": self.world_size // pp, "rank": replica}

    def _pp_degree(self) -> int:
        if self._pp_arg is not None:
            return self._pp_arg
        plan = self._plan or (self._plan_arg if isinstance(self._plan_arg, StagePlan) else None)
        if plan is None and self._plan_arg is None and self.lightning_module is not None:
            try:
                plan = StagePlan.from_decorators(find_units(self.lightning_module))
            except PlanError:
                plan = None
        if plan is None:
            return self.world_size
        return plan.num_stages // 2 if SCHEDULES[self._schedule].multi else plan.num_stages

    def _seed(self) -> int:
        return self._bias.seed if self._bias.seed is not None else determinism_seed()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Trainer(deterministic=True) has set torch's flag by now, before any rank is launched
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            self._deterministic = True
        if self._deterministic:
            ensure_hash_seed(self._seed())
        self._launcher = Launcher(self._resolve_fit_ckpt, self.cluster_environment, self.num_processes, self.num_nodes)

    def _resolve_fit_ckpt(self, trainer: Any, ckpt_path: Any) -> Any:
        dirs = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
        self._fit_request = _resume.resolve_ckpt_path(ckpt_path, resume=self._checkpoint.resume, checkpoint_dir=self._checkpoint.dir,
                                                      callback_dirs=dirs)
        return self._fit_request  # a PendingResume is decided by all ranks together at the end of setup

    @override
    def setup_environment(self) -> None:
        redact_loggers(self.lightning_module.trainer.loggers)  # before any hook can log hyperparameters
        if self._deterministic:
            enable_determinism(self._seed())
        if self._bias.fingerprint != "off" or self._bias.audit != "off":
            self._active_guard = self._guard.attach(self.lightning_module.trainer)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        init_process_group(self.cluster_environment, self._process_group_backend, self._timeout, self.root_device, self.world_size)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``Trainer.init_module(empty_init=True)`` builds the model on the meta device (each rank
        materializes only its stages at setup); otherwise as every strategy does."""
        if empty_init:
            with init_on_meta():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @override
    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """``configure_model()`` builds the model on the meta device."""
        with init_on_meta():
            yield

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup: plan, check, cut
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self._check_inputs(trainer)
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._runner is None or self._runner.module is not module:
            self._prepare(trainer, module)
        self._add_callbacks(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        log_dir = trainer.log_dir or trainer.default_root_dir  # collective: every rank asks
        if self.is_global_zero and log_dir is not None:
            meta = dict(schedule=self._schedule, n_microbatches=self._n_microbatches, pp_degree=self._mesh.pp, dp_degree=self._mesh.dp)
            self._plan.save(f"{str(log_dir).rstrip('/')}/{PLAN_FILENAME}", **meta)
        if trainer.state.fn == TrainerFn.FITTING:
            self._preloaded, self._run_id = _resume.begin_fit(self._fit_request, checkpoint_dir=self._checkpoint.dir,
                                                              new_run=self._checkpoint.new_run, load=self._load_sharded)

    def _check_inputs(self, trainer: Any) -> None:
        """Combinations of inputs that would otherwise be silently ignored."""
        if self._checkpoint_io is not None and type(self._checkpoint_io) is not TorchCheckpointIO:  # Lightning's default
            raise PlanError(f"HPPStrategy writes sharded checkpoints itself; the CheckpointIO plugin {type(self._checkpoint_io).__name__} "
                            f"would not be used. Remove it from `Trainer(plugins=...)`.")
        if self._checkpoint.dir is not None and trainer.state.fn == TrainerFn.FITTING and not trainer.checkpoint_callbacks:
            raise PlanError(f"`HPPStrategy(checkpoint=CheckpointOptions(dir={self._checkpoint.dir!r}))` saves checkpoints, but "
                            f"`Trainer(enable_checkpointing=False)` turns checkpointing off. Drop one of the two.")
        if trainer.state.fn == TrainerFn.FITTING and not self.lightning_module.automatic_optimization:
            raise PlanError(
                f"`{type(self.lightning_module).__name__}.automatic_optimization = False` cannot run under HPPStrategy: "
                f"the pipeline schedule runs every micro-batch's forward and backward itself, so `manual_backward` and "
                f"`optimizer.step()` inside `training_step` would act on nothing. Keep automatic optimization (return "
                f"the loss from `training_step`) and put custom clipping in `configure_gradient_clipping` (called per "
                f"stage), accumulation in `Trainer(accumulate_grad_batches=...)`, schedules in `configure_optimizers`."
            )
        flag = trainer._accelerator_connector._precision_flag
        if isinstance(self.precision_plugin, HPPPrecision) and self.precision_plugin.default not in (None, flag) and flag != "32-true":
            raise PlanError(f"`Trainer(precision={flag!r})` and `HPPPrecision(default={self.precision_plugin.default!r})` disagree on "
                            f"the stages' default precision. Set it in one place.")

    def _add_callbacks(self, trainer: Any) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._checkpoint.dir is not None and not any(
            isinstance(cb, ModelCheckpoint) and cb.dirpath and _resume.same_location(cb.dirpath, self._checkpoint.dir)
            for cb in trainer.callbacks
        ):
            trainer.callbacks.append(_resume.step_checkpoint_callback(self._checkpoint.dir, self._checkpoint.every_n_steps))
        auto = self._plan_arg == "auto" and fitting
        if self._telemetry is None and not auto:
            return
        from lightning_hpp.planning.report import PlacementReport
        from lightning_hpp.telemetry.callback import PipelineTelemetry

        has_telemetry = any(isinstance(cb, PipelineTelemetry) for cb in trainer.callbacks)
        only_for_report = self._telemetry is None and not has_telemetry
        if not has_telemetry:
            opts = self._telemetry or TelemetryOptions(every_n_steps=5)
            trainer.callbacks.append(PipelineTelemetry(every_n_steps=opts.every_n_steps, trace_step=opts.trace_step, trace_dir=opts.trace_dir))
        if auto and not any(isinstance(cb, PlacementReport) for cb in trainer.callbacks):
            trainer.callbacks.append(PlacementReport(stop_telemetry=only_for_report))

    def _prepare(self, trainer: Any, module: Any) -> None:
        """Resolve the plan, cut the model, build the groups and keep only this rank's stages."""
        if isinstance(self.precision_plugin, HPPPrecision):
            trainer_precision = trainer._accelerator_connector._precision_flag
        else:
            trainer_precision = str(self.precision_plugin.precision)
            self.precision_plugin = HPPPrecision()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._pp_arg is not None and self._pp_arg > self.world_size:
            raise PlanError(f"`HPPStrategy(pp_degree={self._pp_arg})` needs at least {self._pp_arg} processes, one per pipeline "
                            f"position, but the job has {self.world_size}. Lower `pp_degree`, or start more processes "
                            f"(`Trainer(devices=..., num_nodes=...)`).")
        self._placement.check_world(self.world_size)
        rank_kinds = gather_kinds(self.root_device, self.global_rank, self._placement.device_map)
        with fake_parameters(module, self.root_device) if has_meta_parameters(module) else contextlib.nullcontext():
            auto = self._plan_arg == "auto"
            example = self._example_call(trainer, module, parts=(self._m_arg or 1) if auto else None)
            plan, grid = self._initial_plan(trainer, module, example, rank_kinds)
            if auto and example is not None:  # the cut sees one micro-batch of the chosen size
                example = self._example_call(trainer, module)
            cut = cut_model(module, plan, example, frontend=self._frontend, modes=("train", "eval") if fitting else ("eval",))
        self._plan = cut.plan
        pp = self._pp_degree()
        if self._plan.num_stages > self.world_size * (2 if SCHEDULES[self._schedule].multi else 1) or pp > self.world_size:
            raise PlanError(
                f"The plan has {self._plan.num_stages} stages (pp_degree={pp}) but the job has {self.world_size} processes. "
                f"Use at least {pp} processes (`Trainer(devices=..., num_nodes=...)`), or a plan with fewer stages."
            )
        check_schedule(self._schedule, self._plan.num_stages, pp, self._n_microbatches)
        style = SCHEDULES[self._schedule].style
        positions = [stages_of_position(r, pp, self._plan.num_stages, style) for r in range(pp)]
        if grid is None:
            grid = kind_grid(self._plan, positions, rank_kinds, pp, self.world_size // pp)
        self._mesh = Mesh.build(self.world_size, pp, self.global_rank, grid=grid)
        self._plan.meta["device_kinds"] = rank_kinds
        self._mesh.init_groups()
        self._stage_ids = positions[self._mesh.position]
        cut.keep_only(module, self._stage_ids)
        if has_meta_parameters(module):
            self._materialize(module, cut)
        shared = shared_gradient_groups(cut.shared, dict(module.named_parameters()), positions, self._mesh)
        names = self._plan.stages
        traced = cut.frontend == "traced"
        recompute = [self._activation_checkpointing if s.activation_checkpointing is None else s.activation_checkpointing
                     for s in names]
        stages = {mode: {k: StageModule(names[k].modules, cut.bodies[mode][k], k, spread=cut.spread[k], captured=traced,
                                        checkpoint_activations=recompute[k])
                         for k in self._stage_ids} for mode in ("train", "eval")}
        if cut.frontend == "sequential":
            stages["eval"] = stages["train"]
        self.model_to_device()
        for body in (b for mode in ("train", "eval") for k in self._stage_ids for b in cut.bodies[mode][k]):
            if hasattr(body, "place"):  # traced stages: ops that create tensors do so on this rank's device
                body.place(self.root_device)
        runner = PipelineRunner(module, stages["train"], self._plan.num_stages, self._mesh, self._schedule,
                                self._n_microbatches, self.root_device, eval_stage_modules=stages["eval"],
                                flatten=cut.flatten, unflatten=cut.unflatten)
        view = StageView(stages["train"], eval_stages=stages["eval"], pp_group=self._mesh.pp_group if pp > 1 else None,
                         dp_group=self._mesh.dp_group, microbatch=runner.current_microbatch, step=lambda: int(trainer.global_step),
                         step_checks=runner.step_checks)
        self.precision_plugin.configure_stages(self._plan, view, trainer_precision, self.root_device, rank_kinds[self.global_rank])
        self._runner = runner
        self._grads = GradHandover(stages["train"], self._mesh.dp_group, self._mesh.dp, shared=shared)
        runner.last_backward_window = self._grads.last_backward
        rank_zero_info(
            f"HPPStrategy: {self._plan.num_stages} stages, frontend={cut.frontend} ({cut.reason}), schedule={self._schedule}, "
            f"n_microbatches={self._n_microbatches}, pp={pp} × dp={self._mesh.dp}"
            + (f", shared parameters {sorted(cut.shared)}" if cut.shared else "") + f"\n{self._plan.table()}"
        )

    def _initial_plan(self, trainer: Any, module: Any, example: tuple | None, rank_kinds: list[str]) -> tuple[StagePlan, Any]:
        """The plan before the cut: ``plan="auto"``, the user's plan, the ``@stage`` decorators, or balanced."""
        if self._plan_arg == "auto":
            return self._auto_plan(trainer, module, example, rank_kinds)
        if self._plan_arg is not None:
            return self._plan_arg, None
        try:
            decorated = StagePlan.from_decorators(find_units(module))
        except PlanError:
            decorated = None
        if decorated is not None:
            return decorated, None
        n = (self._pp_arg or self.world_size) * (2 if SCHEDULES[self._schedule].multi else 1)
        plan = balanced_plan(module, n)
        rank_zero_info(f"HPPStrategy: no plan given; {plan.meta['balanced']}: cut at {plan.meta['cut_points']}.")
        return plan, None

    def _materialize(self, module: Any, cut: Any) -> None:
        """This rank's stages out of the meta device: their own initializers, or their tensors read from disk."""
        seed = self._init.seed if self._init.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        bodies = [b for mode in ("train", "eval") for k in self._stage_ids for b in cut.bodies[mode][k]]
        n = materialize_stages(module, bodies, self.root_device, seed=seed, weights=self._init.weights, rename=self._init.rename)
        rank_zero_info(f"HPPStrategy: rank {self.global_rank} materialized its {n} parameters "
                       f"({'read from ' + self._init.weights if self._init.weights else 'their modules initializers'}).")

    def _peek(self, trainer: Any, module: Any) -> tuple[Any, Any]:
        """``(step_fn, batch)``: the step of the running stage and one loader batch where the model is, RNG untouched."""
        loop = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
                TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}[trainer.state.fn]
        step_fn = {TrainerFn.FITTING: module.training_step, TrainerFn.VALIDATING: module.validation_step,
                   TrainerFn.TESTING: module.test_step, TrainerFn.PREDICTING: module.predict_step}[trainer.state.fn]
        with isolate_rng():
            batch = peek_batch(first_loader(loop._data_source.dataloader())) if loop._data_source.is_defined() else None
        # the checks run the whole model, which stays where it is until it is cut (a meta model's stand-ins
        # are on this rank's device)
        home = next((p.device for p in module.parameters()), self.root_device)
        return step_fn, None if batch is None else move_data_to_device(batch, home)

    def _example_call(self, trainer: Any, module: Any, parts: int | None = None) -> tuple[tuple, dict] | None:
        """``(args, kwargs)`` of the step's ``self(...)`` call on one real micro-batch (the loader batch in
        ``parts``, default: the replicas sharing it times the micro-batches), RNG untouched."""
        step_fn, batch = self._peek(trainer, module)
        if batch is None:
            return None
        with isolate_rng():
            try:
                batch = split_batch(batch, parts or self._split * self._n_microbatches)[0]
            except PlanError:
                pass  # an indivisible batch is reported by the first step, with its size
            if count_forward_calls(module, step_fn, batch, 0) > 1:
                raise second_call_error(step_fn.__name__)
            return capture_input(module, step_fn, batch, 0)

    def _auto_plan(self, trainer: Any, module: Any, example: tuple | None, rank_kinds: list[str]) -> tuple[StagePlan, list[list[int]]]:
        if example is None:
            raise PlanError("plan='auto' profiles the model on one real micro-batch, but the dataloader gave no batch.")
        if self._schedule_arg not in (None, "gpipe", "1f1b"):
            raise PlanError(f"plan='auto' plans 'gpipe' and '1f1b' schedules; got schedule={self._schedule_arg!r}. Leave "
                            f"`schedule` unset to let it choose, or write the stage plan for {self._schedule_arg!r} by hand.")
        if has_meta_parameters(module) and self._placement.profile is None:
            raise PlanError("plan='auto' measures the model, but it was built on the meta device (no weights yet). Pass a "
                            "cost profile (`HPPStrategy(placement=PlacementOptions(profile=...))`, see "
                            "`python -m lightning_hpp.planning.cli`), or a plan (`StagePlan.split_at([...])`).")
        units, inputs, to_cut = planning_units(module, example)
        step_fn, batch = self._peek(trainer, module)
        loop = trainer.fit_loop if trainer.state.fn == TrainerFn.FITTING else None
        loader = first_loader(loop._data_source.dataloader()) if loop is not None else None
        groups = self.world_size // self._pp_arg if self._pp_arg else 1  # the global batch of the unsearched plan
        probe = loss_probe(module, step_fn, batch, units, inputs, self.root_device)
        plan, grid, table, chosen = auto_plan(
            units, inputs, self.global_rank, rank_kinds, batch_size=batch_size_of(batch), device=self.root_device,
            data_groups=groups, pp_degree=self._pp_arg, schedule=self._schedule_arg, n_microbatches=self._m_arg,
            loss_probe=probe, profile_path=self._placement.profile, split_batches=can_rebatch(loader))
        self._pp_arg, self._schedule, self._n_microbatches = chosen.pp_degree, chosen.schedule, chosen.n_microbatches
        self._split = chosen.dp_degree // groups
        rank_zero_info(f"HPPStrategy: plan='auto' chose\n{table}")
        return to_cut(plan), grid

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._runner is not None and self._grads is not None
        trainer = self.lightning_module.trainer
        scale = self.precision_plugin.loss_scale / trainer.accumulate_grad_batches
        # Lightning zeroes the gradients after the first training_step of each accumulation window
        window_start = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        with self._grads.during_step(keep_held=not window_start, local_norms=self._wants_local_norms()):
            loss, logs = self._runner.train_step(self.lightning_module.training_step, *args, loss_scale=scale, **kwargs)
        self._replay(logs)
        self._step_stats = {"loss": loss.detach()}
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward: the schedule already ran it, so hand over the held gradients."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        norms = self._grads.hand_over(local_norms=self._wants_local_norms())
        if norms is not None:
            self._step_stats["local_grad_norms"] = norms
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("predict_step", *args, **kwargs)

    def _eval(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        assert self._runner is not None
        output, logs = self._runner.eval_step(getattr(self.lightning_module, hook), *args, **kwargs)
        self._replay(logs)
        return output

    def _replay(self, logs: Any) -> None:
        """Log on this rank what the last stage logged (so rank 0's loggers and callbacks see it)."""
        module = self.lightning_module
        for (name, kw), value in zip(logs.schema, logs.values.unbind(0)):
            module.log(name, value, **kw)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        if self._mesh is not None:
            if self._deterministic or int(os.environ.get("PL_SEED_WORKERS", 0)):
                seed_workers_per_replica(dataloader, self._seed(), self._mesh.replica)
            shard_over_replicas(dataloader, self._mesh.dp, self._mesh.replica)
            pin_wrapped_generator(dataloader, self._seed())  # every stage draws the same sequence every epoch
            rebatch(dataloader, self._split)
        if self._resume_batches and self.lightning_module.trainer.training:  # before its iterator (and workers) exist
            resume_mid_epoch(dataloader, self._resume_batches, self._resume_epoch)
            self._resume_batches = 0
        return dataloader

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _dist.initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return _dist.broadcast_object(obj, src, group=_group.WORLD)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints (sharded)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model must be cut and the optimizers built before a checkpoint knows what to load

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.lightning_module.state_dict()  # this rank's stages only: every rank writes its own part

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write one sharded checkpoint directory at ``filepath`` (collective: every rank calls it)."""
        if storage_options is not None:
            raise CheckpointError(f"`storage_options={storage_options!r}` is not used by HPPStrategy: S3 settings come from the "
                                  f"environment (AWS_* variables). Remove it from the `save_checkpoint` call.")
        assert self._mesh is not None and self._plan is not None
        metrics = {k: float(v) for k, v in self.lightning_module.trainer.callback_metrics.items()
                   if isinstance(v, Tensor) and v.numel() == 1}
        extra = {"plan": self._plan.to_dict(), "metrics": metrics, "hyper_parameters": checkpoint.get("hyper_parameters"), "run_id": self._run_id,
                 "fingerprint": self._active_guard.checkpoint_metadata() if self._active_guard is not None else None}
        opts = self._checkpoint
        save_lightning_checkpoint(checkpoint, str(filepath), self.lightning_module, self.optimizers, global_rank=self.global_rank,
                                  position=self._mesh.position, replica=self._mesh.replica, extra=extra, step_dir=opts.dir,
                                  keep_last=opts.keep_last, async_save=opts.async_save, on_error=opts.on_error,
                                  protect=[self._resumed_from] if self._resumed_from else [])

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        from lightning_hpp.checkpoint.sharded import wait_for_pending_save
        from lightning_hpp.checkpoint.store import _same_location, delete_checkpoint

        if not self.is_global_zero:
            return
        if self._resumed_from is not None and _same_location(str(filepath), self._resumed_from):
            rank_zero_info(f"HPPStrategy: keeping {str(filepath)!r}, the checkpoint this run resumed from.")
            return
        wait_for_pending_save()
        delete_checkpoint(str(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load this rank's part of a sharded checkpoint, whatever layout saved it (collective)."""
        chosen, self._preloaded = self._preloaded, None
        if chosen is None or not isinstance(checkpoint_path, _resume.PendingResume):  # an explicit path: verified here
            chosen = _resume.select_and_load(str(checkpoint_path), self._load_sharded)
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                self._run_id = _resume.continue_run(chosen, checkpoint_dir=self._checkpoint.dir, new_run=self._checkpoint.new_run)
        checkpoint = chosen.loaded
        self._pending_rng = checkpoint.pop("hpp_rng", None)
        self._resumed_from = chosen.url
        self._resume_batches = _resume.consumed_batches(checkpoint)
        self._resume_epoch = int(checkpoint.get("epoch", 0) or 0)
        return checkpoint

    def _load_sharded(self, url: str) -> dict[str, Any]:
        return load_lightning_checkpoint(url, self.lightning_module, self.optimizers, global_rank=self.global_rank,
                                         position=self._mesh.position if self._mesh else 0)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def on_train_start(self) -> None:
        from lightning_hpp.checkpoint.lightning_state import set_rng_state

        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    @override
    def teardown(self) -> None:
        from lightning_hpp.checkpoint.sharded import wait_for_pending_save

        wait_for_pending_save()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Heterogeneous pipeline parallelism (lightning_hpp)")


_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _timeout(value: Any) -> timedelta:
    if isinstance(value, timedelta) and value.total_seconds() > 0:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return timedelta(seconds=float(value))
    raise PlanError(f"`HPPStrategy(timeout={value!r})`: use a positive number of seconds or a `datetime.timedelta`, "
                    f"e.g. `timeout=600`.")


if "hpp" not in StrategyRegistry:
    HPPStrategy.register_strategies(StrategyRegistry)

