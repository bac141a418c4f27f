"""The pp × dp world layout: which global rank holds which pipeline position of which replica.

``grid[r][d]`` is the global rank at pipeline position ``r`` of data-parallel replica ``d``. The
default is pipeline-outer (``grid[r][d] = r * dp + d``), so the ranks that hold one stage are
contiguous — on a cluster whose nodes are one device kind each, a stage stays on one node kind. A
plan may give any other arrangement (``planning`` puts stages on ranks of the kind they ask for), as
long as every replica's pipeline ascends in global rank: torch pipelining addresses a stage's peers
by group rank, and a group's ranks follow global-rank order.

:meth:`Mesh.init_groups` builds a :class:`torch.distributed.device_mesh.DeviceMesh` whose mesh tensor
is the grid (shape ``pp × dp``) with dimensions named ``("pp", "dp")``: the pipeline group is the
``pp`` dimension's group (this replica's ranks, one per position) and the data-parallel group the
``dp`` dimension's group (this position's ranks, one per replica). ``Mesh.device_mesh`` is that
``DeviceMesh``, to slice for FSDP2 / tensor parallelism (``mesh.device_mesh["dp"]``).

Which virtual stages live on pipeline position ``r`` follows torch's placement styles: ``"loop"``
(stage ``s`` on position ``s % pp``) or ``"v"`` (stages ``r`` and ``2·pp − 1 − r``).

::

    pp=2, dp=2, 4 stages, style "loop"        grid        stages on each position
        replica 0: rank 0 -> rank 2            r=0: [0, 1]   r=0: stages 0, 2
        replica 1: rank 1 -> rank 3            r=1: [2, 3]   r=1: stages 1, 3
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_hpp.errors import PlanError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIM_NAMES = ("pp", "dp")


def stages_of_position(position: int, pp: int, num_stages: int, style: str) -> list[int]:
    """The virtual stage indices held by pipeline position ``position``, ascending."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(pp, num_stages, style=style)
    return sorted(s for s, r in mapping.items() if r == position)


def default_device_type() -> str:
    """The device type the default process group's backend implies: ``"cuda"`` for NCCL, else ``"cpu"``."""
    import torch.distributed as dist

    return "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"


@dataclass
class Mesh:
    """The layout of this job and this rank's place in it.

    Attributes:
        pp: Pipeline degree (positions per replica).
        dp: Data-parallel degree (replicas).
        grid: ``grid[r][d]`` = global rank of position ``r`` in replica ``d``.
        rank: This process's global rank.
        device_mesh: The ``("pp", "dp")`` :class:`~torch.distributed.device_mesh.DeviceMesh` over
            ``grid``; ``None`` until :meth:`init_groups`.
    """

    pp: int
    dp: int
    grid: list[list[int]]
    rank: int
    device_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def build(cls, world_size: int, pp: int, rank: int, grid: list[list[int]] | None = None) -> Mesh:
        """The layout of ``world_size`` ranks in ``pp`` positions (pipeline-outer unless ``grid`` is given).

        Raises:
            PlanError: ``world_size`` not a multiple of ``pp``, a grid that is no ``pp × dp``
                arrangement of the ranks, or a pipeline whose ranks do not ascend.
        """
        if pp < 1 or world_size % pp != 0:
            raise PlanError(
                f"World size {world_size} is not divisible by pp_degree={pp}; world_size must equal "
                f"pp_degree × dp_degree. Use devices × num_nodes = a multiple of {pp}, or change pp_degree."
            )
        dp = world_size // pp
        if grid is None:
            grid = [[r * dp + d for d in range(dp)] for r in range(pp)]
        grid = [list(row) for row in grid]
        flat = sorted(x for row in grid for x in row)
        if flat != list(range(world_size)) or len(grid) != pp or any(len(row) != dp for row in grid):
            raise PlanError(f"Rank grid {grid} is not a {pp}×{dp} arrangement of ranks 0..{world_size - 1}.")
        mesh = cls(pp=pp, dp=dp, grid=grid, rank=rank)
        mesh._check_pipelines_ascend()
        return mesh

    @property
    def position(self) -> int:
        """This rank's pipeline position (0 = holds the first stage)."""
        return next(r for r, row in enumerate(self.grid) if self.rank in row)

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica index."""
        return self.grid[self.position].index(self.rank)

    @property
    def pp_group(self) -> Any:
        """This replica's pipeline group (the ``pp`` dimension's group); ``None`` before :meth:`init_groups`."""
        return None if self.device_mesh is None else self.device_mesh.get_group("pp")

    @property
    def dp_group(self) -> Any:
        """This position's data-parallel group (the ``dp`` dimension's group); ``None`` before :meth:`init_groups`."""
        return None if self.device_mesh is None else self.device_mesh.get_group("dp")

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        d = self.replica if replica is None else replica
        return [self.grid[r][d] for r in range(self.pp)]

    def replica_ranks(self, position: int | None = None) -> list[int]:
        r = self.position if position is None else position
        return list(self.grid[r])

    def _check_pipelines_ascend(self) -> None:
        # torch pipelining addresses peers by group rank, which follows global-rank order; the
        # pipeline order must therefore be ascending in global rank.
        for d in range(self.dp):
            ranks = self.pipeline_ranks(d)
            if ranks != sorted(ranks):
                raise PlanError(f"Pipeline {d} has ranks {ranks} out of order; pipeline positions must ascend in rank.")

    def init_groups(self, device_type: str | None = None) -> None:
        """Build :attr:`device_mesh` and with it the pipeline and data-parallel groups (collective:
        every rank calls it, after the default process group exists).

        Args:
            device_type: The mesh's device type (``"cpu"``, ``"cuda"``, ...); default: what the default
                process group's backend implies (``"cuda"`` for NCCL, else ``"cpu"``).
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        self._check_pipelines_ascend()
        if not dist.is_initialized():
            raise PlanError("Mesh.init_groups() needs the default process group: call "
                            "torch.distributed.init_process_group first.")
        # every rank passes the same tensor; DeviceMesh creates the groups of each dimension in turn
        # (new_group / split_group, both collective, both ordering a group's ranks by global rank) and
        # reuses the default group for a dimension that spans the world
        self.device_mesh = DeviceMesh(device_type or default_device_type(), torch.tensor(self.grid, dtype=torch.int),
                                      mesh_dim_names=DIM_NAMES)

    def groups_over_positions(self, position_sets: list[tuple[int, ...]]) -> dict[tuple[int, ...], Any]:
        """For each set of pipeline positions, the group of this replica's ranks at them (collective:
        every rank creates every replica's group, in the same order). ``None`` where this rank is not
        in the set.

        Made with ``new_group`` rather than from :attr:`device_mesh`: a ``DeviceMesh`` has groups for
        whole dimensions only, not for a subset of one."""
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
