"""What a callback may read of a running pipeline: :class:`PipelineView`.

``HPPStrategy`` implements it; callbacks (``PipelineTelemetry``, ``PlacementReport``, ``BiasGuard``,
``BiasMonitor``) take it from :func:`pipeline_view` and read nothing else of the strategy, so a
callback written against this protocol works with any strategy that implements it, and one that
finds no view (``DDPStrategy``, one device) knows it runs without a pipeline.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from lightning_hpp.pipeline.mesh import Mesh
    from lightning_hpp.pipeline.runner import PipelineRunner
    from lightning_hpp.planning.plan import StagePlan


@runtime_checkable
class PipelineView(Protocol):
    """The pipeline as callbacks see it, once the strategy is set up (``None``/empty before)."""

    @property
    def plan(self) -> StagePlan | None:
        """The resolved plan (unit names expanded; ``meta`` holds ``precision``, ``predicted``, ...)."""

    @property
    def mesh(self) -> Mesh | None:
        """The pp × dp rank grid and its process groups."""

    @property
    def runner(self) -> PipelineRunner | None:
        """This rank's stages driven through the schedule (``schedule_observers``, ``schedules``)."""

    @property
    def stage_ids(self) -> list[int]:
        """The stages this rank holds."""

    @property
    def schedule(self) -> str:
        """The schedule's name (``"1f1b"``, ...), as resolved."""

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per training batch, as resolved."""

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group of this rank's stages."""

    @property
    def dp_size(self) -> int:
        """Replicas of each stage."""

    @property
    def dp_rank(self) -> int:
        """This rank's replica index."""

    @property
    def device_kind(self) -> str | None:
        """This rank's device kind (``"a100"``, ``"cpu"``, ...) as placement saw it."""

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""

    @property
    def step_stats(self) -> dict[str, Any]:
        """The last training step's ``{"loss": float, "local_grad_norms": {stage: norm}}``."""


_MEMBERS = tuple(name for name in vars(PipelineView) if not name.startswith("_"))


def pipeline_view(trainer: Any) -> PipelineView | None:
    """The trainer's strategy as a :class:`PipelineView`, or ``None`` when it runs no pipeline.

    Judged without evaluating a property (before setup some would fail): every member of the protocol
    must be there, as a property or an attribute."""
    strategy = getattr(trainer, "strategy", None)
    return strategy if all(_has(strategy, name) for name in _MEMBERS) else None


def _has(obj: Any, name: str) -> bool:
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True
