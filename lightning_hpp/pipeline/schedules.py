"""The pipeline schedules of ``torch.distributed.pipelining`` by name, how each places its stages on
ranks, and the checks a plan must pass to run under one.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import schedules as S

from lightning_hpp.errors import ScheduleError


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule name and how its stages are placed on ranks."""

    cls: type
    multi: bool  # several stages per rank
    style: str  # "loop" or "v" placement


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(S.ScheduleGPipe, False, "loop"),
    "1f1b": ScheduleKind(S.Schedule1F1B, False, "loop"),
    "interleaved1f1b": ScheduleKind(S.ScheduleInterleaved1F1B, True, "loop"),
    "looped_bfs": ScheduleKind(S.ScheduleLoopedBFS, True, "loop"),
    "interleaved_zb": ScheduleKind(S.ScheduleInterleavedZeroBubble, True, "loop"),
    "zbv": ScheduleKind(S.ScheduleZBVZeroBubble, True, "v"),
    "dualpipev": ScheduleKind(S.ScheduleDualPipeV, True, "v"),
}


def check_schedule(name: str, num_stages: int, pp: int, n_microbatches: int) -> ScheduleKind:
    """Validate a schedule against the plan before any process group or step exists."""
    if name not in SCHEDULES:
        raise ScheduleError(f"Unknown schedule {name!r}. Valid schedules: {', '.join(SCHEDULES)}.")
    kind = SCHEDULES[name]
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ScheduleError(f"`n_microbatches` must be a positive integer, got {n_microbatches!r}.")
    if kind.multi:
        if num_stages % pp or num_stages // pp < 2:
            raise ScheduleError(
                f"Schedule {name!r} runs several stages per rank: the plan's {num_stages} stages must be a "
                f"multiple (>= 2x) of pp_degree={pp}. Use pp_degree={max(1, num_stages // 2)} or a plan with "
                f"{2 * pp} stages, or a single-stage schedule ('gpipe', '1f1b')."
            )
        if kind.style == "v" and num_stages != 2 * pp:
            raise ScheduleError(
                f"Schedule {name!r} needs exactly 2 stages per rank (V placement); the plan has {num_stages} "
                f"stages for pp_degree={pp}. Use pp_degree={num_stages // 2} or a plan with {2 * pp} stages."
            )
        if name in ("interleaved1f1b", "interleaved_zb"):
            rounds = max(1, n_microbatches // pp)
            if n_microbatches % rounds:
                raise ScheduleError(
                    f"Schedule {name!r} needs n_microbatches to be a multiple of the number of rounds "
                    f"({rounds} for pp_degree={pp}); got n_microbatches={n_microbatches}. Use a multiple of {pp}."
                )
    elif num_stages != pp:
        raise ScheduleError(
            f"Schedule {name!r} runs one stage per rank, but the plan has {num_stages} stages and "
            f"pp_degree={pp}. Set pp_degree={num_stages}, or use 'interleaved1f1b' for several stages per rank."
        )
    if name in ("1f1b", "dualpipev") and n_microbatches < num_stages:
        raise ScheduleError(
            f"Schedule {name!r} needs at least as many micro-batches as stages: n_microbatches={n_microbatches} "
            f"< {num_stages} stages. Set `n_microbatches` >= {num_stages}, or use 'gpipe'."
        )
    return kind
