"""lightning_hpp: heterogeneous pipeline parallelism for PyTorch Lightning."""

from lightning_hpp.plan import PlanError, StagePlan, StageSpec, stage
from lightning_hpp.strategy import HPPStrategy

__version__ = "0.1.0"

__all__ = ["HPPStrategy", "PlanError", "StagePlan", "StageSpec", "stage", "__version__"]
