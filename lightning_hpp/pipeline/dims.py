"""The job's parallel degrees, and the one validation of their arithmetic.

:class:`ParallelDims` is the ``pp × dp_replicate × dp_shard × tp`` layout of a job's ``world_size`` ranks
(as torchtitan's ``ParallelDims``): ``pp`` pipeline positions; ``dp = dp_replicate × dp_shard`` data-parallel
replicas of each stage, each stage sharded (FSDP2) over ``dp_shard`` of them and replicated over
``dp_replicate`` groups (``"ddp"``: ``dp_shard = 1``; ``"fsdp"``: ``dp_replicate = 1``; ``"hsdp"``: both
> 1); ``tp`` ranks of each replica splitting the stage's layers (tensor parallel). Everything that derives one
degree from the others (the replicas of a pipeline degree, the sampler's replicas, the mesh's shape, the
planner's candidates) asks this value; :meth:`ParallelDims.resolve` is where a layout the world cannot form
is refused, naming the sizes. :class:`~lightning_hpp.pipeline.mesh.Mesh` builds torch's ``DeviceMesh`` of
:data:`DIM_NAMES` with :attr:`ParallelDims.shape` over its rank grid.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_hpp.errors import PlanError, ShardingError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
"""The ``DeviceMesh`` dimensions, outermost first."""

DATA_PARALLEL = ("ddp", "fsdp", "hsdp")
"""How the ``dp`` replicas of a stage share it: whole on each, sharded over all, sharded over groups of them."""


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one layout (each >= 1; validated when built).

    Attributes:
        pp: Pipeline positions (each holding one or more stages).
        dp_replicate: Replica groups of each stage (every replica under ddp).
        dp_shard: Ranks each stage is sharded over (FSDP2; 1: unsharded).
        tp: Ranks of one replica splitting each stage's layers (tensor parallel; 1: none).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp_replicate", "dp_shard", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"`ParallelDims({name}={value!r})`: every degree must be an integer >= 1.")

    @property
    def dp(self) -> int:
        """Data-parallel replicas of each stage: ``dp_replicate × dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The ``DeviceMesh`` shape, in the order of :data:`DIM_NAMES`."""
        return self.pp, self.dp_replicate, self.dp_shard, self.tp

    @property
    def sharded(self) -> bool:
        """Whether each stage is sharded over (some of) its replicas."""
        return self.dp_shard > 1

    @property
    def data_parallel(self) -> str:
        """The data-parallel mode these degrees are (one replica counts as ``"ddp"``)."""
        if self.dp_shard == 1:
            return "ddp"
        return "fsdp" if self.dp_replicate == 1 else "hsdp"

    @property
    def width(self) -> int:
        """Pipelines of the job (one per replica and tensor-parallel rank): ``dp × tp``."""
        return self.dp * self.tp

    def default_grid(self) -> list[list[int]]:
        """The pipeline-outer rank grid ``grid[position][replica · tp + tp_rank]`` (the ranks of one position
        contiguous, a replica's tensor-parallel ranks neighbours)."""
        return [[r * self.width + c for c in range(self.width)] for r in range(self.pp)]

    def expand_tp(self, group_grid: list[list[int]]) -> list[list[int]]:
        """The rank grid of a grid of tensor-parallel groups: group ``g`` is ranks ``g · tp .. g · tp + tp - 1``
        (neighbours, so a group stays on one host where hosts hold whole groups), and replica ``d``'s pipeline of
        tensor-parallel rank ``t`` is column ``d · tp + t``."""
        return [[g * self.tp + t for g in row for t in range(self.tp)] for row in group_grid]

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica of ``rank`` on the default grid."""
        return (rank % self.width) // self.tp

    def describe(self) -> str:
        parts = [f"pp={self.pp}", f"dp={self.dp}"]
        if self.dp_shard > 1:
            parts[-1] += f" ({self.data_parallel}: dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard})"
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        return " × ".join(parts)

    @classmethod
    def resolve(cls, world_size: int, pp: int, *, tp: int = 1, data_parallel: str = "ddp",
                dp_replicate: int | None = None, origin: str | None = None) -> ParallelDims:
        """The layout of ``world_size`` ranks in ``pp`` positions of ``tp`` ranks, their replicas shared as
        ``data_parallel`` says: the one place the degrees' arithmetic is checked.

        Args:
            world_size: The job's processes.
            pp: Pipeline positions.
            tp: Tensor-parallel degree.
            data_parallel: ``"ddp"``, ``"fsdp"`` or ``"hsdp"`` (:data:`DATA_PARALLEL`).
            dp_replicate: ``"hsdp"``'s replica groups (required there; ``dp / dp_replicate`` ranks each).
            origin: What set ``pp``, for the error (``"The plan has 6 stages"``); default the option
                ``HPPStrategy(pp_degree=...)``.

        Raises:
            PlanError: ``pp · tp`` more than the processes, or not dividing them.
            ShardingError: an hsdp ``dp_replicate`` that does not divide the replicas.
        """
        if pp > world_size:
            if origin is not None:
                raise PlanError(f"{origin} (pp_degree={pp}) but the job has {world_size} processes. Use at least {pp} "
                                f"processes (`Trainer(devices=..., num_nodes=...)`), or a plan with fewer stages.")
            raise PlanError(f"`HPPStrategy(pp_degree={pp})` needs at least {pp} processes, one per pipeline position, "
                            f"but the job has {world_size}. Lower `pp_degree`, or start more processes "
                            f"(`Trainer(devices=..., num_nodes=...)`).")
        if pp < 1 or tp < 1 or world_size % (pp * tp):
            raise PlanError(
                f"World size {world_size} is not divisible by pp_degree={pp}"
                + (f" × tp_degree={tp}" if tp > 1 else "")
                + "; world_size must equal pp_degree × dp_degree" + (" × tp_degree" if tp > 1 else "")
                + f". Use devices × num_nodes = a multiple of {pp * tp}, or change pp_degree"
                + (" or tp_degree." if tp > 1 else ".")
            )
        dp = world_size // (pp * tp)
        if data_parallel == "ddp":
            return cls(pp, dp, 1, tp)
        if data_parallel == "fsdp":
            return cls(pp, 1, dp, tp)
        if data_parallel != "hsdp" or dp_replicate is None:
            raise ShardingError(f"data_parallel={data_parallel!r} (dp_replicate={dp_replicate!r}) is no layout: use "
                                f"'ddp', 'fsdp', or 'hsdp' with dp_replicate.")
        if dp % dp_replicate:
            divisors = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ShardingError(
                f"`ShardingOptions(data_parallel='hsdp', dp_replicate={dp_replicate})`: each stage has {dp} "
                f"replicas (world_size / (pp × tp)), which {dp_replicate} groups cannot split evenly. Use a "
                f"dp_replicate that divides {dp} ({divisors}), or change the number of processes.")
        return cls(pp, dp_replicate, dp // dp_replicate, tp)
