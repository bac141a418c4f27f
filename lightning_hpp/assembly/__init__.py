"""Assembling this rank's pipeline from a LightningModule, its plan and the job it runs in.

``spec``: the pipeline options as the user gave them (:class:`PipelineSpec`) and the plan they
resolve to (:class:`ResolvedPlan`); ``placement``: device kinds, the rank grid for stages that ask
for kinds, and ``plan="auto"`` on a running job; ``build``: :func:`build_pipeline`, one function to
a frozen :class:`Pipeline` (plan, mesh, stage ids, stages, runner, gradient hand-over).
"""

from lightning_hpp.assembly.build import Pipeline, SetupInputs, build_pipeline, example_call, resolve_plan
from lightning_hpp.assembly.spec import PipelineSpec, ResolvedPlan

__all__ = ["Pipeline", "PipelineSpec", "ResolvedPlan", "SetupInputs", "build_pipeline", "example_call", "resolve_plan"]
