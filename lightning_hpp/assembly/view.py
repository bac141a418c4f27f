"""The read-only side of a strategy that holds a :class:`~lightning_hpp.assembly.build.Pipeline`: the
members of :class:`~lightning_hpp.pipeline.view.PipelineView` that callbacks read, before and after setup.
"""

from __future__ import annotations

from typing import Any

from lightning_hpp.assembly.build import Pipeline
from lightning_hpp.assembly.spec import DEFAULT_MICROBATCHES, DEFAULT_SCHEDULE, PipelineSpec
from lightning_hpp.checkpoint.session import CheckpointSession
from lightning_hpp.pipeline.mesh import Mesh
from lightning_hpp.pipeline.runner import PipelineRunner
from lightning_hpp.planning.plan import StagePlan


class PipelineProperties:
    """:class:`~lightning_hpp.pipeline.view.PipelineView` over ``_pipeline`` (``None`` before setup), ``_spec``
    (what was asked), ``_session`` (checkpoints) and ``_step_stats`` (the last step's loss and norms)."""

    _pipeline: Pipeline | None
    _spec: PipelineSpec
    _session: CheckpointSession
    _step_stats: dict[str, Any]

    @property
    def pipeline(self) -> Pipeline | None:
        """This rank's assembled pipeline, once set up."""
        return self._pipeline

    @property
    def spec(self) -> PipelineSpec:
        """The pipeline options as given (never changed by what ``plan="auto"`` chooses)."""
        return self._spec

    @property
    def plan(self) -> StagePlan | None:
        """The resolved plan (unit names expanded), once set up."""
        return self._pipeline.plan if self._pipeline else None

    @property
    def mesh(self) -> Mesh | None:
        return self._pipeline.mesh if self._pipeline else None

    @property
    def device_mesh(self) -> Any:
        """The job's ``DeviceMesh`` (dimensions ``("pp", "dp_replicate", "dp_shard", "tp")``), once set up; the
        LightningModule reads it as ``self.device_mesh``, as under Lightning's ``ModelParallelStrategy``."""
        return self._pipeline.mesh.device_mesh if self._pipeline else None

    @property
    def runner(self) -> PipelineRunner | None:
        return self._pipeline.runner if self._pipeline else None

    @property
    def stage_ids(self) -> list[int]:
        """The stages this rank holds."""
        return list(self._pipeline.stage_ids) if self._pipeline else []

    @property
    def schedule(self) -> str:
        return self._pipeline.schedule if self._pipeline else self._spec.schedule or DEFAULT_SCHEDULE

    @property
    def n_microbatches(self) -> int:
        return self._pipeline.n_microbatches if self._pipeline else self._spec.n_microbatches or DEFAULT_MICROBATCHES

    @property
    def dp_group(self) -> Any:
        return self._pipeline.mesh.dp_group if self._pipeline else None

    @property
    def dp_size(self) -> int:
        return self._pipeline.mesh.dp if self._pipeline else 1

    @property
    def dp_rank(self) -> int:
        return self._pipeline.mesh.replica if self._pipeline else 0

    @property
    def device_kind(self) -> str | None:
        return self._pipeline.device_kind if self._pipeline else None

    @property
    def step_stats(self) -> dict[str, Any]:
        """The last training step's ``{"loss": float, "local_grad_norms": {stage: norm before the dp all-reduce}}``
        (what ``BiasMonitor`` compares across replicas; the local norms are taken only when one is among the
        Trainer's callbacks). Read on the host when asked, not every step."""
        return {
            k: (float(v) if k == "loss" else {s: float(n) for s, n in v.items()}) for k, v in self._step_stats.items()
        }

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this run resumed from (never deleted by retention or top-k cleanup)."""
        return self._session.resumed_from
