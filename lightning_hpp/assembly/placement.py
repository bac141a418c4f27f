"""Placing stages on ranks by device kind, and ``plan="auto"`` on a running job (moved here from
``lightning_hpp.planning.placement``: it runs the user's step, so it sits above the pipeline layer).

Both run on every rank at setup, before the model is cut:

* :func:`gather_kinds` — the device kind of every rank (detected, or overridden by ``device_map`` /
  ``HPP_DEVICE_KIND``), gathered over the world; :func:`gather_hosts` — every rank's host;
* :func:`kind_grid` — the rank grid for a plan whose stages ask for device kinds (tensor-parallel groups of
  neighbouring ranks of one kind);
* :func:`auto_plan` — profile the units and the step's overheads on every rank at once, each on its
  device, share the profiles (a kind's costs: the mean over its ranks), and search the whole plan
  (pp x dp_replicate x dp_shard x tp, micro-batches, schedule, cuts, kinds) for these ranks.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpp import _dist
from lightning_hpp._dist import all_gather_object
from lightning_hpp.errors import MicroBatchError, PlacementError
from lightning_hpp.pipeline.dims import ParallelDims
from lightning_hpp.pipeline.microbatch import batch_size_of, split_batch
from lightning_hpp.pipeline.steps import extract_loss, no_log, redirected, replay_forward
from lightning_hpp.planning import calibrate
from lightning_hpp.planning.cluster import DEFAULT_LINK_GBPS
from lightning_hpp.planning.devices import assign_ranks, detect_device_kind, precision_preference, tp_group_kinds
from lightning_hpp.planning.measure import as_args, fit_fixed_costs, profile_units, to_device
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.planning.profile import CostProfile, Overheads, check_profile_matches
from lightning_hpp.planning.search import search_plan
from lightning_hpp.planning.speeds import mean_over_ranks, with_rank_speeds

if TYPE_CHECKING:
    from lightning_hpp.planning.result import PlanResult


def gather_kinds(device: torch.device, rank: int, device_map: Any = None) -> list[str]:
    """Every rank's device kind, index = global rank (collective)."""
    kind = detect_device_kind(device, rank=rank, device_map=device_map)
    return all_gather_object(kind)


def gather_hosts() -> list[str]:
    """Every rank's host name, index = global rank (collective): a tensor-parallel group ``plan="auto"`` chooses
    stays on one host."""
    return all_gather_object(socket.gethostname())


def kind_grid(plan: StagePlan, positions: list[list[int]], rank_kinds: list[str],
              dims: ParallelDims) -> list[list[int]] | None:
    """The ``grid[position][replica · tp + tp_rank]`` of global ranks that honours the stages' ``device`` kinds.

    Args:
        plan: The resolved plan.
        positions: The stage indices held by each pipeline position.
        rank_kinds: Every rank's kind.
        dims: The job's degrees; a replica's ``tp`` ranks are neighbours of one kind.

    Returns:
        ``None`` when no stage asks for a kind (the default layout applies).

    Raises:
        PlacementError: kinds that are absent or too few (the message lists every rank's kind), stages
            sharing a rank that ask for different kinds, or a tensor-parallel group of mixed kinds.
    """
    if all(s.device is None for s in plan.stages):
        return None
    position_kinds: list[str | None] = []
    for r, stages in enumerate(positions):
        wanted = {plan.stages[k].device for k in stages} - {None}
        if len(wanted) > 1:
            raise PlacementError(
                f"Stages {stages} share pipeline position {r} but ask for device kinds {sorted(wanted)}; stages "
                f"that run on one rank must ask for the same kind (or none)."
            )
        position_kinds.append(next(iter(wanted), None))
    groups = tp_group_kinds(rank_kinds, dims.tp)
    return dims.expand_tp(assign_ranks(position_kinds, groups, dims.pp, dims.dp))


