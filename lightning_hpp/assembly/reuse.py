"""A module cut by an earlier strategy: continuing with its pipeline.

Once cut, each rank's LightningModule holds only its stages (the others are stand-ins), so it cannot be cut
again. One process lets a user hand the same module to a new Trainer — fine-tuning in two fits with a backbone
unfrozen in between, ``Tuner(trainer).lr_find(model)`` before ``Trainer(...).fit(model)``, ``test`` with a new
Trainer. The module keeps the pipeline it was cut into (:func:`hold`); a new strategy that asks for the same
pipeline continues with it (:func:`held_pipeline`): the same stages, groups and precision set-up, with the new
Trainer's optimizers, callbacks and loops. One that asks for another pipeline is refused, naming what differs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_hpp.errors import PlanError

_HELD = "_hpp_pipeline"


def pipeline_key(spec: Any, inputs: Any) -> tuple[tuple[str, Any], ...]:
    """What a pipeline is built from, as ``(what, value)`` pairs that a later strategy must repeat: the pipeline
    options (a plan by its stages), the job's size and this rank, the option sections, the precision settings."""
    plan = spec.plan
    stages = tuple(plan.stages) if hasattr(plan, "stages") else plan
    precision = inputs.precision
    return (
        ("plan", stages), ("schedule", spec.schedule), ("n_microbatches", spec.n_microbatches),
        ("pp_degree", spec.pp_degree), ("frontend", spec.frontend),
        ("activation_checkpointing", spec.activation_checkpointing), ("step_replay", spec.step_replay),
        ("compile", spec.compile),
        ("world size", inputs.world_size), ("rank", inputs.rank), ("device", str(inputs.device)),
        ("sharding", inputs.sharding), ("placement", inputs.placement), ("init", inputs.init),
        ("Trainer(precision=...)", inputs.trainer_precision),
        ("HPPPrecision", (type(precision).__name__, precision.default, precision.clip, precision.fp8_backend,
                          precision.fp8_recipe, precision.nonfinite, precision.log_grad_norms)),
    )


def hold(module: nn.Module, pipeline: Any) -> Any:
    """Keep ``pipeline`` on the module it cut; returns it."""
    module.__dict__[_HELD] = pipeline
    return pipeline


def held_pipeline(module: nn.Module, key: tuple[tuple[str, Any], ...]) -> Any:
    """The pipeline an earlier strategy cut ``module`` into, where ``key`` asks for the same one; ``None`` for a
    module no strategy has cut.

    Raises:
        PlanError: the module was cut for another pipeline (what differs named, on every rank alike).
    """
    pipeline = module.__dict__.get(_HELD)
    if pipeline is None:
        return None
    differ = [f"{what}: {had!r} then, {now!r} now" for (what, had), (_, now) in zip(pipeline.key, key) if had != now]
    if differ:
        raise PlanError(
            f"This {type(module).__name__} was cut into pipeline stages by an earlier Trainer's HPPStrategy, and each "
            f"rank now holds only its own stages, so a new Trainer can only continue with the same pipeline; the new "
            f"one asks for another ({'; '.join(differ)}). Give the new Trainer the same HPPStrategy options (or reuse "
            f"the first Trainer), or build the module anew (e.g. `MyModule.load_from_checkpoint(...)` of a checkpoint "
            f"exported with `python -m lightning_hpp.checkpoint.export`)."
        )
    return pipeline
