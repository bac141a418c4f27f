"""HPPStrategy: the Lightning strategy that wires Lightning's hooks to the pipeline layers.

Order of events on every rank:

* ``setup_environment``: process group (gloo on CPU, NCCL on GPU), like DDP.
* ``setup``: find the units, resolve the plan, check the sequential forward on one real
  micro-batch, build the pp × dp groups, keep only this rank's stages, then optimizers.
* ``training_step``: one pipeline schedule step (forward + backward of every micro-batch). The
  gradients are held aside until Lightning's ``backward`` call, because Lightning zeroes gradients
  between ``training_step`` and ``backward``; ``backward`` averages them over the dp group and adds
  them to the parameters' gradients.
* ``validation_step`` / ``test_step`` / ``predict_step``: forward-only schedules.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import random
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.utils.data import DistributedSampler
from typing_extensions import override

from lightning_hpp.bias.determinism import (
    determinism_seed,
    enable_determinism,
    ensure_hash_seed,
    worker_init_fn,
)
from lightning_hpp.bias.guard import BiasGuard
from lightning_hpp.errors import PlanError
from lightning_hpp.model.sequential import check_sequential_forward
from lightning_hpp.model.units import find_units, replace_unit
from lightning_hpp.pipeline.mesh import Mesh, stages_of_position
from lightning_hpp.pipeline.microbatch import split_batch
from lightning_hpp.pipeline.runner import PipelineRunner
from lightning_hpp.pipeline.schedules import SCHEDULES, check_schedule
from lightning_hpp.pipeline.stage import StageModule
from lightning_hpp.pipeline.steps import capture_input
from lightning_hpp.planning.placement import auto_plan, gather_kinds, kind_grid
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.precision.plugin import HPPPrecision

log = logging.getLogger(__name__)

PLAN_FILENAME = "stage_plan.json"


class _RemoteUnit(nn.Module):
    """Stands in for a unit that lives on another rank."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.unit_name = name
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Unit {self.unit_name!r} belongs to pipeline stage {self.stage}, which runs on another rank; it "
            f"cannot be called here. Under HPPStrategy call `self(...)` only inside the Lightning steps."
        )