def auto_plan(
    units: Sequence[tuple[str, nn.Module]],
    example_args: tuple,
    rank: int,
    rank_kinds: list[str],
    *,
    batch_size: int,
    device: torch.device,
    data_groups: int = 1,
    pp_degree: int | None = None,
    schedule: str | None = None,
    n_microbatches: int | None = None,
    loss_probe: Callable[[int], Callable[[], Any]] | None = None,
    profile_path: str | None = None,
    link_gbps: float | None = None,
    split_batches: bool = True,
    speeds: dict[int, float] | None = None,
    memory_bytes: dict[str, float] | None = None,
    data_parallel: str | None = "ddp",
    dp_replicate: int | None = None,
    reshard_after_forward: bool = False,
    tp_degree: int | None = 1,
    tp_allowed: list[int] | None = None,
    tp_shape: tuple[list[float], list[list[int]]] | None = None,
    hosts: list[str] | None = None,
    tp_across_hosts: bool = False,
) -> tuple[StagePlan, list[list[int]], str, PlanResult]:
    """Profile, then search the whole plan for the ranks of this job (collective).

    Every rank measures at once, on its own ``device``, every unit's forward+backward time
    and memory at two micro-batch sizes (the largest a plan can use, ``example_args`` holding that
    many samples, and a small one), so each unit's time splits into a fixed part per micro-batch
    and a part per sample; plus the overheads of :mod:`~lightning_hpp.planning.calibrate` (the
    schedule's per micro-batch and per step, the optimizer, the loss through ``loss_probe``, a
    send/recv between ranks 0 and 1). A kind's costs are the mean over its ranks
    (:func:`~lightning_hpp.planning.speeds.mean_over_ranks`): measured with every other rank busy, as in
    training. The profiles are merged on every rank, and every rank runs the same deterministic
    :func:`~lightning_hpp.planning.search.search_plan`, so all ranks agree.

    Args:
        units: The planning units.
        example_args: Their input for one micro-batch of ``batch_size // n_microbatches`` samples
            (``batch_size`` when ``n_microbatches`` is not fixed).
        rank, rank_kinds: This rank and every rank's kind.
        batch_size, data_groups, pp_degree, schedule, n_microbatches: As for ``search_plan``.
        device: This rank's device (where its stages will run).
        loss_probe: ``loss_probe(b)`` returns a callable running the step's loss and its backward
            on ``b`` samples; ``None`` leaves the loss out of the model.
        profile_path: A cost profile to use instead of measuring (taken as it is).
        link_gbps: Link speed where nothing was measured.
        split_batches: Whether the loader's batches can be made smaller (more replicas than loader batches).
        speeds: Per-rank speeds recorded by the straggler watch (``{rank: share of its kind's speed}``): the
            search plans those ranks with their kind's costs divided by the speed
            (:func:`~lightning_hpp.planning.speeds.with_rank_speeds`); the profiling is as without them.
        memory_bytes: Memory per device by kind (the ranks' own kinds; a rank planned with its own speed
            keeps its kind's); default the datasheet's.
        data_parallel, dp_replicate, reshard_after_forward: As for ``search_plan``: the user's
            ``ShardingOptions``, or ``data_parallel=None`` (ddp, or fsdp where only sharded stages fit).
        tp_degree: The user's ``tp_degree``, or ``None``: searched among the profile's ``tp_degrees``.
        tp_allowed, tp_shape: The degrees the model's tensor-parallel plan divides, and what it splits of each
            unit (:func:`~lightning_hpp.pipeline.tensor_parallel.plan_shape`): recorded in the profile where it
            does not say (a profile file's own are kept).
        hosts, tp_across_hosts: Every rank's host, and whether a tensor-parallel group may span hosts.

    Returns:
        The plan (with ``meta["predicted"]`` and the profile it was made from in ``meta["profile"]``), the rank grid
        ``grid[position][replica]``, a table
        of the result for the log, and the search's result (schedule, micro-batches, degrees).
    """
    names = [n for n, _ in units]
    if profile_path is not None:
        profile = CostProfile.load(profile_path)
        check_profile_matches(profile, names)
    else:
        world = len(rank_kinds)
        lat, gbps = calibrate.p2p_costs(rank, world, device)
        # at the size of the gradients (within 4-256 MB): a few MB fit a CPU rank's quota or cache, the model's do not
        params = {id(p): p for _, unit in units for p in unit.parameters()}  # a tied weight once
        grad_bytes = sum(p.numel() * p.element_size() for p in params.values())
        ar_gbps = calibrate.allreduce_gbps(world, device, lat, nbytes=min(max(grad_bytes, 1 << 22), 1 << 28) // 4 * 4)
        # every rank at once: a rank measured with its neighbours idle finds shared caches, memory bandwidth
        # and cores to itself that training does not leave it (2 equal CPU cores: 1.2-1.4x faster)
        big = batch_size // (n_microbatches or 1)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # training draws as without it
            mine = _measure(units, example_args, rank_kinds[rank], device, big, loss_probe).to_dict()
        # on CPUs gloo sums the gradients on the cores the backward computes on: nothing of it hides
        mine["entries"][0]["overheads"].update(
            p2p_latency_ms=lat,
            p2p_gbps=gbps,
            allreduce_gbps=ar_gbps,
            allreduce_overlap=0.0 if device.type == "cpu" else 1.0,
        )
        profile = mean_over_ranks([CostProfile.from_dict(part) for part in all_gather_object(mine)])
    if profile.tp_degrees is None:
        profile.tp_degrees = list(tp_allowed) if tp_allowed is not None else None
    if profile.tp_split is None and tp_shape is not None:
        profile.tp_split, profile.tp_allreduces = tp_shape
    planned, plan_kinds = with_rank_speeds(profile, rank_kinds, speeds)
    memory = {p: memory_bytes[k] for p, k in zip(plan_kinds, rank_kinds) if k in memory_bytes} if memory_bytes else None
    result = search_plan(
        planned,
        plan_kinds,
        batch_size=batch_size,
        data_groups=data_groups,
        pp_degree=pp_degree,
        n_microbatches=n_microbatches,
        schedule=schedule,
        memory_bytes=memory,
        link_gbps=link_gbps if link_gbps is not None else DEFAULT_LINK_GBPS,
        split_batches=split_batches,
        data_parallel=data_parallel,
        dp_replicate=dp_replicate,
        reshard_after_forward=reshard_after_forward,
        tp_degree=tp_degree,
        hosts=hosts,
        tp_across_hosts=tp_across_hosts,
    )
    plan = result.plan
    plan.meta["profile"] = profile.to_dict()  # what the plan was made from: re-plan offline with search_plan
    if plan_kinds != list(rank_kinds):  # the derived kinds are the planner's alone: stages ask for the ranks' own kinds
        base = dict(zip(plan_kinds, rank_kinds))
        plan = StagePlan([dataclasses.replace(s, device=base.get(s.device, s.device)) for s in plan.stages], plan.meta)
    if speeds:
        plan.meta["rank_speeds"] = {str(r): float(v) for r, v in sorted(speeds.items())}
    return plan, [list(row) for row in result.ranks], result.format_table(), result


def _measure(
    units: Sequence[tuple[str, nn.Module]],
    example_args: tuple,
    kind: str,
    device: torch.device,
    big: int,
    loss_probe: Callable[[int], Callable[[], Any]] | None,
):
    """This kind's profile entry at micro-batch ``big`` with fixed costs and overheads."""
    precision = next(p for p in precision_preference(kind) if p != "fp8")
    profile = profile_units(list(units), example_args, kind, precision=precision, device=device)
    small = max(1, big // 16)
    while big % small:
        small -= 1
    if small < big:
        try:
            few = split_batch(tuple(example_args), big // small)[0]
            profile = fit_fixed_costs(
                profile, profile_units(list(units), few, kind, precision=precision, device=device)
            )
        except (MicroBatchError, RuntimeError, TypeError) as err:  # inputs without a common batch dim, a traced shape
            profile.meta["fixed_ms"] = f"not measured: {err}"
    per_mb, per_step = 0.0, 0.0
    if _dist.initialized():  # torch pipelining needs a process group: this rank alone
        alone = _dist.new_group([dist.get_rank()], use_local_synchronization=True)
        per_mb, per_step = calibrate.schedule_overheads(device, alone)
    loss_ms, loss_fixed = calibrate.loss_costs(loss_probe, small, big, device) if loss_probe is not None else (0.0, 0.0)
    profile.entries[0].overheads = Overheads(
        microbatch_ms=per_mb,
        step_ms=per_step,
        loss_ms=loss_ms,
        loss_fixed_ms=loss_fixed,
        optimizer_ms_per_mb=calibrate.optimizer_ms_per_mb(device),
    )
    return profile


def loss_probe(
    module: nn.Module,
    step_fn: Callable[..., Any],
    batch: Any,
    units: Sequence[tuple[str, nn.Module]],
    inputs: tuple,
    device: torch.device,
) -> Callable[[int], Callable[[], Any]]:
    """``probe(b)``: a callable running the user's step on ``b`` samples of ``batch`` with ``self(...)``
    returning the last unit's output (computed once, without gradients), and the loss's backward, on ``device``.

    This is what the last stage adds to its units per micro-batch: the loss, the metrics and logging
    of ``training_step`` (logging is discarded here).
    """
    size = batch_size_of(batch)
    name = getattr(step_fn, "__name__", "training_step")

    def probe(b: int) -> Callable[[], Any]:
        parts = size // b
        micro = to_device(split_batch(batch, parts)[0], device)
        x = as_args(split_batch(tuple(inputs), batch_size_of(inputs) // b)[0])
        with torch.no_grad(), torch.random.fork_rng():
            for _, unit in units:
                x = as_args(unit(*x))
        out = to_device(x[0] if len(x) == 1 else x, device)
        out = out.detach().requires_grad_(out.is_floating_point()) if isinstance(out, torch.Tensor) else out

        def run() -> None:
            with redirected(module, replay_forward(out, name), no_log):
                loss = extract_loss(step_fn(micro, 0), name)
            if loss.requires_grad:
                loss.backward()

        return run

    return probe
