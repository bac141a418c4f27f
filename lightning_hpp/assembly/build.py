"""Assembling this rank's pipeline: :func:`build_pipeline`, one function from (module, spec, options,
this rank) to a frozen :class:`Pipeline`.

In order, on every rank together (the collectives are marked):

1. rank 0's parameters and buffers on every rank (collective, as DDP starts; a meta model's stages are
   initialised alike on every rank instead), the ranks' device kinds (collective) and the plan, resolved once
   (:func:`resolve_plan`): ``plan="auto"``
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
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.seed import isolate_rng
from torch import nn

from lightning_hpp import liveness
from lightning_hpp._dist import all_gather_object, broadcast_tensors
from lightning_hpp.assembly.compose import refuse_stage_precisions, sharding_refusals
from lightning_hpp.assembly.placement import auto_plan, gather_hosts, gather_kinds, kind_grid, loss_probe
from lightning_hpp.assembly.reuse import hold, pipeline_key
from lightning_hpp.assembly.spec import DEFAULT_MICROBATCHES, DEFAULT_SCHEDULE, PipelineSpec, ResolvedPlan
from lightning_hpp.errors import PartitionError, PlacementError, PlanError
from lightning_hpp.model.frontend import balanced_plan, block_names, cut_model, planning_units
from lightning_hpp.model.materialize import fake_parameters, has_meta_parameters, materialize_stages
from lightning_hpp.model.units import find_units
from lightning_hpp.options import InitOptions, PlacementOptions, ShardingOptions
from lightning_hpp.pipeline.compile import compile_blocks, compile_options, eager
from lightning_hpp.pipeline.fsdp import ShardedStages, shard_stages
from lightning_hpp.pipeline.grads import GradHandover, held_by_name, shared_gradient_groups, tied_aliases
from lightning_hpp.pipeline.loss import LossWeights
from lightning_hpp.pipeline.mesh import Mesh, stages_of_position
from lightning_hpp.pipeline.microbatch import batch_size_of, split_batch
from lightning_hpp.pipeline.runner import PipelineRunner
from lightning_hpp.pipeline.schedules import check_schedule
from lightning_hpp.pipeline.stage import StageModule
from lightning_hpp.pipeline.steps import capture_input, dry_run, second_call_error
from lightning_hpp.pipeline.tensor_parallel import (
    at_local_width,
    check_frontend,
    plan_shape,
    resolve_tp_plan,
    split_stages,
    tp_degrees,
)
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
        precision: The precision plugin the stages were set up with.
        key: What the pipeline was built from (:func:`lightning_hpp.assembly.reuse.pipeline_key`): a later
            strategy on the same, already cut module continues with it where it asks for the same.
        aliases: Every name of each parameter several stages share (a tied weight), by the name the plan knows.
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
    precision: HPPPrecision
    key: tuple = ()
    aliases: dict[str, list[str]] = field(default_factory=dict)

    @property
    def device_kind(self) -> str:
        """This rank's device kind."""
        return self.rank_kinds[self.mesh.rank]

    def place(self, device: torch.device) -> None:
        """The module and its stages on ``device`` again, for an entry point that reuses this pipeline: Lightning's
        ``Strategy.teardown`` moved the module to the CPU when the previous one ended (a traced stage's own
        constants, and the ops its trace burnt a device into, follow)."""
        self.module.to(device)
        runner = self.runner
        for sm in {id(sm): sm for sm in (*runner.stage_modules.values(), *runner.eval_stage_modules.values())}.values():
            for body in sm.units:
                if hasattr(body, "place"):
                    body.place(device)