class HPPStrategy(ParallelStrategy):
    """Pipeline-parallel (× data-parallel) training of an unchanged LightningModule.

    Args:
        plan: ``None`` (use the ``@stage`` decorators), a :class:`StagePlan`, the path of a
            ``stage_plan.json``, or ``"auto"`` (profile the units on the ranks' device kinds and let
            the exact partitioner choose cuts, kinds and precisions; gpipe and 1f1b).
        schedule: One of ``gpipe``, ``1f1b``, ``interleaved1f1b``, ``looped_bfs``,
            ``interleaved_zb``, ``zbv``, ``dualpipev``.
        n_microbatches: Micro-batches per training batch (the batch size must be divisible by it).
        pp_degree: Pipeline positions per replica. Default: the number of stages for one-stage-per-rank
            schedules, half of it for the multi-stage ones. ``world_size / pp_degree`` replicas train
            data-parallel.
        clip: ``"per-stage"`` (each stage clips its own gradient norm with its ``clip_norm``, default
            the Trainer's ``gradient_clip_val``) or ``"global"`` (one norm over all stages).
        fp8_backend: ``"te"`` (Transformer Engine) or ``"emulate"`` (quantize-dequantize, any device).
        fp8_recipe: ``"delayed"`` or ``"current"`` scaling for fp8 stages.
        nonfinite: NaN/Inf at a stage boundary: ``"raise"``, ``"warn"`` or ``"sanitize"``.
        checkpoint_dir: Where ``step-<N>`` sharded checkpoints go (any fsspec URL, ``s3://`` too).
        resume: ``"auto"`` (newest valid checkpoint in ``checkpoint_dir``, or start fresh) or a path.
        save_every_n_steps: Checkpoint cadence into ``checkpoint_dir`` (default: every epoch).
        keep_last: Keep only the newest ``k`` checkpoints in ``checkpoint_dir`` (never the resumed one).
        async_save: Write checkpoints in the background (at most one in flight).
        save_on_error: A save that fails after retries ``"raise"`` s or ``"warn"`` s and training goes on.
        deterministic: Deterministic algorithms, PYTHONHASHSEED for launched ranks, per-replica worker seeds.
        seed: Seed for ``deterministic`` (default: ``PL_GLOBAL_SEED``).
        audit: Data-loading audit at fit start: ``"warn"``, ``"error"`` or ``"off"``.
        fingerprint: Environment-fingerprint comparison across ranks: ``"warn"``, ``"error"`` or ``"off"``.
        device_map: Override of the ranks' device kinds (``"0:a100,1:h100"``, a dict or a list);
            also ``HPP_DEVICE_KIND`` in the environment. Stages with ``device=`` go to ranks of that kind.
        auto_profile: A cost-profile JSON for ``plan="auto"`` instead of measuring.
        telemetry: ``True`` or a dict of :class:`~lightning_hpp.telemetry.callback.PipelineTelemetry` options:
            per-stage forward/backward/communication/idle times and the measured bubble, logged.
        timeout: Timeout of every collective and pipeline send/recv; a rank that stops answering ends
            the job after at most this long.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default by device.
    """

    strategy_name = "hpp"

    def __init__(
        self,
        plan: StagePlan | str | os.PathLike | None = None,
        schedule: str = "1f1b",
        n_microbatches: int = 4,
        pp_degree: int | None = None,
        clip: Literal["per-stage", "global"] = "per-stage",
        fp8_backend: Literal["te", "emulate"] | None = None,
        fp8_recipe: Literal["delayed", "current"] = "delayed",
        nonfinite: Literal["raise", "warn", "sanitize"] = "raise",
        checkpoint_dir: str | None = None,
        resume: str | None = None,
        save_every_n_steps: int | None = None,
        keep_last: int | None = None,
        async_save: bool = False,
        save_on_error: Literal["raise", "warn"] = "raise",
        deterministic: bool = False,
        seed: int | None = None,
        audit: Literal["warn", "error", "off"] = "warn",
        fingerprint: Literal["warn", "error", "off"] = "warn",
        device_map: Any = None,
        auto_profile: str | None = None,
        telemetry: bool | dict = False,
        timeout: timedelta | float = timedelta(minutes=5),
        process_group_backend: str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if schedule not in SCHEDULES:
            raise PlanError(f"Unknown schedule {schedule!r}. Valid schedules: {', '.join(SCHEDULES)}.")
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
            raise PlanError(f"`n_microbatches` must be a positive integer, got {n_microbatches!r}.")
        if pp_degree is not None and (not isinstance(pp_degree, int) or pp_degree < 1):
            raise PlanError(f"`pp_degree` must be a positive integer or None, got {pp_degree!r}.")
        if isinstance(plan, (str, os.PathLike)) and plan != "auto":
            plan = StagePlan.load(os.fspath(plan))
        if plan is not None and plan != "auto" and not isinstance(plan, StagePlan):
            raise PlanError(
                f"`plan` must be None (use `@stage` decorators), a `StagePlan`, a path to a stage_plan.json or "
                f"'auto'; got {type(plan).__name__}."
            )
        self._device_map = device_map
        self._auto_profile = auto_profile
        self._precision_options = dict(clip=clip, fp8_backend=fp8_backend, fp8_recipe=fp8_recipe, nonfinite=nonfinite)
        HPPPrecision(**self._precision_options)  # validates the options now, before any process starts
        if resume is not None and resume != "auto" and not isinstance(resume, str):
            raise PlanError(f"`resume` must be None, 'auto' or a checkpoint path/URL; got {resume!r}.")
        if resume == "auto" and checkpoint_dir is None:
            raise PlanError("`resume='auto'` needs `checkpoint_dir=...` (where to look for checkpoints).")
        if save_on_error not in ("raise", "warn"):
            raise PlanError(f"`save_on_error={save_on_error!r}` is not supported; use 'raise' or 'warn'.")
        for name, value in (("save_every_n_steps", save_every_n_steps), ("keep_last", keep_last)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PlanError(f"`{name}` must be a positive integer or None, got {value!r}.")
        self._checkpoint_dir = None if checkpoint_dir is None else str(checkpoint_dir)
        self._resume = resume
        self._save_every_n_steps = save_every_n_steps
        self._keep_last = keep_last
        self._async_save = async_save
        self._save_on_error = save_on_error
        self._resumed_from: str | None = None
        self._pending_rng: dict | None = None
        self._resume_batches = 0
        if not isinstance(telemetry, (bool, dict)):
            raise PlanError(f"`telemetry` must be True/False or a dict of PipelineTelemetry options, got {telemetry!r}.")
        self._telemetry = telemetry
        self._deterministic = bool(deterministic)
        self._seed = seed
        self._guard = BiasGuard(fingerprint=fingerprint, audit=audit)  # validates the policies
        self._active_guard: BiasGuard | None = None
        if self._deterministic:
            ensure_hash_seed(self._determinism_seed())  # before Lightning launches the other ranks
        self._plan_arg = plan
        self._schedule = schedule
        self._n_microbatches = n_microbatches
        self._pp_arg = pp_degree
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._plan: StagePlan | None = None
        self._mesh: Mesh | None = None
        self._runner: PipelineRunner | None = None
        self._fresh_grads: list[Tensor | None] | None = None
        self._stage_ids: list[int] = []
        self.step_stats: dict[str, Any] = {}

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

    # ------------------------------------------------------------------ process topology
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning to decide whether dataloaders get a distributed sampler.
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
        # Shard over replicas only: every stage of one pipeline must see the same batch.
        dp = self.world_size // self._pp_degree()
        return {"num_replicas": dp, "rank": self._replica_of(self.global_rank)}

    def _pp_degree(self) -> int:
        if self._pp_arg is not None:
            return self._pp_arg
        n = self._num_stages_hint()
        if n is None:
            return self.world_size
        return n // 2 if SCHEDULES[self._schedule].multi else n

    def _num_stages_hint(self) -> int | None:
        if self._plan is not None:
            return self._plan.num_stages
        if self._plan_arg == "auto":
            return None
        if self._plan_arg is not None:
            return self._plan_arg.num_stages
        if self.lightning_module is not None:
            plan = StagePlan.from_decorators(find_units(self.lightning_module))
            return plan.num_stages if plan is not None else None
        return None

    def _replica_of(self, rank: int) -> int:
        if self._mesh is not None:
            return next(row.index(rank) for row in self._mesh.grid if rank in row)
        pp = self._pp_degree()
        return rank % (self.world_size // pp)

    def _determinism_seed(self) -> int:
        return self._seed if self._seed is not None else determinism_seed()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Trainer(deterministic=True) has set torch's flag by now, before any rank is launched
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            self._deterministic = True
        if self._deterministic:
            ensure_hash_seed(self._determinism_seed())
        self._launcher = _Launcher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        if self._deterministic:
            enable_determinism(self._determinism_seed())
        if self._guard.fingerprint_policy != "off" or self._guard.audit_policy != "off":
            self._active_guard = self._guard.attach(self.lightning_module.trainer)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not dist.is_initialized():
            # torchrun's c10d rendezvous keeps one store across restarts; without a prefix per attempt
            # the restarted ranks read the dead ranks' gloo addresses and fail to connect.
            store = dist.TCPStore(self.cluster_environment.main_address, self.cluster_environment.main_port,
                                  self.world_size, is_master=False, timeout=self._timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            kwargs["store"] = dist.PrefixStore(f"/lightning_hpp/attempt_{attempt}", store)
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        atexit.register(_shutdown)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup: plan, check, cut
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._runner is None or self._runner.module is not module:
            self._prepare(trainer, module)
        self._add_checkpoint_callback(trainer)
        self._add_telemetry_callback(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._write_plan(trainer)

    def _add_checkpoint_callback(self, trainer: Any) -> None:
        """With ``checkpoint_dir``, save ``step-<N>`` checkpoints there (every ``save_every_n_steps``)."""
        if self._checkpoint_dir is None or trainer.state.fn != TrainerFn.FITTING:
            return
        from lightning.pytorch.callbacks import ModelCheckpoint

        if any(isinstance(cb, ModelCheckpoint) and cb.dirpath == self._checkpoint_dir for cb in trainer.callbacks):
            return
        cb = ModelCheckpoint(
            dirpath=self._checkpoint_dir,
            filename="step-{step}",
            auto_insert_metric_name=False,
            every_n_train_steps=self._save_every_n_steps,
            save_top_k=-1,
            save_on_train_epoch_end=self._save_every_n_steps is None,
        )
        cb.FILE_EXTENSION = ""
        trainer.callbacks.append(cb)

    def _add_telemetry_callback(self, trainer: Any) -> None:
        auto = self._plan_arg == "auto" and trainer.state.fn == TrainerFn.FITTING
        if not self._telemetry and not auto:
            return
        from lightning_hpp.planning.report import PlacementReport
        from lightning_hpp.telemetry.callback import PipelineTelemetry

        if not any(isinstance(cb, PipelineTelemetry) for cb in trainer.callbacks):
            options = self._telemetry if isinstance(self._telemetry, dict) else ({} if self._telemetry else {"every_n_steps": 5})
            trainer.callbacks.append(PipelineTelemetry(**options))
        if auto and not any(isinstance(cb, PlacementReport) for cb in trainer.callbacks):
            trainer.callbacks.append(PlacementReport())

    def _install_precision(self, trainer: Any) -> HPPPrecision:
        if not isinstance(self.precision_plugin, HPPPrecision):
            self.precision_plugin = HPPPrecision(**self._precision_options)
        return self.precision_plugin

    def _prepare(self, trainer: Any, module: Any) -> None:
        """Resolve the plan, check the forward, build the groups and keep only this rank's stages."""
        trainer_precision = None if isinstance(self.precision_plugin, HPPPrecision) else str(self.precision_plugin.precision)
        units = find_units(module)
        names = [n for n, _ in units]
        step_fn = _step_for(module, trainer.state.fn)
        args = None
        batch = self._sample_batch(trainer)
        if batch is not None:
            with _preserved_rng():
                mb = self.batch_to_device(_first_microbatch(batch, self._n_microbatches))
                args = capture_input(module, step_fn, mb, 0)
        rank_kinds = gather_kinds(self.root_device, self.global_rank, self._device_map)
        grid = None
        if self._plan_arg == "auto":
            plan, grid = self._auto_plan(units, args, rank_kinds)
        else:
            plan = self._plan_arg if self._plan_arg is not None else StagePlan.from_decorators(units)
        if plan is None:
            raise PlanError(
                f"HPPStrategy needs a stage plan: decorate unit classes with `@stage(k, ...)`, or pass "
                f"`HPPStrategy(plan=StagePlan([...]))`, a stage_plan.json path or plan='auto'. The model's units "
                f"are: {', '.join(names)}."
            )
        resolved = plan.resolve(names)
        self._plan = plan.with_modules(resolved)
        pp = self._pp_degree()
        if self._plan.num_stages > self.world_size * (2 if SCHEDULES[self._schedule].multi else 1) or pp > self.world_size:
            raise PlanError(
                f"The plan has {self._plan.num_stages} stages but the job has {self.world_size} processes. Use at "
                f"least {pp} processes (`Trainer(devices=..., num_nodes=...)`), or a plan with fewer stages."
            )
        check_schedule(self._schedule, self._plan.num_stages, pp, self._n_microbatches)
        style = SCHEDULES[self._schedule].style
        positions = [stages_of_position(r, pp, self._plan.num_stages, style) for r in range(pp)]
        if grid is None:
            grid = kind_grid(self._plan, positions, rank_kinds, pp, self.world_size // pp)
        self._mesh = Mesh.build(self.world_size, pp, self.global_rank, grid=grid)
        self._plan.meta["device_kinds"] = rank_kinds

        unit_stage = {n: k for k, ms in enumerate(resolved) for n in ms}
        if args is not None:
            check_sequential_forward(module, units, args, [names.index(ms[-1]) for ms in resolved[:-1]])

        self._mesh.init_groups()
        self._stage_ids = positions[self._mesh.position]
        for name, _ in units:
            if unit_stage[name] not in self._stage_ids:
                replace_unit(module, name, _RemoteUnit(name, unit_stage[name]))
        stage_modules = {
            k: StageModule(resolved[k], [module.get_submodule(n) for n in resolved[k]], k, first=(k == 0))
            for k in self._stage_ids
        }
        self.model_to_device()
        precision = self._install_precision(trainer)
        precision.configure_stages(self, self._plan, trainer_precision, stage_modules, self.root_device, rank_kinds[self.global_rank])
        self._runner = PipelineRunner(
            module, stage_modules, self._plan.num_stages, self._mesh, self._schedule, self._n_microbatches, self.root_device
        )
        self._runner.loss_multiplier = self._scale_loss
        rank_zero_info(
            f"HPPStrategy: {self._plan.num_stages} stages, schedule={self._schedule}, "
            f"n_microbatches={self._n_microbatches}, pp={pp} × dp={self._mesh.dp}\n{self._plan.table()}"
        )

    def _auto_plan(self, units: list, args: tuple | None, rank_kinds: list[str]) -> tuple[StagePlan, list[list[int]]]:
        if args is None:
            raise PlanError("plan='auto' profiles the units on one real micro-batch, but the dataloader gave no batch.")
        if self._schedule not in ("gpipe", "1f1b"):
            raise PlanError(f"plan='auto' plans 'gpipe' and '1f1b' schedules; got schedule={self._schedule!r}.")
        dp = self.world_size // self._pp_arg if self._pp_arg else 1
        plan, grid, table = auto_plan(units, args, self.global_rank, rank_kinds, dp_degree=dp, schedule=self._schedule,
                                      n_microbatches=self._n_microbatches, profile_path=self._auto_profile)
        self._pp_arg = plan.num_stages
        rank_zero_info(f"HPPStrategy: plan='auto' chose\n{table}")
        return plan, grid

    def _scale_loss(self, loss: Tensor) -> Tensor:
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches if trainer.training else 1
        scale = self.precision_plugin.loss_scale if isinstance(self.precision_plugin, HPPPrecision) else 1.0
        return loss * (scale / accumulate)

    def _sample_batch(self, trainer: Any) -> Any:
        """One real batch from the dataloader of the running stage, without touching any RNG."""
        fn = trainer.state.fn
        loop = {
            TrainerFn.FITTING: trainer.fit_loop,
            TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop,
            TrainerFn.PREDICTING: trainer.predict_loop,
        }[fn]
        with _preserved_rng():
            source = loop._data_source
            if not source.is_defined():
                return None
            loaders = source.dataloader()
            loader = _first_loader(loaders)
            if loader is None:
                return None
            it = iter(loader)
            try:
                return next(it)
            except StopIteration:
                return None
            finally:
                del it

    def _write_plan(self, trainer: Any) -> None:
        log_dir = trainer.log_dir or trainer.default_root_dir  # collective: every rank asks
        if not self.is_global_zero or self._plan is None or log_dir is None:
            return
        import fsspec

        fs, path = fsspec.core.url_to_fs(str(log_dir))
        fs.makedirs(path, exist_ok=True)
        meta = dict(self._plan.meta)
        meta.update(schedule=self._schedule, n_microbatches=self._n_microbatches, pp_degree=self._mesh.pp, dp_degree=self._mesh.dp)
        StagePlan(self._plan.stages, meta).save(f"{str(log_dir).rstrip('/')}/{PLAN_FILENAME}")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._runner is not None
        params = self._runner.parameters()
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss, logs = self._runner.train_step(self.lightning_module.training_step, *args, **kwargs)
        finally:
            fresh = [p.grad for p in params]
            for p, g in zip(params, held):
                p.grad = g
        self._fresh_grads = fresh
        self._replay(logs)
        self.step_stats = {"loss": float(loss)}
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward: the schedule already ran it, so hand over the held gradients."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._accumulate_fresh_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    def _accumulate_fresh_grads(self) -> None:
        assert self._runner is not None
        fresh, self._fresh_grads = self._fresh_grads, None
        if fresh is None:
            return
        params = self._runner.parameters()
        self.step_stats["local_grad_norms"] = self._stage_norms(params, fresh)
        self._all_reduce_dp(fresh)
        for p, g in zip(params, fresh):
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad.add_(g)

    def _stage_norms(self, params: list[Tensor], grads: list[Tensor | None]) -> dict[int, float]:
        """Each held stage's gradient norm before the dp all-reduce (what BiasMonitor compares)."""
        assert self._runner is not None
        where = {id(p): k for k, sm in self._runner.stage_modules.items() for p in sm.parameters()}
        per_stage: dict[int, list[Tensor]] = {k: [] for k in self._runner.stage_modules}
        for p, g in zip(params, grads):
            if g is not None:
                per_stage[where[id(p)]].append(g)
        # one host sync per stage, not per parameter
        return {
            k: float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)).double())) if gs else 0.0
            for k, gs in per_stage.items()
        }

    def _all_reduce_dp(self, grads: list[Tensor | None]) -> None:
        if self._mesh is None or self._mesh.dp == 1:
            return
        present = [g for g in grads if g is not None]
        if not present:
            return
        flat = torch._utils._flatten_dense_tensors(present)
        dist.all_reduce(flat, group=self._mesh.dp_group)
        flat.div_(self._mesh.dp)
        for g, synced in zip(present, torch._utils._unflatten_dense_tensors(flat, present)):
            g.copy_(synced)

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

    def _replay(self, logs: list[tuple[str, float, dict]]) -> None:
        module = self.lightning_module
        for name, value, kw in logs:
            module.log(name, torch.tensor(value, dtype=torch.float32, device=self.root_device), **kw)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Point a user's own ``DistributedSampler`` at the dp replicas, not at all ranks."""
        if self._mesh is None:
            return dataloader
        # seed workers per dp replica (Lightning's own seeding is per global rank, which would give the
        # stages of one replica different random augmentations of the same batch)
        if (getattr(dataloader, "num_workers", 0) > 0 and getattr(dataloader, "worker_init_fn", False) is None
                and (self._deterministic or int(os.environ.get("PL_SEED_WORKERS", 0)))):
            dataloader.worker_init_fn = worker_init_fn(self._determinism_seed(), self._mesh.replica)
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None) or getattr(dataloader, "sampler", None)
        if isinstance(sampler, DistributedSampler) and (sampler.num_replicas, sampler.rank) != (self._mesh.dp, self._mesh.replica):
            sampler.rank = self._mesh.replica  # first: dp <= world, so the rank stays valid throughout
            sampler.num_replicas = self._mesh.dp
            if type(sampler) is DistributedSampler:  # subclasses such as DistributedWeightedSampler derive sizes lazily
                n = len(sampler.dataset)
                if sampler.drop_last and n % sampler.num_replicas:
                    sampler.num_samples = math.ceil((n - sampler.num_replicas) / sampler.num_replicas)
                else:
                    sampler.num_samples = math.ceil(n / sampler.num_replicas)
                sampler.total_size = sampler.num_samples * sampler.num_replicas
        return dataloader

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints (sharded)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # the model must be cut and the optimizers built before a checkpoint knows what to load
        return True

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this run resumed from (never deleted by retention or top-k cleanup)."""
        return self._resumed_from

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's stages only: checkpoints are sharded, every rank writes its own part."""
        return self.lightning_module.state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write one sharded checkpoint directory at ``filepath`` (collective: every rank calls it)."""
        from lightning_hpp.checkpoint import Retention, save_sharded
        from lightning_hpp.checkpoint.lightning_state import to_sharded

        assert self._mesh is not None and self._plan is not None
        url = str(filepath)
        state = to_sharded(checkpoint, self.lightning_module, self.optimizers, global_rank=self.global_rank,
                           position=self._mesh.position, replica=self._mesh.replica)
        trainer = self.lightning_module.trainer
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if isinstance(v, Tensor) and v.numel() == 1}
        extra = {"plan": self._plan.to_dict(), "metrics": metrics, "hyper_parameters": checkpoint.get("hyper_parameters"),
                 "fingerprint": self._active_guard.checkpoint_metadata() if self._active_guard is not None else None}
        retention = None
        if self._keep_last is not None and self._checkpoint_dir is not None and url.rstrip("/").rsplit("/", 1)[0] == self._checkpoint_dir.rstrip("/"):
            retention = Retention(keep_last=self._keep_last)
        save_sharded(state, url, step=int(checkpoint.get("global_step", 0)), extra_metadata=extra, async_save=self._async_save,
                     on_error=self._save_on_error, retention=retention, protect=[self._resumed_from] if self._resumed_from else [])

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
        from lightning_hpp.checkpoint import checkpoint_keys, load_sharded, verify
        from lightning_hpp.checkpoint.lightning_state import from_sharded, load_template
        from lightning_hpp.checkpoint.store import newest_valid_anywhere
        from lightning_hpp.errors import CheckpointError, CorruptCheckpointError

        url = str(checkpoint_path)
        try:
            verify(url, checksums=False)
        except CorruptCheckpointError:
            found = newest_valid_anywhere([url])
            if found is None:
                raise CheckpointError(
                    f"{url!r} is neither a committed checkpoint (a directory with metadata.json) nor a directory "
                    f"holding one. Pass a checkpoint written by HPPStrategy, its parent directory, or 'last'."
                ) from None
            url = found.url
        keys = set(checkpoint_keys(url))
        template = load_template(self.lightning_module, self.optimizers, keys)
        loaded = load_sharded(url, template)
        checkpoint = from_sharded(loaded, self.lightning_module, self.optimizers, global_rank=self.global_rank,
                                  position=self._mesh.position if self._mesh else 0)
        self._pending_rng = checkpoint.pop("hpp_rng", None)
        self._resumed_from = url
        # batches of the current epoch already trained on (a checkpoint saved in on_train_batch_end has
        # processed the batch before Lightning counts it completed)
        progress = (checkpoint.get("loops") or {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})
        self._resume_batches = int((progress.get("current") or {}).get("processed", 0) or 0)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def on_train_start(self) -> None:
        from lightning_hpp.checkpoint.lightning_state import set_rng_state

        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None
        if self._resume_batches:
            _skip_consumed_batches(self.lightning_module.trainer, self._resume_batches)
            self._resume_batches = 0

    @override
    def teardown(self) -> None:
        from lightning_hpp.checkpoint.sharded import wait_for_pending_save

        wait_for_pending_save()
        super().teardown()

    def _resolve_ckpt_path(self, trainer: Any, ckpt_path: Any) -> Any:
        """``resume="auto"`` and ``ckpt_path="last"`` found with fsspec (local paths and ``s3://`` alike)."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        from lightning_hpp.checkpoint.store import newest_valid_anywhere

        if ckpt_path is None and self._resume == "auto":
            found = newest_valid_anywhere([self._checkpoint_dir])
            if found is None:
                rank_zero_info(f"HPPStrategy: no valid checkpoint in {self._checkpoint_dir!r}; starting from scratch.")
                return None
            rank_zero_info(f"HPPStrategy: resuming from {found.url!r} (step {found.step}).")
            return found.url
        if ckpt_path is None and self._resume not in (None, "auto"):
            return self._resume
        if ckpt_path == "last":
            roots = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
            if self._checkpoint_dir:
                roots.append(self._checkpoint_dir)
            found = newest_valid_anywhere(roots, prefer="last")
            if found is None:
                rank_zero_info(f"HPPStrategy: ckpt_path='last' but no valid checkpoint in {roots}; starting from scratch.")
                return None
            return found.url
        return ckpt_path

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Heterogeneous pipeline parallelism (lightning_hpp)")


def _shutdown() -> None:
    """At interpreter exit: finish a background checkpoint upload, then close the process groups.

    Process groups left to static destructors can abort the interpreter at exit ("terminate called
    without an active exception") while gloo's threads are still joinable.
    """
    from lightning_hpp.checkpoint.sharded import wait_for_pending_save

    wait_for_pending_save()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _Launcher(_SubprocessScriptLauncher):
    """Lightning's launcher, resolving ``resume`` / ``ckpt_path="last"`` on every rank first."""

    def __init__(self, strategy: HPPStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None and getattr(function, "__name__", "") == "_fit_impl" and len(args) >= 5:
            args = (*args[:4], self._strategy._resolve_ckpt_path(trainer, args[4]), *args[5:])
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _SkipFirst:
    """A sampler that skips its first ``n`` indices once (a mid-epoch resume), then is itself."""

    def __init__(self, sampler: Any, n: int) -> None:
        self.sampler = sampler
        self.n = n

    def __iter__(self):
        it = iter(self.sampler)
        n, self.n = self.n, 0
        for _ in range(n):
            next(it, None)
        return it

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


def _skip_consumed_batches(trainer: Any, done: int) -> None:
    """After a mid-epoch resume, make the train dataloader skip the ``done`` batches the epoch used."""
    loaders = trainer.fit_loop._combined_loader.flattened if trainer.fit_loop._combined_loader is not None else []
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        if batch_sampler is not None and hasattr(batch_sampler, "sampler") and batch_sampler.batch_size:
            batch_sampler.sampler = _SkipFirst(batch_sampler.sampler, done * batch_sampler.batch_size)


def _first_loader(loaders: Any) -> Any:
    if isinstance(loaders, dict):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


def _first_microbatch(batch: Any, n: int) -> Any:
    try:
        return split_batch(batch, n)[0]
    except PlanError:
        return batch


def _step_for(module: Any, fn: TrainerFn) -> Any:
    return {
        TrainerFn.FITTING: module.training_step,
        TrainerFn.VALIDATING: module.validation_step,
        TrainerFn.TESTING: module.test_step,
        TrainerFn.PREDICTING: module.predict_step,
    }[fn]


@contextmanager
def _preserved_rng():
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


if "hpp" not in StrategyRegistry:
    HPPStrategy.register_strategies(StrategyRegistry)
