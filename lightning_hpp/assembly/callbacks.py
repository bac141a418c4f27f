"""What a pipeline adds to a Trainer and what it refuses of one: the callbacks the strategy's options
ask for, and the setups whose Lightning behaviour a pipeline cannot keep (refused at setup, on every rank;
what does not compose with sharded or tensor-parallel stages: :mod:`lightning_hpp.assembly.compose`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_hpp.assembly.compose import refuse_with_trainer
from lightning_hpp.errors import PlacementError, PlanError
from lightning_hpp.options import ShardingOptions, TelemetryOptions
from lightning_hpp.precision.plugin import HPPPrecision
from lightning_hpp.telemetry.callback import PipelineTelemetry
from lightning_hpp.telemetry.report import PlacementReport
from lightning_hpp.telemetry.slowdown import WatchOptions
from lightning_hpp.telemetry.watch import StragglerWatch, strategy_timeout_s


def pipeline_callbacks(callbacks: Sequence[Any], telemetry: TelemetryOptions | None, *, auto: bool,
                       watch: WatchOptions | None = None, checkpoint_dir: str | None = None,
                       notes: dict[str, Any] | None = None, timeout: Any = None) -> list[Any]:
    """The callbacks to add beside ``callbacks``: the ``StragglerWatch`` of ``watch`` (first: its transfer
    timing sits under the telemetry's), ``PipelineTelemetry`` when ``telemetry`` asks for it or
    ``plan="auto"`` (``auto``) reports on its plan, and that ``PlacementReport`` (each unless already there).

    Raises:
        PlacementError: a watch that ends the job (``"stop"``, ``"replan"``) without a checkpoint ``dir``.
    """
    added: list[Any] = []
    if watch is not None and watch.action != "off" and not any(isinstance(cb, StragglerWatch) for cb in callbacks):
        if watch.ends_the_job and checkpoint_dir is None:
            raise PlacementError(
                f"`PlacementOptions(watch={watch.action!r})` writes a checkpoint before it ends the job, but "
                f"`HPPStrategy(checkpoint=CheckpointOptions(dir=...))` is not set. Set `dir=` (and `resume='auto'` to "
                f"continue from it), or use `watch='warn'`.")
        added.append(StragglerWatch(watch, checkpoint_dir, notes, strategy_timeout_s(timeout)))
    if telemetry is None and not auto:
        return added
    has_telemetry = any(isinstance(cb, PipelineTelemetry) for cb in callbacks)
    only_for_report = telemetry is None and not has_telemetry
    if not has_telemetry:
        opts = telemetry or TelemetryOptions(every_n_steps=5)
        added.append(
            PipelineTelemetry(every_n_steps=opts.every_n_steps, trace_step=opts.trace_step, trace_dir=opts.trace_dir)
        )
    if auto and not any(isinstance(cb, PlacementReport) for cb in callbacks):
        added.append(PlacementReport(stop_telemetry=only_for_report))
    return added


def refuse_unkept_setups(
    module: Any,
    precision: Any,
    *,
    checkpoint_io: Any,
    fitting: bool,
    precision_flag: str | None,
    sharding: ShardingOptions | None = None,
    callbacks: Sequence[Any] = (),
    layer_sync: Any = None,
) -> None:
    """Refuse what a pipeline would silently ignore: a CheckpointIO plugin, manual optimization, a ``backward``
    override, two default precisions, ``ModelPruning``, ``sync_batchnorm``; and what does not compose with sharded or
    tensor-parallel stages in this version (:func:`~lightning_hpp.assembly.compose.refuse_with_trainer`).

    Raises:
        PlanError: naming the setting and the fix (``ShardingError`` for what sharded stages cannot keep).
    """
    refuse_with_trainer(sharding, callbacks)
    if checkpoint_io is not None and type(checkpoint_io) is not TorchCheckpointIO:  # Lightning's default
        raise PlanError(
            f"HPPStrategy writes sharded checkpoints itself; the CheckpointIO plugin {type(checkpoint_io).__name__} "
            f"would not be used. Remove it from `Trainer(plugins=...)`."
        )
    if fitting and not module.automatic_optimization:
        raise PlanError(
            f"`{type(module).__name__}.automatic_optimization = False` cannot run under HPPStrategy: "
            f"the pipeline schedule runs every micro-batch's forward and backward itself, so `manual_backward` and "
            f"`optimizer.step()` inside `training_step` would act on nothing. Keep automatic optimization (return "
            f"the loss from `training_step`) and put custom clipping in `configure_gradient_clipping` (called per "
            f"stage), accumulation in `Trainer(accumulate_grad_batches=...)`, schedules in `configure_optimizers`."
        )
    pruning = [type(cb).__name__ for cb in callbacks if _is_pruning(cb)]
    if fitting and pruning:
        raise PlanError(
            f"`{pruning[0]}` prunes weights during training by re-registering each pruned weight as `<name>_orig` with "
            "a "
            f"`<name>_mask` buffer (torch.nn.utils.prune); under HPPStrategy the stages' parameters, their gradient "
            f"buckets, the tied-weight groups and the checkpoints' keys are fixed when the model is cut, so a pruned "
            f"stage would train its old parameters. Prune before `fit` (or after, on the exported model), or train "
            f"without the callback."
        )
    if layer_sync is not None:
        raise PlanError(
            "`Trainer(sync_batchnorm=True)`: under HPPStrategy a BatchNorm layer normalises each micro-batch (the "
            "schedule runs one at a time), and SyncBatchNorm over the data-parallel replicas (which torch runs on GPUs "
            "only) is not composed with the micro-batches in this version. Train with `sync_batchnorm=False`, or use "
            "GroupNorm/LayerNorm, whose results do not depend on the batch."
        )
    if fitting and is_overridden("backward", module):
        raise PlanError(
            f"`{type(module).__name__}.backward` is overridden, but under HPPStrategy the pipeline schedule runs every "
            f"micro-batch's backward itself (stage by stage, with the gradients arriving from the next stage), so the "
            f"override would never run. Move what it does to `on_before_backward` / `on_after_backward`, or to "
            f"`configure_gradient_clipping` for gradient changes."
        )
    if (
        isinstance(precision, HPPPrecision)
        and precision.default not in (None, precision_flag)
        and precision_flag != "32-true"
    ):
        raise PlanError(
            f"`Trainer(precision={precision_flag!r})` and `HPPPrecision(default={precision.default!r})` disagree on "
            f"the stages' default precision. Set it in one place."
        )


def _is_pruning(callback: Any) -> bool:
    from lightning.pytorch.callbacks import ModelPruning

    return isinstance(callback, ModelPruning)