def build_pipeline(module: nn.Module, spec: PipelineSpec, inputs: SetupInputs) -> Pipeline:
    """Resolve the plan, cut ``module``, build the groups and keep only this rank's stages (collective).

    Raises:
        PlanError: a plan, schedule or layout that cannot run on this job (the same on every rank).
    """
    world, device = inputs.world_size, inputs.device
    key = pipeline_key(spec, inputs)
    free_sharding = inputs.sharding is None  # plan="auto" may shard the stages where only that fits
    inputs = dataclasses.replace(inputs, sharding=inputs.sharding or ShardingOptions())
    if spec.pp_degree is not None:  # the sizes, before the plan is resolved
        inputs.sharding.dims(world, spec.pp_degree)
    inputs.placement.check_world(world)
    rank_kinds = gather_kinds(device, inputs.rank, inputs.placement.device_map)
    meta = has_meta_parameters(module)
    if not meta:  # as DDP does: every replica (and every stage's copy of a shared weight) starts from rank 0's model
        broadcast_tensors([t for t in (*module.parameters(), *module.buffers()) if t is not None], src=0)
    with fake_parameters(module, device) if meta else contextlib.nullcontext():
        # the checks run the whole model, which stays where it is until it is cut (a meta model's stand-ins are on
        # `device`)
        home = next((p.device for p in module.parameters()), device)
        batch = None if inputs.batch is None else move_data_to_device(inputs.batch, home)
        resolved, example = resolve_plan(module, spec, inputs, batch, rank_kinds, free_sharding=free_sharding)
        replayed = replayed_steps(module, spec.step_replay, batch, resolved.split * resolved.n_microbatches)
        if resolved.sharding is not None:  # the same on every rank: every rank ran the same search
            inputs = dataclasses.replace(inputs, sharding=resolved.sharding)
        tp = inputs.sharding.tp_degree
        tp_plan = resolve_tp_plan(module, tp) if tp > 1 else None
        example = _in_stage_dtype(module, resolved.plan, example, inputs)
        # both modes whatever the entry point: a pipeline built by `validate()` is the one a later `fit()` trains
        with (
            at_local_width(module, tp_plan, tp) if tp_plan is not None else contextlib.nullcontext(),
            eager(module) as compiled_by_user,
        ):
            cut = cut_model(module, resolved.plan, example, frontend=spec.frontend, modes=("train", "eval"))
    if tp_plan is not None:
        check_frontend(tp_plan, cut.frontend, type(module).__name__)
    plan = cut.plan
    pp = resolved.pp(plan)
    origin = None if resolved.pp_degree is not None else f"The plan has {plan.num_stages} stages"
    dims = inputs.sharding.dims(world, pp, origin)
    check_schedule(resolved.schedule, plan.num_stages, pp, resolved.n_microbatches)
    refuse_stage_precisions(inputs.sharding, inputs.precision.stage_precisions(plan, inputs.trainer_precision))
    positions = [stages_of_position(r, pp, plan.num_stages, resolved.kind.style) for r in range(pp)]
    grid = resolved.grid if resolved.grid is not None else kind_grid(plan, positions, rank_kinds, dims)
    mesh = Mesh.build(dims, inputs.rank, grid)
    plan.meta["device_kinds"] = rank_kinds
    mesh.init_groups(device_type=device.type)
    module._device_mesh = mesh.device_mesh  # what `LightningModule.device_mesh` reads, as under ModelParallelStrategy
    stage_ids = positions[mesh.position]
    liveness.set_role(grid=mesh.grid, stages=positions, tp=mesh.tp, step=inputs.global_step)  # named in heartbeats
    options = compile_options(spec.compile)
    # FSDP2's units and what is compiled, named before the cut drops any
    blocks = block_names(module) if inputs.sharding.sharded or options is not None else []
    aliases = tied_aliases(module, cut.shared)  # before the cut drops the units some of the names live in
    cut.keep_only(module, stage_ids)
    bodies = [b for mode in ("train", "eval") for k in stage_ids for b in cut.bodies[mode][k]]
    traced = cut.frontend == "traced"
    recompute = [
        spec.activation_checkpointing if s.activation_checkpointing is None else s.activation_checkpointing
        for s in plan.stages
    ]
    stages = {
        mode: {
            k: StageModule(
                plan.stages[k].modules,
                cut.bodies[mode][k],
                k,
                spread=cut.spread[k],
                captured=traced,
                checkpoint_activations=recompute[k],
            )
            for k in stage_ids
        }
        for mode in ("train", "eval")
    }
    if cut.frontend == "sequential":
        stages["eval"] = stages["train"]
    if tp_plan is not None:  # before materializing: a meta model's ranks then materialize (and read) only their shards
        split = split_stages(
            module, [*stages["train"].values(), *stages["eval"].values()], tp_plan, mesh.device_mesh["tp"]
        )
        plan.meta["tensor_parallel"] = {"degree": tp, "plan": tp_plan.source, "split": split}
    if has_meta_parameters(module):
        _materialize(module, inputs)
    module.to(device)
    for body in bodies:
        # traced stages: their own constants, and the ops that create tensors, on this device
        if hasattr(body, "place"):
            body.place(device)
    weights = None if spec.loss_weight is None else LossWeights(spec.loss_weight, mesh.dp_group, mesh.dp)
    runner = PipelineRunner(
        module,
        stages["train"],
        plan.num_stages,
        mesh,
        resolved.schedule,
        resolved.n_microbatches,
        device,
        eval_stage_modules=stages["eval"],
        flatten=cut.flatten,
        unflatten=cut.unflatten,
        loss_weights=weights,
    )
    repeated = {k: {n for n, ks in cut.shared.items() if k in ks and min(ks) < k} for k in stage_ids}
    view = StageView(
        stages["train"],
        eval_stages=stages["eval"],
        pp_group=mesh.pp_group if pp > 1 else None,
        dp_group=mesh.dp_group,
        microbatch=runner.current_microbatch,
        step=inputs.global_step,
        step_checks=runner.step_checks,
        repeated_names=repeated,
        named_parameters=lambda: dict(module.named_parameters()),
        rank=inputs.rank,
        stage_ranks={k: sorted(mesh.replica_ranks(r)) for r, ks in enumerate(positions) for k in ks},
        recompute=recompute,
    )
    inputs.precision.configure_stages(plan, view, inputs.trainer_precision, device, rank_kinds[inputs.rank])
    to_compile = [*(blocks if options is not None else []), *compiled_by_user]
    if to_compile:  # after tensor parallel and the precisions, before FSDP2 (torchtitan's order)
        plan.meta["compiled"] = compile_blocks(stages["train"], to_compile, module, options or {})
    runner.sharded = _shard(module, plan, stages["train"], mesh, inputs, blocks if inputs.sharding.sharded else [])
    if runner.sharded is not None:
        view.shard_group = mesh.dp_shard_group
    # after sharding: the parameters several stages use are the ones the stages hold now (shards, under FSDP2)
    shared = shared_gradient_groups(cut.shared, held_by_name(module, aliases), positions, mesh)
    # FSDP2 reduces a sharded stage's gradients itself (reduce-scatter, and all-reduce over hsdp's replicas)
    grads = GradHandover(
        stages["train"],
        None if runner.sharded else mesh.dp_group,
        1 if runner.sharded else mesh.dp,
        shared=shared,
        ties=runner.sharded.ties if runner.sharded else (),
    )
    runner.last_backward_window = grads.last_backward
    runner.replayed_steps = replayed
    rank_zero_info(
        f"HPPStrategy: {plan.num_stages} stages, frontend={cut.frontend} ({cut.reason}), schedule={resolved.schedule}, "
        f"n_microbatches={resolved.n_microbatches}, pp={pp} × dp={mesh.dp}"
        + (
            f" ({inputs.sharding.data_parallel}: dp_replicate={mesh.dp_replicate} × dp_shard={mesh.dp_shard})"
            if runner.sharded
            else ""
        )
        + (f" × tp={tp} ({tp_plan.source})" if tp_plan else "")
        + (f", shared parameters {sorted(cut.shared)}" if cut.shared else "")
        + (
            f", replayed on every rank (they change the module's state): {sorted(replayed)}"
            if replayed and pp > 1
            else ""
        )
        + (f", torch.compile on {plan.meta['compiled']}" if plan.meta.get("compiled") else "")
        + f"\n{plan.table()}"
    )
    return hold(
        module,
        Pipeline(
            module=module,
            plan=plan,
            mesh=mesh,
            stage_ids=tuple(stage_ids),
            schedule=resolved.schedule,
            n_microbatches=resolved.n_microbatches,
            split=resolved.split,
            frontend=cut.frontend,
            reason=cut.reason,
            rank_kinds=tuple(rank_kinds),
            runner=runner,
            grads=grads,
            precision=inputs.precision,
            key=key,
            aliases=aliases,
        ),
    )


