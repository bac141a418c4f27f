"""Profiles of several ranks: a kind's costs as the mean over the ranks that measured it, and a rank slower
than its kind (the straggler watch's recorded speed) planned as a kind of its own."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from dataclasses import fields

from lightning_hpp.errors import ProfileMismatchError
from lightning_hpp.planning.devices import normalize_kind
from lightning_hpp.planning.profile import CostProfile, Overheads, ProfileEntry

SPEED_TOLERANCE = 0.1
"""Recorded speeds within this of 1.0 leave a rank on its kind's measured costs."""


def with_rank_speeds(profile: CostProfile, rank_kinds: Sequence[str],
                     speeds: dict[int, float] | None) -> tuple[CostProfile, list[str]]:
    """The profile and rank kinds to plan with when some ranks run slower than their kind was measured.

    A rank whose recorded speed (the share of its kind's measured speed it has left, as the straggler watch
    records it in a checkpoint) differs from 1 by more than :data:`SPEED_TOLERANCE` gets a kind of its own,
    ``"<kind>-r<rank>"``, whose entries are its kind's with every time divided by the speed (unit forward,
    backward and fixed costs, and the per-micro-batch, per-step, loss and optimizer overheads; the link
    numbers stay). The planner then places stages on that rank as on a device of that speed.

    Args:
        profile: The measured (or loaded) profile.
        rank_kinds: Every rank's kind.
        speeds: ``{rank: speed}``; ``None`` or empty: nothing changes.

    Returns:
        ``(profile, kinds)``: a new profile with the derived entries, and every rank's kind to plan with.
    """
    kinds = list(rank_kinds)
    if not speeds:
        return profile, kinds
    out = copy.deepcopy(profile)
    for rank, speed in sorted(speeds.items()):
        if rank >= len(kinds) or abs(float(speed) - 1.0) <= SPEED_TOLERANCE or not speed > 0:
            continue
        base = rank_kinds[rank]
        derived = normalize_kind(f"{base}-r{rank}", "derived device kind")
        for entry in [e for e in profile.entries if e.device_kind == base]:
            slow = copy.deepcopy(entry)
            slow.device_kind = derived
            slow.source = f"{entry.source}, divided by the recorded speed {float(speed):.3f} of rank {rank}"
            for u in slow.units:
                u.fwd_ms, u.bwd_ms, u.fixed_ms = u.fwd_ms / speed, u.bwd_ms / speed, u.fixed_ms / speed
            if slow.overheads is not None:
                o = slow.overheads
                o.microbatch_ms, o.step_ms, o.loss_ms = o.microbatch_ms / speed, o.step_ms / speed, o.loss_ms / speed
                o.loss_fixed_ms, o.optimizer_ms_per_mb = o.loss_fixed_ms / speed, o.optimizer_ms_per_mb / speed
            out.add(slow)
        kinds[rank] = derived
    return out, kinds


def mean_over_ranks(parts: Sequence[CostProfile]) -> CostProfile:
    """Several ranks' profiles of the same units as one: a (kind, precision) entry that more than one rank
    measured gets the mean of their unit times (forward, backward, fixed part) and overheads; the bytes are
    the same on every rank, the other entries are taken as they are.

    Raises:
        ProfileMismatchError: no profiles, or profiles of different signatures.
    """
    if not parts:
        raise ProfileMismatchError("`mean_over_ranks` got no profiles.")
    out = copy.deepcopy(parts[0])
    for part in parts[1:]:
        out = out.merge(part)
    groups: dict[tuple[str, str], list[ProfileEntry]] = {}
    for part in parts:
        for entry in part.entries:
            groups.setdefault((entry.device_kind, entry.precision), []).append(entry)
    for entries in groups.values():
        if len(entries) < 2:
            continue
        mean = copy.deepcopy(entries[0])
        for i, u in enumerate(mean.units):
            u.fwd_ms = statistics.fmean(e.units[i].fwd_ms for e in entries)
            u.bwd_ms = statistics.fmean(e.units[i].bwd_ms for e in entries)
            u.fixed_ms = statistics.fmean(e.units[i].fixed_ms for e in entries)
        if all(e.overheads is not None for e in entries):
            for f in fields(Overheads):
                setattr(mean.overheads, f.name, statistics.fmean(getattr(e.overheads, f.name) for e in entries))
        mean.source = f"{mean.source}, mean of {len(entries)} ranks"
        out.add(mean)
    return out
