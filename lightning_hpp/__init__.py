"""lightning_hpp: heterogeneous pipeline parallelism for PyTorch Lightning."""

from lightning_hpp.bias import BiasMonitor, DistributedWeightedSampler
from lightning_hpp.errors import PlanError
from lightning_hpp.planning.plan import StagePlan, StageSpec, stage
from lightning_hpp.precision.plugin import HPPPrecision
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
