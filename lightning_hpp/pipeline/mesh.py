"""The pp × dp × tp world layout: which global rank holds which pipeline position of which replica.

``grid[r][c]`` is the global rank at pipeline position ``r`` of pipeline ``c``: one pipeline per
data-parallel replica and tensor-parallel rank, ``c = replica · tp + tp_rank`` (``c = replica`` without
tensor parallelism). The default is pipeline-outer (``grid[r][c] = r · dp · tp + c``), so the ranks that
hold one stage are contiguous — on a cluster whose nodes are one device kind each, a stage stays on one
node kind — and a replica's tensor-parallel ranks are neighbours. A plan may give any other arrangement
(``planning`` puts stages on ranks of the kind they ask for), as long as every pipeline ascends in global
rank: torch pipelining addresses a stage's peers by group rank, and a group's ranks follow global-rank order.

The ``dp`` replicas of a stage are ``dp_replicate`` groups of ``dp_shard`` ranks (``replica =
i_replicate · dp_shard + i_shard``): DDP stages are ``dp_replicate = dp``, FSDP stages ``dp_shard = dp``,
HSDP stages both (:class:`~lightning_hpp.options.ShardingOptions`).

:meth:`Mesh.init_groups` builds a :class:`torch.distributed.device_mesh.DeviceMesh` whose mesh tensor
is the grid reshaped to ``pp × dp_replicate × dp_shard × tp``, with dimensions named
``("pp", "dp_replicate", "dp_shard", "tp")`` (size 1 where unused), and ``"dp"`` the flattened
``("dp_replicate", "dp_shard")`` pair: the pipeline group is the ``pp`` dimension's group (this pipeline's
ranks, one per position), the data-parallel group the ``dp`` group (this position's ranks of this
tensor-parallel rank, one per replica). ``Mesh.device_mesh`` is that ``DeviceMesh``, to slice for FSDP2
(``mesh.device_mesh["dp_shard"]``, or ``["dp_replicate", "dp_shard"]`` for HSDP), tensor parallelism
(``["tp"]``) or the whole data-parallel dimension (``Mesh.dp_mesh``, also ``["dp"]``).

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
from lightning_hpp.pipeline.dims import DIM_NAMES, ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DP_DIM = "dp"
"""The flattened ``("dp_replicate", "dp_shard")`` dimension: every replica of a stage."""


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
        dims: The degrees (:class:`~lightning_hpp.pipeline.dims.ParallelDims`).
        grid: ``grid[r][c]`` = global rank of position ``r`` in pipeline ``c`` (``dp × tp`` pipelines).
        rank: This process's global rank.
        dp_mesh: The 1-D flattened ``"dp"`` mesh (every replica of this rank's stages); ``None`` until
            :meth:`init_groups`. ``device_mesh["dp"]`` reaches it too (torch warns that slicing a flattened
            dimension from the root mesh will go).
        device_mesh: The ``("pp", "dp_replicate", "dp_shard", "tp")``
            :class:`~torch.distributed.device_mesh.DeviceMesh` over ``grid``; ``None`` until :meth:`init_groups`.
    """

    dims: ParallelDims
    grid: list[list[int]]
    rank: int
    device_mesh: DeviceMesh | None = field(default=None, repr=False)
    dp_mesh: DeviceMesh | None = field(default=None, repr=False)
    _groups: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, dims: ParallelDims, rank: int, grid: list[list[int]] | None = None) -> Mesh:
        """The layout of ``dims`` (pipeline-outer unless ``grid`` is given) and ``rank``'s place in it.

        Raises:
            PlanError: a grid that is no ``pp × (dp · tp)`` arrangement of the ranks, or a pipeline whose ranks
                do not ascend.
        """
        world, pp, width = dims.world_size, dims.pp, dims.width
        grid = [list(row) for row in (dims.default_grid() if grid is None else grid)]
        flat = sorted(x for row in grid for x in row)
        if flat != list(range(world)) or len(grid) != pp or any(len(row) != width for row in grid):
            raise PlanError(f"Rank grid {grid} is not a {pp}×{width} arrangement of ranks 0..{world - 1}.")
        mesh = cls(dims=dims, grid=grid, rank=rank)
        mesh._check_pipelines_ascend()
        return mesh

    @property
    def pp(self) -> int:
        """Pipeline degree (positions per pipeline)."""
        return self.dims.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas of each stage): ``dp_replicate × dp_shard``."""
        return self.dims.dp

    @property
    def dp_shard(self) -> int:
        """Ranks each stage is sharded over (FSDP2; 1: every replica holds the whole stage)."""
        return self.dims.dp_shard

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (ranks splitting one replica of a stage)."""
        return self.dims.tp

    @property
    def dp_replicate(self) -> int:
        """Replica groups of each stage (``dp / dp_shard``; every replica under DDP)."""
        return self.dims.dp_replicate

    @property
    def position(self) -> int:
        """This rank's pipeline position (0 = holds the first stage)."""
        return next(r for r, row in enumerate(self.grid) if self.rank in row)

    @property
    def column(self) -> int:
        """This rank's pipeline: ``replica · tp + tp_rank``."""
        return self.grid[self.position].index(self.rank)

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica index (``i_replicate · dp_shard + i_shard``)."""
        return self.column // self.tp

    @property
    def tp_rank(self) -> int:
        """This rank's index among its replica's tensor-parallel ranks."""
        return self.column % self.tp

    @property
    def shard_rank(self) -> int:
        """This rank's index among the ranks its stages are sharded over."""
        return self.replica % self.dp_shard

    def _group(self, dim: str) -> Any:
        if self.device_mesh is None:
            return None
        if dim not in self._groups:  # slicing makes a new DeviceMesh each time: read each group once
            self._groups[dim] = self.device_mesh[dim].get_group()
        return self._groups[dim]

    @property
    def pp_group(self) -> Any:
        """This pipeline's group (the ``pp`` dimension's group); ``None`` before :meth:`init_groups`."""
        return self._group("pp")

    @property
    def dp_group(self) -> Any:
        """This position's data-parallel group (the flattened ``dp`` dimension: every replica of its stages);
        ``None`` before :meth:`init_groups`."""
        return self._group(DP_DIM)

    @property
    def dp_shard_group(self) -> Any:
        """The ranks this rank's stages are sharded over (the ``dp_shard`` dimension's group)."""
        return self._group("dp_shard")

    @property
    def dp_replicate_group(self) -> Any:
        """The replicas of this rank's shard (the ``dp_replicate`` dimension's group)."""
        return self._group("dp_replicate")

    @property
    def tp_group(self) -> Any:
        """This replica's tensor-parallel ranks at this position (the ``tp`` dimension's group)."""
        return self._group("tp")

    @property
    def step_group(self) -> Any:
        """A group of every rank, a communicator of its own: the step's one exchange of loss, logs and check
        flags (:mod:`lightning_hpp.pipeline.exchange`) runs on it beside the pipeline's own traffic; ``None``
        before :meth:`init_groups`."""
        return self._groups.get("step")

    @property
    def shard_mesh(self) -> DeviceMesh | None:
        """The ``DeviceMesh`` FSDP2 shards this rank's stages over: ``["dp_shard"]``, or the 2-D
        ``["dp_replicate", "dp_shard"]`` where each shard is also replicated (HSDP)."""
        if self.device_mesh is None:
            return None
        return self.device_mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.device_mesh["dp_shard"]

    def pipeline_ranks(self, column: int | None = None) -> list[int]:
        """The ranks of pipeline ``column`` (default: this rank's), one per position."""
        c = self.column if column is None else column
        return [self.grid[r][c] for r in range(self.pp)]

    def replica_ranks(self, position: int | None = None) -> list[int]:
        """Every rank at pipeline ``position`` (default: this rank's)."""
        r = self.position if position is None else position
        return list(self.grid[r])

    def _check_pipelines_ascend(self) -> None:
        # torch pipelining addresses peers by group rank, which follows global-rank order; the
        # pipeline order must therefore be ascending in global rank.
        for c in range(self.dp * self.tp):
            ranks = self.pipeline_ranks(c)
            if ranks != sorted(ranks):
                raise PlanError(f"Pipeline {c} has ranks {ranks} out of order; pipeline positions must ascend in rank.")

    def init_groups(self, device_type: str | None = None) -> None:
        """Build :attr:`device_mesh` and with it the pipeline, data-parallel, shard and tensor-parallel groups
        (collective: every rank calls it, after the default process group exists).

        Args:
            device_type: The mesh's device type (``"cpu"``, ``"cuda"``, ...); default: what the default
                process group's backend implies (``"cuda"`` for NCCL, else ``"cpu"``).
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        from lightning_hpp._dist import mesh_backend_override, new_group

        self._check_pipelines_ascend()
        if not dist.is_initialized():
            raise PlanError("Mesh.init_groups() needs the default process group: call "
                            "torch.distributed.init_process_group first.")
        # every rank passes the same tensor; DeviceMesh creates the groups of each dimension in turn
        # (new_group / split_group, both collective, both ordering a group's ranks by global rank) and
        # reuses the default group for a dimension that spans the world; every group takes the job's timeout
        # (`HPPStrategy(timeout=...)`), which a group made without one does not inherit from the default group
        override = mesh_backend_override(len(DIM_NAMES))
        mesh = DeviceMesh(device_type or default_device_type(),
                          torch.tensor(self.grid, dtype=torch.int).reshape(self.dims.shape),
                          mesh_dim_names=DIM_NAMES, backend_override=override)
        flat = override[0] if override else None
        self.dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten(DP_DIM, backend_override=flat)
        self.device_mesh, self._groups = mesh, {"dp": self.dp_mesh.get_group(), "step": new_group()}

    def groups_over_positions(self, position_sets: list[tuple[int, ...]]) -> dict[tuple[int, ...], Any]:
        """For each set of pipeline positions, the group of this pipeline's ranks at them (collective:
        every rank creates every pipeline's group, in the same order). ``None`` where this rank is not
        in the set.

        Made with ``new_group`` rather than from :attr:`device_mesh`: a ``DeviceMesh`` has groups for
        whole dimensions only, not for a subset of one."""
        from lightning_hpp._dist import new_group

        mine: dict[tuple[int, ...], Any] = {}
        for positions in position_sets:
            for c in range(self.dp * self.tp):
                ranks = sorted(self.grid[r][c] for r in positions)
                g = new_group(ranks)
                if self.rank in ranks:
                    mine[positions] = g
            mine.setdefault(positions, None)
        return mine