def _shard(
    root: nn.Module, plan: StagePlan, stages: dict[int, StageModule], mesh: Mesh, inputs: SetupInputs, blocks: list[str]
) -> ShardedStages | None:
    """FSDP2 on this rank's training stages when ``ShardingOptions`` asks for it (collective over the shard
    groups), after the precision plugin cast them to their stages' dtypes; ``None`` for unsharded stages. Each
    of the model's ``blocks`` and each unit of the plan a stage holds is sharded on its own (FSDP2 gathers one
    group at a time).

    """
    sharding = inputs.sharding
    if not sharding.sharded:
        return None
    return shard_stages(
        root,
        stages,
        {k: [*blocks, *plan.stages[k].modules] for k in stages},
        mesh.shard_mesh,
        sharding.reshard_after_forward,
    )


def resolve_plan(
    module: nn.Module,
    spec: PipelineSpec,
    inputs: SetupInputs,
    batch: Any,
    rank_kinds: list[str],
    free_sharding: bool = False,
) -> tuple[ResolvedPlan, tuple[tuple, dict] | None]:
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
            n = spec.pp_before_setup(inputs.world_size, None, inputs.sharding.tp_degree) * spec.kind.stages_per_rank
            if n == 1:  # one process, or pp_degree=1: the whole model is one stage, data parallel over the ranks
                plan = StagePlan([StageSpec(modules=[name for name, _ in find_units(module)])])
            else:
                plan = balanced_plan(module, n)
                rank_zero_info(
                    f"HPPStrategy: no plan given; {plan.meta['balanced']}: cut at {plan.meta['cut_points']}."
                )
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
                f"the loader's. Give a batch of {batch_size_of(batch)} samples at the length to plan for."
            )
    if chosen is not None:
        shapes = [tuple(t.shape) for t in pytree.tree_leaves(chosen) if isinstance(t, torch.Tensor)]
        source = "PlacementOptions(profile_batch=...)" if given is not None else "the training loader's first batch"
        rank_zero_info(f"HPPStrategy: plan='auto' profiles on a batch of shapes {shapes} ({source}).")
    return chosen


