"""Assembling this rank's pipeline: :func:`build_pipeline`, one function from (module, spec, options,
this rank) to a frozen :class:`Pipeline`.

In order, on every rank together (the collectives are marked):

1. rank 0's parameters and buffers on every rank (collective, as DDP starts; a meta model's stages are
   initialised alike on every rank instead), the ranks' device kinds (collective) and the plan, resolved once (:func:`resolve_plan`): ``plan="auto"``
   (profiled and searched, collective), the user's plan, the ``@stage`` decorators, or a balanced cut;
2. the cut (sequential or traced frontend) on one real micro-batch of the step's ``self(...)`` call;
3. the rank grid (:class:`~lightning_hpp.pipeline.mesh.Mesh`, collective) and this rank's stages; a meta
   model's stages materialized; the shared parameters' gradient groups (collective);
4. the stage modules, the runner, the precision plugin's per-stage set-up, the gradient hand-over.

Nothing here reads Lightning's Trainer: what the running entry point supplies (the step, one loader
batch) comes in :class:`SetupInputs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.seed import isolate_rng
from torch import nn

from lightning_hpp._dist import broadcast_tensors
from lightning_hpp.assembly.callbacks import sharding_refusals
from lightning_hpp.assembly.placement import auto_plan, gather_kinds, kind_grid, loss_probe
from lightning_hpp.assembly.spec import DEFAULT_MICROBATCHES, DEFAULT_SCHEDULE, PipelineSpec, ResolvedPlan
from lightning_hpp.errors import PartitionError, PlacementError, PlanError, ShardingError
from lightning_hpp.model.frontend import balanced_plan, block_names, cut_model, planning_units
from lightning_hpp.model.materialize import fake_parameters, has_meta_parameters, materialize_stages
from lightning_hpp.model.units import find_units
from lightning_hpp.options import InitOptions, PlacementOptions, ShardingOptions
from lightning_hpp.pipeline.epoch_end import replay_epoch_ends
from lightning_hpp.pipeline.fsdp import ShardedStages, shard_stages
from lightning_hpp.pipeline.grads import GradHandover, shared_gradient_groups
from lightning_hpp.pipeline.loss import LossWeights
from lightning_hpp.pipeline.mesh import Mesh, stages_of_position
from lightning_hpp.pipeline.microbatch import batch_size_of, split_batch
from lightning_hpp.pipeline.runner import PipelineRunner
from lightning_hpp.pipeline.schedules import check_schedule
from lightning_hpp.pipeline.stage import StageModule
from lightning_hpp.pipeline.steps import capture_input, count_forward_calls, second_call_error
from lightning_hpp.pipeline.tensor_parallel import TPPlan, at_local_width, check_frontend, resolve_tp_plan, split_stages
from lightning_hpp.planning.plan import StagePlan, StageSpec
from lightning_hpp.precision.modes import MODES
from lightning_hpp.precision.plugin import HPPPrecision, StageView


@dataclass(frozen=True)
class SetupInputs:
    """What the running job hands the assembly.

    Attributes:
        world_size, rank: This job's size and this process's global rank.
        device: This rank's device.
        step_fn: The LightningModule's step of the running entry point (``training_step`` when fitting).
        batch: One batch of that entry point's first loader, as loaded (``None``: no data).
        fitting: Whether the entry point trains.
        split_batches: Whether the train loader's batches can be made smaller (``plan="auto"``).
        precision: The precision plugin; ``trainer_precision`` the Trainer's ``precision`` flag.
        placement, init, sharding: The strategy's option sections (``sharding=None``: not given, so ddp, or
            fsdp where ``plan="auto"`` finds that only sharded stages fit).
        callbacks: The Trainer's callbacks (what sharded stages refuse among them keeps ``plan="auto"`` on ddp).
        global_step: The optimizer step being run (read by the precision guards).
        default_seed: The initializers' seed when ``init.seed`` is unset.
        recorded_speeds: Collective: the per-rank speeds the straggler watch recorded in the checkpoint the
            fit resumes from (``plan="auto"`` plans with them), ``None`` when none.
    """

    world_size: int
    rank: int
    device: torch.device
    step_fn: Callable[..., Any]
    batch: Any
    fitting: bool
    precision: HPPPrecision
    trainer_precision: str | None
    placement: PlacementOptions = field(default_factory=PlacementOptions)
    init: InitOptions = field(default_factory=InitOptions)
    sharding: ShardingOptions | None = None
    callbacks: Sequence[Any] = ()
    split_batches: bool = True
    global_step: Callable[[], int] = lambda: -1
    default_seed: int = 0
    recorded_speeds: Callable[[], dict[int, float] | None] = lambda: None


@dataclass(frozen=True)
class Pipeline:
    """This rank's assembled pipeline (built once per LightningModule and setup).

    Attributes:
        module: The LightningModule it was cut from (holding only this rank's stages).
        plan: The resolved plan (unit names expanded; ``meta`` says how it was made).
        mesh: The pp × dp rank grid and its groups.
        stage_ids: The stages this rank holds.
        schedule, n_microbatches, split: As resolved (:class:`~lightning_hpp.assembly.spec.ResolvedPlan`).
        frontend, reason: The frontend that cut the model, and why.
        rank_kinds: Every rank's device kind.
        runner: Runs batches through this rank's stages.
        grads: Hands the schedule's gradients to Lightning's optimizer step.
    """

    module: nn.Module
    plan: Any
    mesh: Mesh
    stage_ids: tuple[int, ...]
    schedule: str
    n_microbatches: int
    split: int
    frontend: str
    reason: str
    rank_kinds: tuple[str, ...]
    runner: PipelineRunner
    grads: GradHandover

    @property
    def device_kind(self) -> str:
        """This rank's device kind."""
        return self.rank_kinds[self.mesh.rank]


def build_pipeline(module: nn.Module, spec: PipelineSpec, inputs: SetupInputs) -> Pipeline:
    """Resolve the plan, cut ``module``, build the groups and keep only this rank's stages (collective).

    Raises:
        PlanError: a plan, schedule or layout that cannot run on this job (the same on every rank).
    """
    world, device = inputs.world_size, inputs.device
    free_sharding = inputs.sharding is None  # plan="auto" may shard the stages where only that fits
    inputs = dataclasses.replace(inputs, sharding=inputs.sharding or ShardingOptions())
    if spec.pp_degree is not None and spec.pp_degree > world:
        raise PlanError(f"`HPPStrategy(pp_degree={spec.pp_degree})` needs at least {spec.pp_degree} processes, one per pipeline "
                        f"position, but the job has {world}. Lower `pp_degree`, or start more processes "
                        f"(`Trainer(devices=..., num_nodes=...)`).")
    inputs.placement.check_world(world)
    rank_kinds = gather_kinds(device, inputs.rank, inputs.placement.device_map)
    tp = inputs.sharding.tp_degree
    tp_plan = _tp_plan(module, spec, inputs, world) if tp > 1 else None
    meta = has_meta_parameters(module)
    if not meta:  # as DDP does: every replica (and every stage's copy of a shared weight) starts from rank 0's model
        broadcast_tensors([t for t in (*module.parameters(), *module.buffers()) if t is not None], src=0)
    with fake_parameters(module, device) if meta else contextlib.nullcontext():
        # the checks run the whole model, which stays where it is until it is cut (a meta model's stand-ins are on `device`)
        home = next((p.device for p in module.parameters()), device)
        batch = None if inputs.batch is None else move_data_to_device(inputs.batch, home)
        resolved, example = resolve_plan(module, spec, inputs, batch, rank_kinds, free_sharding=free_sharding)
        if resolved.sharding is not None:  # the same on every rank: every rank ran the same search
            inputs = dataclasses.replace(inputs, sharding=resolved.sharding)
        example = _in_stage_dtype(module, resolved.plan, example, inputs)
        # both modes whatever the entry point: a pipeline built by `validate()` is the one a later `fit()` trains
        with at_local_width(module, tp_plan, tp) if tp_plan is not None else contextlib.nullcontext():
            cut = cut_model(module, resolved.plan, example, frontend=spec.frontend, modes=("train", "eval"))
    if tp_plan is not None:
        check_frontend(tp_plan, cut.frontend, type(module).__name__)
    plan = cut.plan
    pp = resolved.pp(plan)
    if pp > world or (resolved.pp_degree is None and plan.num_stages > world * resolved.kind.stages_per_rank):
        raise PlanError(
            f"The plan has {plan.num_stages} stages (pp_degree={pp}) but the job has {world} processes. "
            f"Use at least {pp} processes (`Trainer(devices=..., num_nodes=...)`), or a plan with fewer stages."
        )
    check_schedule(resolved.schedule, plan.num_stages, pp, resolved.n_microbatches)
    positions = [stages_of_position(r, pp, plan.num_stages, resolved.kind.style) for r in range(pp)]
    grid = resolved.grid if resolved.grid is not None else kind_grid(plan, positions, rank_kinds, pp, world // pp)
    mesh = _mesh(world, pp, inputs, grid)
    plan.meta["device_kinds"] = rank_kinds
    mesh.init_groups(device_type=device.type)
    module._device_mesh = mesh.device_mesh  # what `LightningModule.device_mesh` reads, as under ModelParallelStrategy
    stage_ids = positions[mesh.position]
    blocks = block_names(module) if inputs.sharding.sharded else []  # FSDP2's units, named before the cut drops any
    cut.keep_only(module, stage_ids)
    bodies = [b for mode in ("train", "eval") for k in stage_ids for b in cut.bodies[mode][k]]
    traced = cut.frontend == "traced"
    recompute = [spec.activation_checkpointing if s.activation_checkpointing is None else s.activation_checkpointing
                 for s in plan.stages]
    stages = {mode: {k: StageModule(plan.stages[k].modules, cut.bodies[mode][k], k, spread=cut.spread[k], captured=traced,
                                    checkpoint_activations=recompute[k])
                     for k in stage_ids} for mode in ("train", "eval")}
    if cut.frontend == "sequential":
        stages["eval"] = stages["train"]
    if tp_plan is not None:  # before materializing: a meta model's ranks then materialize (and read) only their shards
        split = split_stages(module, [*stages["train"].values(), *stages["eval"].values()], tp_plan, mesh.device_mesh["tp"])
        plan.meta["tensor_parallel"] = {"degree": tp, "plan": tp_plan.source, "split": split}
    if has_meta_parameters(module):
        _materialize(module, inputs)
    module.to(device)
    for body in bodies:
        if hasattr(body, "place"):  # traced stages: their own constants, and the ops that create tensors, on this device
            body.place(device)
    weights = None if spec.loss_weight is None else LossWeights(spec.loss_weight, mesh.dp_group, mesh.dp)
    runner = PipelineRunner(module, stages["train"], plan.num_stages, mesh, resolved.schedule, resolved.n_microbatches,
                            device, eval_stage_modules=stages["eval"], flatten=cut.flatten, unflatten=cut.unflatten,
                            loss_weights=weights)
    repeated = {k: {n for n, ks in cut.shared.items() if k in ks and min(ks) < k} for k in stage_ids}
    view = StageView(stages["train"], eval_stages=stages["eval"], pp_group=mesh.pp_group if pp > 1 else None,
                     dp_group=mesh.dp_group, microbatch=runner.current_microbatch, step=inputs.global_step,
                     step_checks=runner.step_checks, repeated_names=repeated,
                     named_parameters=lambda: dict(module.named_parameters()))
    inputs.precision.configure_stages(plan, view, inputs.trainer_precision, device, rank_kinds[inputs.rank])
    runner.sharded = _shard(module, plan, stages["train"], mesh, inputs, blocks)
    if runner.sharded is not None:
        view.shard_group = mesh.dp_shard_group
    # after sharding: the parameters several stages use are the ones the stages hold now (shards, under FSDP2)
    shared = shared_gradient_groups(cut.shared, dict(module.named_parameters()), positions, mesh)
    # FSDP2 reduces a sharded stage's gradients itself (reduce-scatter, and all-reduce over hsdp's replicas)
    grads = GradHandover(stages["train"], None if runner.sharded else mesh.dp_group, 1 if runner.sharded else mesh.dp,
                         shared=shared)
    runner.last_backward_window = grads.last_backward
    replay_epoch_ends(module, holds_last=runner.holds_last, pp_group=mesh.pp_group if pp > 1 else None,
                      last_position=runner.last_position, dp_group=mesh.dp_group)
    rank_zero_info(
        f"HPPStrategy: {plan.num_stages} stages, frontend={cut.frontend} ({cut.reason}), schedule={resolved.schedule}, "
        f"n_microbatches={resolved.n_microbatches}, pp={pp} × dp={mesh.dp}"
        + (f" ({inputs.sharding.data_parallel}: dp_replicate={mesh.dp_replicate} × dp_shard={mesh.dp_shard})"
           if runner.sharded else "")
        + (f" × tp={tp} ({tp_plan.source})" if tp_plan else "")
        + (f", shared parameters {sorted(cut.shared)}" if cut.shared else "") + f"\n{plan.table()}"
    )
    return Pipeline(module=module, plan=plan, mesh=mesh, stage_ids=tuple(stage_ids), schedule=resolved.schedule,
                    n_microbatches=resolved.n_microbatches, split=resolved.split, frontend=cut.frontend, reason=cut.reason,
                    rank_kinds=tuple(rank_kinds), runner=runner, grads=grads)


def _mesh(world: int, pp: int, inputs: SetupInputs, grid: list[list[int]] | None) -> Mesh:
    """The rank grid of ``pp`` positions with the sharding options' data-parallel shape.

    Raises:
        ShardingError: an hsdp ``dp_replicate`` that does not divide the replicas.
    """
    sharding, tp = inputs.sharding, inputs.sharding.tp_degree
    if world % (pp * tp):
        return Mesh.build(world, pp, inputs.rank, grid=grid, tp=tp)  # refused there, with the sizes
    _, dp_shard = sharding.dp_dims(world // (pp * tp))
    return Mesh.build(world, pp, inputs.rank, grid=grid, dp_shard=dp_shard, tp=tp)


def _tp_plan(module: nn.Module, spec: PipelineSpec, inputs: SetupInputs, world: int) -> TPPlan:
    """The tensor-parallel plan of ``module``'s stages (``tp_degree > 1``), where this version composes it.

    Raises:
        ShardingError: tensor parallel with ``plan="auto"``, sharded (fsdp / hsdp) stages, or several replicas
            of each stage (their gradients' all-reduce does not yet take ``DTensor`` shards).
        PlanError: no plan for the model, or one that ``tp_degree`` does not divide (:func:`resolve_tp_plan`).
    """
    sharding = inputs.sharding
    tp = sharding.tp_degree
    opt = f"`ShardingOptions(tp_degree={tp})`"
    if spec.auto:
        raise ShardingError(f"{opt} with plan='auto': the planner does not model tensor parallelism. Give the plan "
                            f"(`StagePlan.split_at([...])` or pp_degree), or use tp_degree=1.")
    if sharding.sharded:
        raise ShardingError(f"{opt} with data_parallel={sharding.data_parallel!r}: sharded stages do not compose with "
                            f"tensor parallelism in this version. Use data_parallel='ddp' with tp_degree={tp}, or "
                            f"tp_degree=1.")
    clipped = [k for k, s in enumerate(spec.plan.stages if isinstance(spec.plan, StagePlan) else []) if s.clip_norm is not None]
    if clipped:
        raise ShardingError(f"{opt}: stages {clipped} clip their gradients (`StageSpec(clip_norm=...)`), but clipping does not "
                            f"take the norm over tensor-parallel shards in this version. Drop clip_norm, or use tp_degree=1.")
    pp = spec.pp_degree
    if pp is None:
        raise ShardingError(f"{opt}: give `HPPStrategy(pp_degree=...)` too, so that world_size = pp_degree × tp_degree "
                            f"(the pipeline degree is otherwise the number of processes).")
    if world % (pp * tp) == 0 and world // (pp * tp) > 1:
        raise ShardingError(f"{opt}: {world} processes with pp_degree={pp} are {world // (pp * tp)} replicas of each "
                            f"stage, whose gradients' all-reduce does not take tensor-parallel shards in this version. "
                            f"Use world_size = pp_degree × tp_degree ({pp * tp} processes), or tp_degree=1.")
    return resolve_tp_plan(module, tp)


def _shard(root: nn.Module, plan: StagePlan, stages: dict[int, StageModule], mesh: Mesh, inputs: SetupInputs,
           blocks: list[str]) -> ShardedStages | None:
    """FSDP2 on this rank's training stages when ``ShardingOptions`` asks for it (collective over the shard
    groups), after the precision plugin cast them to their stages' dtypes; ``None`` for unsharded stages. Each
    of the model's ``blocks`` and each unit of the plan a stage holds is sharded on its own (FSDP2 gathers one
    group at a time).

    Raises:
        ShardingError: an fp8 stage (its converted or emulated GEMMs keep per-weight scaling state that
            FSDP2's sharded parameters do not carry yet).
    """
    sharding = inputs.sharding
    if not sharding.sharded:
        return None
    precisions = inputs.precision.stage_precisions(plan, inputs.trainer_precision)
    fp8 = [k for k, p in enumerate(precisions) if p == "fp8"]
    if fp8:
        raise ShardingError(
            f"`ShardingOptions(data_parallel={sharding.data_parallel!r})` cannot shard fp8 stages yet (stage(s) {fp8}). "
            f"Give those stages another precision (e.g. 'bf16-mixed'), or keep data_parallel='ddp'.")
    return shard_stages(root, stages, {k: [*blocks, *plan.stages[k].modules] for k in stages}, mesh.shard_mesh,
                        sharding.reshard_after_forward)


def resolve_plan(module: nn.Module, spec: PipelineSpec, inputs: SetupInputs, batch: Any, rank_kinds: list[str],
                 free_sharding: bool = False) -> tuple[ResolvedPlan, tuple[tuple, dict] | None]:
    """The plan before the cut, once, and the example call the cut sees (one micro-batch of the chosen size).

    ``plan="auto"`` (collective), the user's plan, the ``@stage`` decorators, or a cut balanced by
    parameter count over the model's longest block list. With ``free_sharding`` (no ``ShardingOptions``
    given) ``plan="auto"`` may shard the stages (``resolved.sharding``) where only sharded stages fit.
    """
    schedule = spec.schedule or DEFAULT_SCHEDULE
    m = spec.n_microbatches or DEFAULT_MICROBATCHES
    if spec.auto:
        profiled = _profile_batch(inputs, batch)
        example = example_call(module, inputs.step_fn, profiled, spec.n_microbatches or 1, at_least_two=False)  # as is
        resolved = _auto_plan(module, spec, inputs, profiled, example, rank_kinds, free_sharding)
        if example is not None:  # the cut sees one micro-batch of the chosen size
            example = example_call(module, inputs.step_fn, batch, resolved.split * resolved.n_microbatches)
        return resolved, example
    example = example_call(module, inputs.step_fn, batch, m)
    if spec.plan is None:
        plan = spec.decorated_plan(module)
        if plan is None:
            n = (spec.pp_degree or inputs.world_size) * spec.kind.stages_per_rank
            if n == 1:  # one process, or pp_degree=1: the whole model is one stage, data parallel over the ranks
                plan = StagePlan([StageSpec(modules=[name for name, _ in find_units(module)])])
            else:
                plan = balanced_plan(module, n)
                rank_zero_info(f"HPPStrategy: no plan given; {plan.meta['balanced']}: cut at {plan.meta['cut_points']}.")
    else:
        plan = spec.plan
    return ResolvedPlan(plan, schedule, m, pp_degree=spec.pp_degree), example


def _profile_batch(inputs: SetupInputs, batch: Any) -> Any:
    """The batch ``plan="auto"`` profiles on: ``PlacementOptions(profile_batch=...)`` (on ``batch``'s device), else
    ``batch``, the loader's first; the shapes it has are logged.

    Raises:
        PlacementError: a profile batch of another batch size than the loader's.
    """
    given = inputs.placement.profile_batch
    if given is None or batch is None:
        chosen = batch
    else:
        home = next(iter(t.device for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)), inputs.device)
        chosen = move_data_to_device(given, home)
        if batch_size_of(chosen) != batch_size_of(batch):
            raise PlacementError(
                f"`PlacementOptions(profile_batch=...)` holds {batch_size_of(chosen)} samples, but the training "
                f"loader's batches hold {batch_size_of(batch)}: plan='auto' splits the batch it profiles as it splits "
                f"the loader's. Give a batch of {batch_size_of(batch)} samples at the length to plan for.")
    if chosen is not None:
        shapes = [tuple(t.shape) for t in pytree.tree_leaves(chosen) if isinstance(t, torch.Tensor)]
        source = "PlacementOptions(profile_batch=...)" if given is not None else "the training loader's first batch"
        rank_zero_info(f"HPPStrategy: plan='auto' profiles on a batch of shapes {shapes} ({source}).")
    return chosen


def example_call(module: nn.Module, step_fn: Callable[..., Any], batch: Any, parts: int,
                 at_least_two: bool = True) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of the step's ``self(...)`` call on one micro-batch (``1 / parts`` of ``batch``), RNG untouched.

    With ``at_least_two`` a micro-batch of one sample is taken two samples large (the whole batch where
    its size is odd): ``torch.export`` fixes a dimension of size 1, and the traced stages would then
    refuse every other batch size.

    Raises:
        PlanError: the step calls ``self(...)`` more than once.
    """
    if batch is None:
        return None
    try:
        size = batch_size_of(batch)
    except PlanError:
        size = None  # reported by the first step, with what the batch holds
    if at_least_two and size is not None and size >= 2 and size // parts < 2:
        parts = size // 2 if size % 2 == 0 else 1
    with isolate_rng():
        try:
            batch = split_batch(batch, parts)[0]
        except PlanError:
            pass  # an indivisible batch is reported by the first step, with its size
        if count_forward_calls(module, step_fn, batch, 0) > 1:
            raise second_call_error(step_fn.__name__)
        return capture_input(module, step_fn, batch, 0)


def _auto_plan(module: nn.Module, spec: PipelineSpec, inputs: SetupInputs, batch: Any, example: tuple | None,
               rank_kinds: list[str], free_sharding: bool) -> ResolvedPlan:
    """``plan="auto"`` on this job (collective). The stages' data-parallel mode is the user's ``ShardingOptions``,
    or, with ``free_sharding``, ddp and fsdp where only sharded stages fit (unless the setup holds something
    sharded stages refuse: then ddp, and the no-plan error says why fsdp was not tried).

    Raises:
        PlacementError: ``PlacementOptions(memory=...)`` names a kind no rank has.
        PartitionError: no plan fits.
    """
    if example is None:
        raise PlanError("plan='auto' profiles the model on one real micro-batch, but the dataloader gave no batch.")
    if has_meta_parameters(module) and inputs.placement.profile is None:
        raise PlanError("plan='auto' measures the model, but it was built on the meta device (no weights yet). Pass a "
                        "cost profile (`HPPStrategy(placement=PlacementOptions(profile=...))`, see "
                        "`python -m lightning_hpp.planning.cli`), or a plan (`StagePlan.split_at([...])`).")
    units, unit_inputs, to_cut = planning_units(module, example)
    groups = inputs.world_size // spec.pp_degree if spec.pp_degree else 1  # the global batch of the unsearched plan
    probe = loss_probe(module, inputs.step_fn, batch, units, unit_inputs, inputs.device)
    memory, sharding = inputs.placement.memory, inputs.sharding
    absent = sorted(set(memory or {}) - set(rank_kinds))
    if absent:
        raise PlacementError(f"`PlacementOptions(memory=...)` gives the memory of kind(s) {absent}, but the job's ranks "
                             f"are {sorted(set(rank_kinds))}. Name the ranks' kinds (see `device_map`).")
    refused = sharding_refusals(inputs.callbacks) if free_sharding else []
    mode = sharding.data_parallel if not free_sharding else "ddp" if refused else None
    try:
        plan, grid, table, chosen = auto_plan(
            units, unit_inputs, inputs.rank, rank_kinds, batch_size=batch_size_of(batch), device=inputs.device,
            data_groups=groups, pp_degree=spec.pp_degree, schedule=spec.schedule, n_microbatches=spec.n_microbatches,
            loss_probe=probe, profile_path=inputs.placement.profile, split_batches=inputs.split_batches and inputs.fitting,
            speeds=inputs.recorded_speeds() if inputs.fitting else None, memory_bytes=memory, data_parallel=mode,
            dp_replicate=sharding.dp_replicate, reshard_after_forward=bool(sharding.reshard_after_forward))
    except PartitionError as err:
        if not refused:
            raise
        raise PartitionError(f"{err} Sharded stages (data_parallel='fsdp'), which hold less per rank, were not tried: "
                             f"{'; '.join(refused)}.") from None
    rank_zero_info(f"HPPStrategy: plan='auto' chose\n{table}")
    chose = ShardingOptions(data_parallel=chosen.data_parallel) if free_sharding and chosen.data_parallel != "ddp" else None
    return ResolvedPlan(to_cut(plan), chosen.schedule, chosen.n_microbatches, split=chosen.dp_degree // groups, grid=grid,
                        pp_degree=chosen.pp_degree, sharding=chose)


def _in_stage_dtype(module: nn.Module, plan: StagePlan, example: tuple[tuple, dict] | None,
                    inputs: SetupInputs) -> tuple[tuple, dict] | None:
    """Where every stage keeps its parameters in one dtype other than fp32 (``bf16-true``, ``16-true``), cast the
    model and the example's floating inputs to it before the cut, as the stages will be: a trace burns in the
    dtype decisions of ``forward`` (a ``.to(x.dtype)`` it saw as a no-op in fp32), so it must see the model as it runs."""
    dtypes = {MODES[p].param_dtype for p in inputs.precision.stage_precisions(plan, inputs.trainer_precision)}
    if len(dtypes) != 1 or (dtype := dtypes.pop()) == torch.float32:
        return example
    module.to(dtype)
    if example is None:
        return None
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, example)


def _materialize(module: nn.Module, inputs: SetupInputs) -> None:
    """This rank's stages out of the meta device: their own initializers, or their tensors read from disk."""
    init = inputs.init
    seed = init.seed if init.seed is not None else inputs.default_seed
    n = materialize_stages(module, inputs.device, seed=seed, weights=init.weights, rename=init.rename)
    rank_zero_info(f"HPPStrategy: rank {inputs.rank} materialized its {n} parameters "
                   f"({'read from ' + init.weights if init.weights else 'their modules initializers'}).")
