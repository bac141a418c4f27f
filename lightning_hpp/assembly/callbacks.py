"""What a pipeline adds to a Trainer and what it refuses of one: the callbacks the strategy's options
ask for, and the setups whose Lightning behaviour a pipeline cannot keep (refused at setup, on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hpp.bias.monitor import BiasMonitor
from lightning_hpp.errors import PlanError, ShardingError
from lightning_hpp.options import ShardingOptions, TelemetryOptions
from lightning_hpp.precision.plugin import HPPPrecision
from lightning_hpp.telemetry.callback import PipelineTelemetry
from lightning_hpp.telemetry.report import PlacementReport


def pipeline_callbacks(callbacks: Sequence[Any], telemetry: TelemetryOptions | None, *, auto: bool) -> list[Any]:
    """The callbacks to add beside ``callbacks``: ``PipelineTelemetry`` when ``telemetry`` asks for it or
    ``plan="auto"`` (``auto``) reports on its plan, and that ``PlacementReport`` (each unless already there)."""
    if telemetry is None and not auto:
        return []
    added: list[Any] = []
    has_telemetry = any(isinstance(cb, PipelineTelemetry) for cb in callbacks)
    only_for_report = telemetry is None and not has_telemetry
    if not has_telemetry:
        opts = telemetry or TelemetryOptions(every_n_steps=5)
        added.append(PipelineTelemetry(every_n_steps=opts.every_n_steps, trace_step=opts.trace_step, trace_dir=opts.trace_dir))
    if auto and not any(isinstance(cb, PlacementReport) for cb in callbacks):
        added.append(PlacementReport(stop_telemetry=only_for_report))
    return added


def refuse_unkept_setups(module: Any, precision: Any, *, checkpoint_io: Any, fitting: bool, precision_flag: str | None,
                         sharding: ShardingOptions | None = None, callbacks: Sequence[Any] = (),
                         checkpoint_dir: str | None = None) -> None:
    """Refuse what a pipeline would silently ignore: a CheckpointIO plugin, manual optimization, two default precisions;
    and what sharded or tensor-parallel stages cannot keep yet: a ``BiasMonitor`` (sharded), checkpoints
    (``ModelCheckpoint``, the strategy's own ``checkpoint_dir`` or resume), gradient clipping (tensor parallel: a norm
    over its shards).

    Raises:
        PlanError: naming the setting and the fix (``ShardingError`` for what sharded stages cannot keep).
    """
    tp = sharding.tp_degree if sharding is not None else 1
    if sharding is not None and (sharding.sharded or tp > 1):
        saver = next((type(cb).__name__ for cb in callbacks if isinstance(cb, ModelCheckpoint)), None)
        if saver is not None or checkpoint_dir is not None:
            what = f"`{saver}` (Lightning adds one unless `Trainer(enable_checkpointing=False)`)" if saver else (
                f"`CheckpointOptions` ({checkpoint_dir!r})")
            kind, other = ((f"sharded stages (`ShardingOptions(data_parallel={sharding.data_parallel!r})`)",
                            "data_parallel='ddp'") if sharding.sharded else
                           (f"tensor-parallel stages (`ShardingOptions(tp_degree={tp})`)", "tp_degree=1"))
            raise ShardingError(
                f"Checkpoints of {kind} are not available in this version, but {what} would save or load one. Pass "
                f"`Trainer(enable_checkpointing=False)` and no checkpoint `dir`/`resume`, or use {other}.")
    if sharding is not None and sharding.sharded and any(isinstance(cb, BiasMonitor) for cb in callbacks):
        raise ShardingError(
            f"`BiasMonitor` compares each replica's gradient norm before the data-parallel reduction, but with "
            f"`ShardingOptions(data_parallel={sharding.data_parallel!r})` FSDP2 reduce-scatters the gradients inside the "
            f"schedule and no replica holds its own whole gradient afterwards. Remove `BiasMonitor` from "
            f"`Trainer(callbacks=...)`, or use data_parallel='ddp' while auditing.")
    if checkpoint_io is not None and type(checkpoint_io) is not TorchCheckpointIO:  # Lightning's default
        raise PlanError(f"HPPStrategy writes sharded checkpoints itself; the CheckpointIO plugin {type(checkpoint_io).__name__} "
                        f"would not be used. Remove it from `Trainer(plugins=...)`.")
    if fitting and not module.automatic_optimization:
        raise PlanError(
            f"`{type(module).__name__}.automatic_optimization = False` cannot run under HPPStrategy: "
            f"the pipeline schedule runs every micro-batch's forward and backward itself, so `manual_backward` and "
            f"`optimizer.step()` inside `training_step` would act on nothing. Keep automatic optimization (return "
            f"the loss from `training_step`) and put custom clipping in `configure_gradient_clipping` (called per "
            f"stage), accumulation in `Trainer(accumulate_grad_batches=...)`, schedules in `configure_optimizers`."
        )
    clip = getattr(getattr(module, "_trainer", None), "gradient_clip_val", None)
    if tp > 1 and fitting and clip:
        raise ShardingError(f"`Trainer(gradient_clip_val={clip})` with `ShardingOptions(tp_degree={tp})`: clipping does not "
                        f"take the norm over tensor-parallel shards in this version. Train without gradient clipping, or "
                        f"with tp_degree=1.")
    if isinstance(precision, HPPPrecision) and precision.default not in (None, precision_flag) and precision_flag != "32-true":
        raise PlanError(f"`Trainer(precision={precision_flag!r})` and `HPPPrecision(default={precision.default!r})` disagree on "
                        f"the stages' default precision. Set it in one place.")