def example_call(
    module: nn.Module, step_fn: Callable[..., Any], batch: Any, parts: int, at_least_two: bool = True
) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of the step's ``self(...)`` call on one micro-batch (``1 / parts`` of ``batch``), RNG
    untouched.

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
        batch = _micro_batch(batch, parts)
        if dry_run(module, step_fn, batch, 0).calls > 1:
            raise second_call_error(step_fn.__name__)
        return capture_input(module, step_fn, batch, 0)


def _micro_batch(batch: Any, parts: int) -> Any:
    try:
        return split_batch(batch, parts)[0]
    except PlanError:
        return batch  # an indivisible batch is reported by the first step, with its size


STEPS = ("training_step", "validation_step", "test_step", "predict_step")


def replayed_steps(module: nn.Module, mode: str, batch: Any, parts: int) -> frozenset[str]:
    """The steps every rank of the pipeline replays with the last stage's outputs (``HPPStrategy(step_replay=...)``;
    collective): with ``"auto"`` those of the module's steps that change its state when run once on one micro-batch
    (``1 / parts`` of ``batch``; every step where there is no batch), agreed over the ranks (replicas see other
    batches); the state is put back after each run."""
    steps = [name for name in STEPS if is_overridden(name, module)]
    if mode == "last_stage":
        return frozenset()
    if mode == "every_rank" or batch is None:
        return frozenset(steps)
    micro = _micro_batch(batch, parts)
    with isolate_rng():
        mine = {name for name in steps if dry_run(module, getattr(module, name), micro, 0).changes_state}
    return frozenset().union(*all_gather_object(sorted(mine)))


