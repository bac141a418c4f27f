"""lightning_hpp: heterogeneous pipeline parallelism for PyTorch Lightning."""

from lightning_hpp.plan import PlanError, StagePlan, StageSpec, stage

__version__ = "0.1.0"

__all__ = ["PlanError", "StagePlan", "StageSpec", "stage", "__version__"]
