"""lightning_hpp: heterogeneous pipeline parallelism for PyTorch Lightning.

The public surface: :class:`HPPStrategy` (also ``Trainer(strategy="hpp")``) and its option
sections, :class:`HPPPrecision`, the plan types, and the coded-bias tools. The layers below are
described in ``lightning_hpp/*/__init__.py`` and the README's layout section.
"""

from lightning_hpp.bias import BiasMonitor, DistributedWeightedSampler
from lightning_hpp.errors import PlanError
from lightning_hpp.options import (
    BiasOptions,
    CheckpointOptions,
    InitOptions,
    PlacementOptions,
    ShardingOptions,
    TelemetryOptions,
)
from lightning_hpp.planning.plan import StagePlan, StageSpec, stage
from lightning_hpp.precision import HPPPrecision
from lightning_hpp.strategy import HPPStrategy

__version__ = "0.1.0"

__all__ = [
    "BiasMonitor",
    "BiasOptions",
    "CheckpointOptions",
    "DistributedWeightedSampler",
    "HPPPrecision",
    "HPPStrategy",
    "InitOptions",
    "PlacementOptions",
    "PlanError",
    "ShardingOptions",
    "StagePlan",
    "StageSpec",
    "TelemetryOptions",
    "stage",
    "__version__",
]
