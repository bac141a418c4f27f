"""What does not compose in this version: every refusal of a combination of features, in one place.

Each check runs at setup, on every rank alike (it reads only what every rank has: the options, the plan,
the Trainer's callbacks), before any collective that a refused layout could leave waiting, and names the
combination, why it does not compose and the fix.

* :func:`refuse_with_trainer` — before the pipeline is built: what the Trainer's setup asks of sharded or
  tensor-parallel stages (``BiasMonitor``, ``gradient_clip_val``);
* :func:`refuse_tensor_parallel` — before the cut: tensor parallelism with what it does not compose with;
* :func:`refuse_sharded` — before FSDP2 shards the stages: their precisions;
* :func:`sharding_refusals` — why ``plan="auto"``, left free to shard the stages, keeps them whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_hpp.bias.monitor import BiasMonitor
from lightning_hpp.errors import PlanError, ShardingError
from lightning_hpp.options import ShardingOptions
from lightning_hpp.planning.plan import StagePlan


def sharding_refusals(callbacks: Sequence[Any]) -> list[str]:
    """What among ``callbacks`` sharded stages refuse (:func:`refuse_with_trainer`): why ``plan="auto"``, with no
    ``ShardingOptions`` given, keeps the stages unsharded."""
    if any(isinstance(cb, BiasMonitor) for cb in callbacks):
        return ["`BiasMonitor` is among the callbacks, and sharded stages hold no replica's own gradient to audit"]
    return []


def refuse_with_trainer(module: Any, sharding: ShardingOptions | None, callbacks: Sequence[Any], fitting: bool) -> None:
    """What sharded stages cannot keep yet (a ``BiasMonitor``), and what tensor-parallel stages do not compose with
    yet (gradient clipping: a norm over their shards).

    Raises:
        ShardingError: a ``BiasMonitor`` with sharded stages.
        PlanError: ``Trainer(gradient_clip_val=...)`` with ``tp_degree > 1``.
    """
    if sharding is not None and sharding.sharded and any(isinstance(cb, BiasMonitor) for cb in callbacks):
        raise ShardingError(
            f"`BiasMonitor` compares each replica's gradient norm before the data-parallel reduction, but with "
            f"`ShardingOptions(data_parallel={sharding.data_parallel!r})` FSDP2 reduce-scatters the gradients inside the "
            f"schedule and no replica holds its own whole gradient afterwards. Remove `BiasMonitor` from "
            f"`Trainer(callbacks=...)`, or use data_parallel='ddp' while auditing.")
    clip = getattr(getattr(module, "_trainer", None), "gradient_clip_val", None)
    tp_degree = sharding.tp_degree if sharding is not None else 1
    if tp_degree > 1 and fitting and clip:
        raise PlanError(f"`Trainer(gradient_clip_val={clip})` with `ShardingOptions(tp_degree={tp_degree})`: clipping does not "
                        f"take the norm over tensor-parallel shards in this version. Train without gradient clipping, or "
                        f"with tp_degree=1.")


def refuse_tensor_parallel(plan: Any, auto: bool, pp_degree: int | None, sharding: ShardingOptions, world: int) -> None:
    """Tensor parallelism (``tp_degree > 1``) with what it does not compose with in this version.

    Args:
        plan: The user's plan (a :class:`StagePlan`, or anything else: none yet).
        auto: ``plan="auto"``.
        pp_degree: ``HPPStrategy(pp_degree=...)``.
        sharding: The stages' options.
        world: The job's processes.

    Raises:
        ShardingError: tensor parallel with ``plan="auto"``, sharded (fsdp / hsdp) stages, stages that clip their own
            gradients, no ``pp_degree``, or several replicas of each stage (their gradients' all-reduce does not yet
            take ``DTensor`` shards).
    """
    tp = sharding.tp_degree
    opt = f"`ShardingOptions(tp_degree={tp})`"
    if auto:
        raise ShardingError(f"{opt} with plan='auto': the planner does not model tensor parallelism. Give the plan "
                            f"(`StagePlan.split_at([...])` or pp_degree), or use tp_degree=1.")
    if sharding.sharded:
        raise ShardingError(f"{opt} with data_parallel={sharding.data_parallel!r}: sharded stages do not compose with "
                            f"tensor parallelism in this version. Use data_parallel='ddp' with tp_degree={tp}, or "
                            f"tp_degree=1.")
    clipped = [k for k, s in enumerate(plan.stages if isinstance(plan, StagePlan) else []) if s.clip_norm is not None]
    if clipped:
        raise ShardingError(f"{opt}: stages {clipped} clip their gradients (`StageSpec(clip_norm=...)`), but clipping does not "
                            f"take the norm over tensor-parallel shards in this version. Drop clip_norm, or use tp_degree=1.")
    if pp_degree is None:
        raise ShardingError(f"{opt}: give `HPPStrategy(pp_degree=...)` too, so that world_size = pp_degree × tp_degree "
                            f"(the pipeline degree is otherwise the number of processes).")
    if world % (pp_degree * tp) == 0 and world // (pp_degree * tp) > 1:
        raise ShardingError(f"{opt}: {world} processes with pp_degree={pp_degree} are {world // (pp_degree * tp)} replicas "
                            f"of each stage, whose gradients' all-reduce does not take tensor-parallel shards in this "
                            f"version. Use world_size = pp_degree × tp_degree ({pp_degree * tp} processes), or tp_degree=1.")


def refuse_sharded(sharding: ShardingOptions, precisions: Sequence[str]) -> None:
    """Sharded stages in precisions FSDP2 does not carry yet.

    Raises:
        ShardingError: an fp8 stage (its converted or emulated GEMMs keep per-weight scaling state that FSDP2's
            sharded parameters do not carry yet).
    """
    fp8 = [k for k, p in enumerate(precisions) if p == "fp8"]
    if sharding.sharded and fp8:
        raise ShardingError(
            f"`ShardingOptions(data_parallel={sharding.data_parallel!r})` cannot shard fp8 stages yet (stage(s) {fp8}). "
            f"Give those stages another precision (e.g. 'bf16-mixed'), or keep data_parallel='ddp'.")
