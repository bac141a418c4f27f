"""The pp × dp world layout: which global rank holds which pipeline position of which replica.

``grid[r][d]`` is the global rank at pipeline position ``r`` of data-parallel replica ``d``. The
default is pipeline-outer (``grid[r][d] = r * dp + d``), so the ranks that hold one stage are
contiguous — on a cluster whose nodes are one device kind each, a stage stays on one node kind.

Which virtual stages live on pipeline position ``r`` follows torch's placement styles: ``"loop"``
(stage ``s`` on position ``s % pp``) or ``"v"`` (stages ``r`` and ``2·pp − 1 − r``).

::

    pp=2, dp=2, 4 stages, style "loop"        grid        stages on each position
        replica 0: rank 0 -> rank 2            r=0: [0, 1]   r=0: stages 0, 2
        replica 1: rank 1 -> rank 3            r=1: [2, 3]   r=1: stages 1, 3
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_hpp.errors import PlanError


def stages_of_position(position: int, pp: int, num_stages: int, style: str) -> list[int]:
    """The virtual stage indices held by pipeline position ``position``, ascending."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(pp, num_stages, style=style)
    return sorted(s for s, r in mapping.items() if r == position)


@dataclass
class Mesh:
    """The layout of this job and this rank's place in it.

    Attributes:
        pp: Pipeline degree (positions per replica).
        dp: Data-parallel degree (replicas).
        grid: ``grid[r][d]`` = global rank of position ``r`` in replica ``d``.
        rank: This process's global rank.
    """

    pp: int
    dp: int
    grid: list[list[int]]
    rank: int
    pp_group: Any = field(default=None, repr=False)
    dp_group: Any = field(default=None, repr=False)

    @classmethod
    def build(cls, world_size: int, pp: int, rank: int, grid: list[list[int]] | None = None) -> Mesh:
        if pp < 1 or world_size % pp != 0:
            raise PlanError(
                f"World size {world_size} is not divisible by pp_degree={pp}; world_size must equal "
                f"pp_degree × dp_degree. Use devices × num_nodes = a multiple of {pp}, or change pp_degree."
            )
        dp = world_size // pp
        if grid is None:
            grid = [[r * dp + d for d in range(dp)] for r in range(pp)]
        flat = sorted(x for row in grid for x in row)
        if flat != list(range(world_size)) or len(grid) != pp or any(len(row) != dp for row in grid):
            raise PlanError(f"Rank grid {grid} is not a {pp}×{dp} arrangement of ranks 0..{world_size - 1}.")
        return cls(pp=pp, dp=dp, grid=grid, rank=rank)

    @property
    def position(self) -> int:
        """This rank's pipeline position (0 = holds the first stage)."""
        return next(r for r, row in enumerate(self.grid) if self.rank in row)

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica index."""
        return self.grid[self.position].index(self.rank)

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        d = self.replica if replica is None else replica
        return [self.grid[r][d] for r in range(self.pp)]

    def replica_ranks(self, position: int | None = None) -> list[int]:
        r = self.position if position is None else position
        return list(self.grid[r])

    def init_groups(self) -> None:
        """Create the pipeline and data-parallel process groups (collective: every rank calls it)."""
        import torch.distributed as dist

        for d in range(self.dp):
            ranks = self.pipeline_ranks(d)
            # torch pipelining addresses peers by group rank, which follows global-rank order; the
            # pipeline order must therefore be ascending in global rank.
            if ranks != sorted(ranks):
                raise PlanError(f"Pipeline {d} has ranks {ranks} out of order; pipeline positions must ascend in rank.")
            g = dist.new_group(ranks)
            if d == self.replica:
                self.pp_group = g
        for r in range(self.pp):
            g = dist.new_group(self.replica_ranks(r))
            if r == self.position:
                self.dp_group = g

    def groups_over_positions(self, position_sets: list[tuple[int, ...]]) -> dict[tuple[int, ...], Any]:
        """For each set of pipeline positions, the group of this replica's ranks at them (collective:
        every rank creates every replica's group, in the same order). ``None`` where this rank is not
        in the set."""
        import torch.distributed as dist

        mine: dict[tuple[int, ...], Any] = {}
        for positions in position_sets:
            for d in range(self.dp):
                ranks = sorted(self.grid[r][d] for r in positions)
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    mine[positions] = g
            mine.setdefault(positions, None)
        return mine
