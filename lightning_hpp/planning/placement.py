"""Placing stages on ranks by device kind, and ``plan="auto"`` on a running job.

Both run on every rank at setup, before the model is cut:

* :func:`gather_kinds` — the device kind of every rank (detected, or overridden by ``device_map`` /
  ``HPP_DEVICE_KIND``), gathered over the world;
* :func:`kind_grid` — the rank grid for a plan whose stages ask for device kinds;
* :func:`auto_plan` — profile the units on one rank of each kind (one real micro-batch), share the
  profiles, and let the exact partitioner choose cuts, kinds and precisions for these ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_hpp._dist import all_gather_object
from lightning_hpp.errors import PlacementError
from lightning_hpp.planning.devices import assign_ranks, detect_device_kind, precision_preference
from lightning_hpp.planning.plan import StagePlan


def gather_kinds(device: torch.device, rank: int, device_map: Any = None) -> list[str]:
    """Every rank's device kind, index = global rank (collective)."""
    kind = detect_device_kind(device, rank=rank, device_map=device_map)
    return all_gather_object(kind)


def kind_grid(plan: StagePlan, positions: list[list[int]], rank_kinds: list[str], pp: int, dp: int) -> list[list[int]] | None:
    """The ``grid[position][replica]`` of global ranks that honours the stages' ``device`` kinds.

    Args:
        plan: The resolved plan.
        positions: The stage indices held by each pipeline position.
        rank_kinds: Every rank's kind.
        pp, dp: Pipeline and data-parallel degrees.

    Returns:
        ``None`` when no stage asks for a kind (the default layout applies).

    Raises:
        PlacementError: kinds that are absent or too few (the message lists every rank's kind), or
            stages sharing a rank that ask for different kinds.
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
    return assign_ranks(position_kinds, rank_kinds, pp, dp)


def auto_plan(
    units: Sequence[tuple[str, nn.Module]],
    example_args: tuple,
    rank: int,
    rank_kinds: list[str],
    *,
    dp_degree: int,
    schedule: str,
    n_microbatches: int,
    profile_path: str | None = None,
    link_gbps: float | None = None,
) -> tuple[StagePlan, list[list[int]], str]:
    """Profile, partition and place for the ranks of this job (collective).

    The first rank of each kind measures every unit's forward+backward time and memory on the
    real micro-batch ``example_args`` in that kind's preferred precision (or the profile at
    ``profile_path`` is used); the profiles are merged on every rank, and every rank runs the same
    deterministic partitioner, so all ranks agree on the plan.

    Returns:
        The plan (with ``meta["predicted"]``), the rank grid ``grid[position][replica]`` and a table
        of the result for the log.
    """
    from lightning_hpp.planning.partition import DEFAULT_LINK_GBPS, plan_for_ranks
    from lightning_hpp.planning.profile import CostProfile, check_profile_matches, profile_units

    names = [n for n, _ in units]
    if profile_path is not None:
        profile = CostProfile.load(profile_path)
        check_profile_matches(profile, names)
    else:
        mine = None
        if rank == rank_kinds.index(rank_kinds[rank]):  # first rank of its kind
            kind = rank_kinds[rank]
            precision = next(p for p in precision_preference(kind) if p != "fp8")
            mine = profile_units(list(units), example_args, kind, precision=precision).to_dict()
        profile = None
        for part in all_gather_object(mine):
            if part is not None:
                p = CostProfile.from_dict(part)
                profile = p if profile is None else profile.merge(p)
        assert profile is not None
    result = plan_for_ranks(
        profile, rank_kinds, dp_degree=dp_degree, schedule=schedule, n_microbatches=n_microbatches,
        link_gbps=link_gbps if link_gbps is not None else DEFAULT_LINK_GBPS,
    )
    if not result.fits:
        raise PlacementError(f"plan='auto' found no placement that fits the devices' memory:\n{result.format_table()}")
    return result.plan, [list(row) for row in result.ranks], result.format_table()