def _auto_plan(
    module: nn.Module,
    spec: PipelineSpec,
    inputs: SetupInputs,
    batch: Any,
    example: tuple | None,
    rank_kinds: list[str],
    free_sharding: bool,
) -> ResolvedPlan:
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
        raise PlanError(
            "plan='auto' measures the model, but it was built on the meta device (no weights yet). Pass a "
            "cost profile (`HPPStrategy(placement=PlacementOptions(profile=...))`, see "
            "`python -m lightning_hpp.planning.cli`), or a plan (`StagePlan.split_at([...])`)."
        )
    units, unit_inputs, to_cut = planning_units(module, example)
    # the global batch of the unsearched plan: the loader's batch on each of its replicas
    groups = inputs.sharding.dims(inputs.world_size, spec.pp_degree).dp if spec.pp_degree else 1
    probe = loss_probe(module, inputs.step_fn, batch, units, unit_inputs, inputs.device)
    memory, sharding = inputs.placement.memory, inputs.sharding
    absent = sorted(set(memory or {}) - set(rank_kinds))
    if absent:
        raise PlacementError(
            f"`PlacementOptions(memory=...)` gives the memory of kind(s) {absent}, but the job's ranks "
            f"are {sorted(set(rank_kinds))}. Name the ranks' kinds (see `device_map`)."
        )
    refused = sharding_refusals(inputs.callbacks) if free_sharding else []
    mode = sharding.data_parallel if not free_sharding else "ddp" if refused else None
    # tensor parallel: the degree given, or (nothing given) every degree the model's plan divides, searched
    allowed = tp_degrees(module, inputs.world_size) if free_sharding else [sharding.tp_degree]
    tp_plan = next((resolve_tp_plan(module, t) for t in allowed if t > 1), None)
    shape = plan_shape(module, [n for n, _ in units], tp_plan) if tp_plan is not None else None
    hosts = gather_hosts()
    try:
        plan, grid, table, chosen = auto_plan(
            units,
            unit_inputs,
            inputs.rank,
            rank_kinds,
            batch_size=batch_size_of(batch),
            device=inputs.device,
            data_groups=groups,
            pp_degree=spec.pp_degree,
            schedule=spec.schedule,
            n_microbatches=spec.n_microbatches,
            loss_probe=probe,
            profile_path=inputs.placement.profile,
            split_batches=inputs.split_batches and inputs.fitting,
            speeds=inputs.recorded_speeds() if inputs.fitting else None,
            memory_bytes=memory,
            data_parallel=mode,
            dp_replicate=sharding.dp_replicate,
            reshard_after_forward=bool(sharding.reshard_after_forward),
            tp_degree=None if free_sharding else sharding.tp_degree,
            tp_allowed=allowed,
            tp_shape=shape,
            hosts=hosts,
            tp_across_hosts=inputs.placement.tp_across_hosts,
        )
    except PartitionError as err:
        if not refused:
            raise
        raise PartitionError(
            f"{err} Sharded stages (data_parallel='fsdp'), which hold less per rank, were not tried: "
            f"{'; '.join(refused)}."
        ) from None
    rank_zero_info(f"HPPStrategy: plan='auto' chose\n{table}")
    chose = None
    if free_sharding and (chosen.data_parallel != "ddp" or chosen.tp_degree > 1):
        chose = ShardingOptions(data_parallel=chosen.data_parallel, tp_degree=chosen.tp_degree)
    return ResolvedPlan(
        to_cut(plan),
        chosen.schedule,
        chosen.n_microbatches,
        split=chosen.dp_degree // groups,
        grid=grid,
        pp_degree=chosen.pp_degree,
        sharding=chose,
    )


def _in_stage_dtype(
    module: nn.Module, plan: StagePlan, example: tuple[tuple, dict] | None, inputs: SetupInputs
) -> tuple[tuple, dict] | None:
    """Where every stage keeps its parameters in one dtype other than fp32 (``bf16-true``, ``16-true``), cast the
    model and the example's floating inputs to it before the cut, as the stages will be: a trace burns in the
    dtype decisions of ``forward`` (a ``.to(x.dtype)`` it saw as a no-op in fp32), so it must see the model as it
    runs."""
    dtypes = {MODES[p].param_dtype for p in inputs.precision.stage_precisions(plan, inputs.trainer_precision)}
    if len(dtypes) != 1 or (dtype := dtypes.pop()) == torch.float32:
        return example
    module.to(dtype)
    if example is None:
        return None
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, example
    )


def _materialize(module: nn.Module, inputs: SetupInputs) -> None:
    """This rank's stages out of the meta device: their own initializers, or their tensors read from disk."""
    init = inputs.init
    seed = init.seed if init.seed is not None else inputs.default_seed
    n = materialize_stages(module, inputs.device, seed=seed, weights=init.weights, rename=init.rename)
    rank_zero_info(
        f"HPPStrategy: rank {inputs.rank} materialized its {n} parameters "
        f"({'read from ' + init.weights if init.weights else 'their modules initializers'})."
    )
