"""What does not compose in this version: every refusal of a combination of features, in one place.

Each check runs at setup, on every rank alike (it reads only what every rank has: the options, the plan,
the Trainer's callbacks), before any collective that a refused layout could leave waiting, and names the
combination, why it does not compose and the fix.

* :func:`refuse_with_trainer` — before the pipeline is built: what the Trainer's setup asks of sharded
  stages (``BiasMonitor``);
* :func:`refuse_stage_precisions` — before the cut: precisions sharded or tensor-parallel stages do not take;
* :func:`sharding_refusals` — why ``plan="auto"``, left free to shard the stages, keeps them whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_hpp.bias.monitor import BiasMonitor
from lightning_hpp.errors import ShardingError
from lightning_hpp.options import ShardingOptions


def sharding_refusals(callbacks: Sequence[Any]) -> list[str]:
    """What among ``callbacks`` sharded stages refuse (:func:`refuse_with_trainer`): why ``plan="auto"``, with no
    ``ShardingOptions`` given, keeps the stages unsharded."""
    if any(isinstance(cb, BiasMonitor) for cb in callbacks):
        return ["`BiasMonitor` is among the callbacks, and sharded stages hold no replica's own gradient to audit"]
    return []


def refuse_with_trainer(sharding: ShardingOptions | None, callbacks: Sequence[Any]) -> None:
    """What sharded stages cannot keep yet: a ``BiasMonitor``.

    Raises:
        ShardingError: a ``BiasMonitor`` with sharded stages.
    """
    if sharding is not None and sharding.sharded and any(isinstance(cb, BiasMonitor) for cb in callbacks):
        raise ShardingError(
            f"`BiasMonitor` compares each replica's gradient norm before the data-parallel reduction, but with "
            f"`ShardingOptions(data_parallel={sharding.data_parallel!r})` FSDP2 reduce-scatters the gradients inside "
            f"the schedule and no replica holds its own whole gradient afterwards. Remove `BiasMonitor` from "
            f"`Trainer(callbacks=...)`, or use data_parallel='ddp' while auditing.")


def refuse_stage_precisions(sharding: ShardingOptions, precisions: Sequence[str]) -> None:
    """Stage precisions that sharded or tensor-parallel stages do not take yet: fp8's converted or emulated GEMMs
    keep per-weight scaling state (the amax of the whole weight) that neither FSDP2's shards nor a tensor-parallel
    rank's slice carry (Transformer Engine's own sharded and tensor-parallel modules are not wired in this version).

    Raises:
        ShardingError: an fp8 stage with ``data_parallel`` ``"fsdp"`` / ``"hsdp"`` or with ``tp_degree > 1``.
    """
    fp8 = [k for k, p in enumerate(precisions) if p == "fp8"]
    if not fp8:
        return
    if sharding.sharded:
        raise ShardingError(
            f"`ShardingOptions(data_parallel={sharding.data_parallel!r})` cannot shard fp8 stages yet "
            f"(stage(s) {fp8}). Give those stages another precision (e.g. 'bf16-mixed'), or keep data_parallel='ddp'.")
    if sharding.tp_degree > 1:
        raise ShardingError(
            f"`ShardingOptions(tp_degree={sharding.tp_degree})` cannot split fp8 stages yet (stage(s) {fp8}): their "
            f"GEMMs scale each weight by its whole amax, which a tensor-parallel rank's slice does not hold. Give "
            f"those stages another precision (e.g. 'bf16-mixed'), or use tp_degree=1.")
