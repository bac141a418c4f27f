"""The pipeline schedules of ``torch.distributed.pipelining`` by name, how each places its stages on
ranks, and the checks a plan must pass to run under one.

:data:`SCHEDULE_NAMES` is the one list of schedule names: each of ours with torch's name for it. The
class comes from torch's registry (``get_schedule_class``); whether a rank holds several stages from
its base class (``PipelineScheduleMulti``); the placement style is the one fact torch keeps inside the
V schedules' ``__init__`` (``generate_stage_to_rank_mapping(..., style="v")``), so :data:`_V_STYLE`
says it here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from torch.distributed.pipelining import schedules as S

from lightning_hpp.errors import ScheduleError
from lightning_hpp.validation import check_int

SCHEDULE_NAMES: tuple[tuple[str, str], ...] = (
    ("gpipe", "GPipe"),
    ("1f1b", "1F1B"),
    ("interleaved1f1b", "Interleaved1F1B"),
    ("looped_bfs", "LoopedBFS"),
    ("interleaved_zb", "InterleavedZeroBubble"),
    ("zbv", "ZBVZeroBubble"),
    ("dualpipev", "DualPipeV"),
)
"""``(our name, torch's name)`` of every schedule, in the order they are listed to users."""

# torch has no data for the placement style: ZBVZeroBubble and DualPipeV set style="v" in __init__
_V_STYLE = frozenset({"ZBVZeroBubble", "DualPipeV"})


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule's class and how its stages are placed on ranks."""

    cls: type
    multi: bool  # several stages per rank
    style: str  # "loop" or "v" placement

    @property
    def stages_per_rank(self) -> int:
        """The stages a pipeline position holds by default: two for the several-stages-per-rank schedules."""
        return 2 if self.multi else 1


def _kind(torch_name: str) -> ScheduleKind:
    cls = S.get_schedule_class(torch_name)
    return ScheduleKind(cls, issubclass(cls, S.PipelineScheduleMulti), "v" if torch_name in _V_STYLE else "loop")


SCHEDULES: Mapping[str, ScheduleKind] = MappingProxyType({name: _kind(torch) for name, torch in SCHEDULE_NAMES})
"""Our name → :class:`ScheduleKind`, read-only, in the order of :data:`SCHEDULE_NAMES`."""


def schedule_kind(name: str) -> ScheduleKind:
    """The :class:`ScheduleKind` of schedule ``name``; :class:`ScheduleError` listing the valid names if unknown."""
    kind = SCHEDULES.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ScheduleError(f"Unknown schedule {name!r}. Valid schedules: {', '.join(SCHEDULES)}.")
    return kind


def check_schedule(name: str, num_stages: int, pp: int, n_microbatches: int) -> ScheduleKind:
    """Validate a schedule against the plan before any process group or step exists."""
    kind = schedule_kind(name)
    check_int(n_microbatches, "n_microbatches", error=ScheduleError)
    if kind.multi:
        if num_stages % pp or num_stages // pp < 2:
            single = ", ".join(repr(n) for n, k in SCHEDULES.items() if not k.multi)
            raise ScheduleError(
                f"Schedule {name!r} runs several stages per rank: the plan's {num_stages} stages must be a "
                f"multiple (>= 2x) of pp_degree={pp}. Use pp_degree={max(1, num_stages // 2)} or a plan with "
                f"{2 * pp} stages, or a single-stage schedule ({single})."
            )
        if kind.style == "v" and num_stages != 2 * pp:
            raise ScheduleError(
                f"Schedule {name!r} needs exactly 2 stages per rank (V placement); the plan has {num_stages} "
                f"stages for pp_degree={pp}. Use pp_degree={num_stages // 2} or a plan with {2 * pp} stages."
            )
        # torch's interleaved schedules run the micro-batches in rounds of pp (checked again at construction)
        if issubclass(kind.cls, (S.ScheduleInterleaved1F1B, S.ScheduleInterleavedZeroBubble)):
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
    if issubclass(kind.cls, (S.Schedule1F1B, S.ScheduleDualPipeV)) and n_microbatches < num_stages:
        raise ScheduleError(
            f"Schedule {name!r} needs at least as many micro-batches as stages: n_microbatches={n_microbatches} "
            f"< {num_stages} stages. Set `n_microbatches` >= {num_stages}, or use 'gpipe'."
        )
    return kind


class ForwardOnlyV(S.ScheduleZBVZeroBubble):
    """Forward-only passes (evaluation, prediction) for the V placement of ``zbv`` and ``dualpipev``.

    Our own because torch's V schedules run their backward actions even without a loss (forward-only they
    fail: "can't steal_bwd_input if this stage doesn't have backward"), and DualPipeV wants at least as many
    micro-batches as stages. Each rank runs its first stage's forwards, then its second's, for any number
    of micro-batches; torch adds the sends and receives (none between the two stages of the V's tip).
    """

    def _calculate_single_rank_operations(self, rank: int) -> list[S._Action | None]:
        stages = (rank, 2 * self.pp_group_size - 1 - rank)
        return [S._Action(k, S._ComputationType.FORWARD, mb) for k in stages for mb in range(self._n_microbatches)]

    def _prepare_schedule_with_comms(
        self, actions: dict[int, list[S._Action | None]], format: str = "compute_only"
    ) -> None:
        # torch's lowering of a compute-only order to sends and receives, less its check that every forward
        # has a backward (there is none here) and the passes for FSDP units and gradient reduction
        self.stage_index_to_group_rank = S.generate_stage_to_rank_mapping(
            self.pp_group_size, self._num_stages, style="v"
        )
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.pipeline_order_with_comms = S._add_send_recv(
            {rank: [a for a in acts if a is not None] for rank, acts in actions.items()},
            stage_to_rank=lambda k: self.stage_index_to_group_rank[k],
            num_stages=self._num_stages,
        )
