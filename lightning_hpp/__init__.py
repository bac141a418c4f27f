"""lightning_hpp: heterogeneous pipeline parallelism for PyTorch Lightning."""

from lightning_hpp.bias import BiasMonitor, DistributedWeightedSampler
from lightning_hpp.plan import PlanError, StagePlan, StageSpec, stage
from lightning_hpp.precision import HPPPrecision
from lightning_hpp.strategy import HPPStrategy

__version__ = "0.1.0"

__all__ = [
    "BiasMonitor",
    "DistributedWeightedSampler",
    "HPPPrecision",
    "HPPStrategy",
    "PlanError",
    "StagePlan",
    "StageSpec",
    "stage",
    "__version__",
]
