"""HPPStrategy: Lightning's hooks wired to the layers below, nothing more.

``setup`` calls :func:`lightning_hpp.assembly.build_pipeline` once per LightningModule and keeps its
frozen :class:`~lightning_hpp.assembly.build.Pipeline` (plan, mesh, stages, runner, gradient hand-over);
the steps run its runner; checkpoint hooks go to :class:`~lightning_hpp.checkpoint.session.CheckpointSession`,
coded-bias hooks to :class:`~lightning_hpp.bias.controls.BiasControls`, processes to :mod:`lightning_hpp.launch`.
Callbacks read the pipeline through :class:`~lightning_hpp.pipeline.view.PipelineView`, which this class
implements. Lightning private attributes read here, for want of public ones: a loop's ``_data_source``
(the entry point's loaders before sampler injection: one batch to cut on) and
``_accelerator_connector._precision_flag`` (``Trainer(precision=...)``, kept nowhere else once a plugin is given).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.seed import isolate_rng
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_hpp.assembly import Pipeline, PipelineSpec, SetupInputs, build_pipeline
from lightning_hpp.assembly.callbacks import pipeline_callbacks, refuse_unkept_setups
from lightning_hpp.assembly.reuse import held_pipeline, pipeline_key
from lightning_hpp.assembly.strategy_hooks import ReplicaCollectives, ShardedCheckpointHooks
from lightning_hpp.assembly.view import PipelineProperties
from lightning_hpp.assembly.whole_module import adapt_callbacks
from lightning_hpp.bias.controls import BiasControls
from lightning_hpp.bias.monitor import BiasMonitor
from lightning_hpp.bias.samplers import pin_wrapped_generator
from lightning_hpp.checkpoint.session import CheckpointSession
from lightning_hpp.errors import PlanError
from lightning_hpp.launch import Launcher, check_backend, check_timeout, init_process_group
from lightning_hpp.model.materialize import init_on_meta
from lightning_hpp.options import (
    BiasOptions,
    CheckpointOptions,
    InitOptions,
    PlacementOptions,
    ShardingOptions,
    TelemetryOptions,
    moved_option_hint,
    section,
)
from lightning_hpp.pipeline.data import (
    can_rebatch,
    first_loader,
    loaders_once,
    peek_batch,
    rebatch,
    resume_mid_epoch,
    seed_workers_per_replica,
    shard_over_replicas,
)
from lightning_hpp.pipeline.optimizers import stage_local_optimizers
from lightning_hpp.pipeline.steps import replay_logs
from lightning_hpp.planning.plan import PLAN_FILENAME, StagePlan
from lightning_hpp.precision.plugin import HPPPrecision
from lightning_hpp.redaction import redact_loggers

_ENTRY_POINTS = {
    TrainerFn.FITTING: ("fit_loop", "training_step"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step"),
    TrainerFn.TESTING: ("test_loop", "test_step"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step"),
}


class HPPStrategy(PipelineProperties, ReplicaCollectives, ShardedCheckpointHooks, ParallelStrategy):
    """Pipeline-parallel (× data-parallel) training of an unchanged LightningModule.

    Args:
        plan, schedule, n_microbatches, pp_degree, frontend, activation_checkpointing, compile, loss_weight:
            The pipeline's own options, documented with :class:`~lightning_hpp.assembly.spec.PipelineSpec`: ``plan`` is
            ``None``
            (the ``@stage`` decorators), a :class:`StagePlan`, a ``stage_plan.json`` path or ``"auto"``;
            ``schedule`` one of ``gpipe``, ``1f1b`` (default), ``interleaved1f1b``, ``looped_bfs``,
            ``interleaved_zb``, ``zbv``, ``dualpipev``; ``n_microbatches`` default 4; ``frontend`` ``"auto"``,
            ``"sequential"`` or ``"traced"``; ``loss_weight`` ``None`` (micro-batch losses count equally) or
            ``batch -> tokens`` its loss averages over.
        step_replay: Which steps every rank of a pipeline runs with the last stage's outputs, so that what they
            record on the module is there for the hooks every rank runs: ``"auto"`` (those that change the
            module's state), ``"every_rank"`` or ``"last_stage"`` (:class:`~lightning_hpp.assembly.spec.PipelineSpec`).
        checkpoint: :class:`~lightning_hpp.options.CheckpointOptions` (or a dict of its fields): the
            strategy's own ``step-<N>`` checkpoints and where to resume from.
        bias: :class:`~lightning_hpp.options.BiasOptions`: the coded-bias audit, fingerprints, determinism.
        telemetry: :class:`~lightning_hpp.options.TelemetryOptions`, ``True`` (its defaults) or ``None``.
        placement: :class:`~lightning_hpp.options.PlacementOptions`: device kinds, ``plan="auto"`` profile.
        init: :class:`~lightning_hpp.options.InitOptions`: initial weights of a model built on the meta device.
        sharding: :class:`~lightning_hpp.options.ShardingOptions`: each stage's replicas as ddp, fsdp or hsdp (unset:
        ddp, or fsdp where plan="auto" fits only that).
        timeout: Timeout of every collective and pipeline send/recv (a ``timedelta`` or seconds; a silent rank ends the
        job).
        process_group_backend: ``"gloo"`` / ``"nccl"``; default by device.
        precision_plugin: An :class:`~lightning_hpp.HPPPrecision` (default: one with the Trainer's ``precision``).
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
        compile: bool | dict = False,
        loss_weight: Any = None,
        *,
        step_replay: str = "auto",
        checkpoint: CheckpointOptions | dict | None = None,
        bias: BiasOptions | dict | None = None,
        telemetry: TelemetryOptions | dict | bool | None = None,
        placement: PlacementOptions | dict | None = None,
        init: InitOptions | dict | None = None,
        sharding: ShardingOptions | dict | None = None,
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
            raise PlanError(
                f"`HPPStrategy(precision_plugin=...)` must be an `HPPPrecision`, got {type(precision_plugin).__name__}."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
        )
        self._spec = PipelineSpec(
            plan,
            schedule,
            n_microbatches,
            pp_degree,
            frontend,
            activation_checkpointing,
            loss_weight=loss_weight,
            step_replay=step_replay,
            compile=compile,
        )
        self._timeout = check_timeout(timeout)
        self._process_group_backend = check_backend(process_group_backend)
        self._checkpoint = section(CheckpointOptions, checkpoint, "checkpoint")
        self._bias = section(BiasOptions, bias, "bias")
        self._telemetry = (
            None
            if telemetry in (None, False)
            else section(TelemetryOptions, None if telemetry is True else telemetry, "telemetry")
        )
        self._placement = section(PlacementOptions, placement, "placement")
        self._init = section(InitOptions, init, "init")
        # None: auto may shard
        self._sharding = None if sharding is None else section(ShardingOptions, sharding, "sharding")
        self._controls = BiasControls(self._bias)
        self._session = CheckpointSession(self._checkpoint)
        self._pipeline: Pipeline | None = None
        self._num_nodes = 1
        self._step_stats: dict[str, Any] = {}
        self._agreed_epoch: int | None = None  # the epoch whose stages' trainability the pipeline agreed on

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
        if self._pipeline is not None:
            return {"num_replicas": self._pipeline.mesh.dp, "rank": self._pipeline.mesh.replica}
        dims = self._spec.dims_before_setup(self.world_size, self.lightning_module, self._sharding)
        return {"num_replicas": dims.dp, "rank": dims.replica_of(self.global_rank)}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._controls.before_launch()
        self._launcher = Launcher(self._resolve_fit_ckpt, self.cluster_environment, self.num_processes, self.num_nodes)

    def _resolve_fit_ckpt(self, trainer: Any, ckpt_path: Any) -> Any:
        # a PendingResume is decided by all ranks at the end of setup
        return self._session.request_fit(
            ckpt_path, [cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
        )

    @override
    def setup_environment(self) -> None:
        redact_loggers(self.lightning_module.trainer.loggers)  # before any hook can log hyperparameters
        self._session.route_storage()  # before the callbacks' setup touches their dirpath
        self._controls.setup_environment(self.lightning_module.trainer)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        init_process_group(
            self.cluster_environment, self._process_group_backend, self._timeout, self.root_device, self.world_size
        )

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

    # ------------------------------------------------------------------ setup: the pipeline, once per module
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._session.check_setup(fitting=fitting, checkpointing=bool(trainer.checkpoint_callbacks))
        refuse_unkept_setups(
            self.lightning_module,
            self.precision_plugin,
            checkpoint_io=self._checkpoint_io,
            fitting=fitting,
            precision_flag=trainer._accelerator_connector._precision_flag,
            sharding=self._sharding,
            callbacks=trainer.callbacks,
            layer_sync=self._layer_sync,
        )
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._pipeline is None or self._pipeline.module is not module:
            inputs = self._setup_inputs(trainer, module, fitting)
            self._pipeline = held_pipeline(module, pipeline_key(self._spec, inputs)) or build_pipeline(
                module, self._spec, inputs
            )
            self.precision_plugin = self._pipeline.precision  # the plugin its stages were set up with
        self.model_to_device()  # a reused cut too: the previous entry point's teardown moved the module to the CPU
        adapt_callbacks(trainer.callbacks, self._pipeline)  # Lightning's callbacks that act on the whole module
        step_saver = self._session.step_callback(trainer.callbacks) if fitting else None
        trainer.callbacks.extend(
            ([step_saver] if step_saver is not None else [])
            + pipeline_callbacks(
                trainer.callbacks,
                self._telemetry,
                auto=self._spec.auto and fitting,
                watch=self._placement.watch if fitting else None,
                checkpoint_dir=self._checkpoint.dir,
                notes=self._session.notes,
                timeout=self._timeout,
            )
        )
        if fitting:
            with stage_local_optimizers():  # a rank whose stages train nothing (frozen) builds an empty optimizer
                self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        # log_dir is collective: every rank asks
        log_dir, p = trainer.log_dir or trainer.default_root_dir, self._pipeline
        if self.is_global_zero and log_dir is not None:
            p.plan.save(
                f"{str(log_dir).rstrip('/')}/{PLAN_FILENAME}",
                schedule=p.schedule,
                n_microbatches=p.n_microbatches,
                pp_degree=p.mesh.pp,
                dp_degree=p.mesh.dp,
            )
        if fitting:
            self._agreed_epoch = None
            self._session.begin_fit(self._load_sharded)

    def _setup_inputs(self, trainer: Any, module: Any, fitting: bool) -> SetupInputs:
        """What the assembly needs of the running entry point: its step, one loader batch, the precision flag."""
        if isinstance(self.precision_plugin, HPPPrecision):
            trainer_precision = trainer._accelerator_connector._precision_flag
        else:  # Lightning's plugin for `Trainer(precision=...)`: the stages' default, under our own plugin
            trainer_precision = str(self.precision_plugin.precision)
            self.precision_plugin = HPPPrecision()
        loop_name, step_name = _ENTRY_POINTS[trainer.state.fn]
        loop = getattr(trainer, loop_name)
        loader = first_loader(loaders_once(loop._data_source)) if loop._data_source.is_defined() else None
        with isolate_rng():
            batch = peek_batch(loader) if loader is not None else None
        return SetupInputs(
            world_size=self.world_size,
            rank=self.global_rank,
            device=self.root_device,
            batch=batch,
            fitting=fitting,
            step_fn=getattr(module, step_name),
            precision=self.precision_plugin,
            callbacks=tuple(trainer.callbacks),
            trainer_precision=trainer_precision,
            placement=self._placement,
            init=self._init,
            sharding=self._sharding,
            split_batches=fitting and can_rebatch(loader),
            global_step=lambda: int(trainer.global_step),
            recorded_speeds=self._session.recorded_speeds,
            default_seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
        )

    @override
    def model_to_device(self) -> None:
        (self._pipeline.place if self._pipeline is not None else self.model.to)(self.root_device)

    # ------------------------------------------------------------------ steps
    def _wants_local_norms(self) -> bool:
        return any(isinstance(cb, BiasMonitor) for cb in self.lightning_module.trainer.callbacks)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._pipeline is not None
        trainer = self.lightning_module.trainer
        scale = self.precision_plugin.loss_scale / trainer.accumulate_grad_batches
        if self._agreed_epoch != trainer.current_epoch:  # which stages train may change between epochs
            self._pipeline.runner.agree_trainable()
            self._agreed_epoch = trainer.current_epoch
        # Lightning zeroes the gradients after the first training_step of each accumulation window
        window_start = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        with self._pipeline.grads.during_step(keep_held=not window_start, local_norms=self._wants_local_norms()):
            loss, logs, extras = self._pipeline.runner.train_step(
                self.lightning_module.training_step, *args, loss_scale=scale, **kwargs
            )
        replay_logs(self.lightning_module, logs)
        self._step_stats = {"loss": loss.detach()}
        return loss if extras is None else {"loss": loss, **extras}

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward: the schedule already ran it, so hand over the held gradients."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        norms = self._pipeline.grads.hand_over(local_norms=self._wants_local_norms())
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
        assert self._pipeline is not None
        output, logs = self._pipeline.runner.eval_step(getattr(self.lightning_module, hook), *args, **kwargs)
        replay_logs(self.lightning_module, logs)
        return output

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        p = self._pipeline
        if p is not None:
            init_fn = self._controls.worker_init(p.mesh.replica)
            if init_fn is not None:
                seed_workers_per_replica(dataloader, init_fn)
            shard_over_replicas(dataloader, p.mesh.dp, p.mesh.replica)
            pin_wrapped_generator(dataloader, self._controls.seed)  # every stage draws the same sequence every epoch
            rebatch(dataloader, p.split)
        if self.lightning_module.trainer.training:  # before its iterator (and workers) exist
            batches, epoch = self._session.take_resume_position()
            if batches:
                resume_mid_epoch(dataloader, batches, epoch)
        return dataloader

    @override
    def on_train_start(self) -> None:
        self._session.restore_rng()

    @override
    def teardown(self) -> None:
        self._session.finish()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Heterogeneous pipeline parallelism (lightning_hpp)"
        )


if "hpp" not in StrategyRegistry:
    HPPStrategy.register_strategies(StrategyRegistry)
