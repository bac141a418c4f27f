"""The memory one rank needs for one stage, unsharded or sharded over its replicas (FSDP2).

An unsharded stage (``data_parallel="ddp"``) holds its parameters, their gradients and the optimizer
state whole, and the activations its in-flight micro-batches keep for the backward::

    params · (1 + optimizer_factor) + in_flight · activations

A sharded stage (``"fsdp"``, ``"hsdp"``) keeps ``1 / dp_shard`` of the parameters, gradients and optimizer
state, and while a step runs holds gathered parameters and unsharded gradients too::

    params · (1 + optimizer_factor) / dp_shard + gathered + in_flight · activations
    gathered = 2 · params                     several micro-batches a step
             = params + the largest unit's    one micro-batch, reshard_after_forward=False
             = 2 · the largest unit's params  one micro-batch, reshard_after_forward=True

Every backward of a step but the last runs without resharding and without gradient reduction (torch
pipelining's ``set_reshard_after_backward(False)`` / ``set_requires_gradient_sync(False)``), so with
several micro-batches the stage's gradients are whole and its parameters gathered when its last backward
starts, whatever ``reshard_after_forward``. The last backward runs as FSDP2 does outside a pipeline
(:class:`lightning_hpp.pipeline.stage._Stage`): each unit is resharded and its gradients reduce-scattered
as its backward ends, so with one micro-batch a step only one unit's gradients are whole at a time, and
only one unit's parameters are gathered if ``reshard_after_forward`` freed them after the forward.
benchmarks/memory measures all three.

``optimizer_factor`` is gradient plus optimizer bytes per parameter byte (3 for Adam: one gradient, two
moments).
"""

from __future__ import annotations

from typing import Any


def gathered_bytes(param_bytes: Any, dp_shard: int, *, n_microbatches: int, reshard_after_forward: bool = False,
                   largest_unit_bytes: Any = None) -> Any:
    """What a sharded stage holds gathered or unsharded while a step runs (the module docstring's
    ``gathered``; 0 for an unsharded stage, and ``2 · params`` where the largest unit is not given).
    Works on numbers and numpy arrays alike."""
    if dp_shard <= 1:
        return 0.0 * param_bytes
    if n_microbatches > 1 or largest_unit_bytes is None:
        return 2.0 * param_bytes
    return 2.0 * largest_unit_bytes if reshard_after_forward else param_bytes + largest_unit_bytes


def stage_memory_bytes(param_bytes: Any, optimizer_factor: float, in_flight: Any, stash_bytes: Any, *,
                       dp_shard: int = 1, n_microbatches: int = 2, reshard_after_forward: bool = False,
                       largest_unit_bytes: Any = None) -> Any:
    """Predicted peak bytes of one stage on one rank (the module docstring's formula).

    Args:
        param_bytes: The stage's parameter bytes (whole, unsharded).
        optimizer_factor: Gradient + optimizer-state bytes per parameter byte.
        in_flight: Micro-batches whose activations the stage holds at once.
        stash_bytes: Activation bytes one micro-batch keeps for the backward.
        dp_shard: Ranks the stage is sharded over (1: unsharded).
        n_microbatches, reshard_after_forward, largest_unit_bytes: For a sharded stage: micro-batches a
            step, FSDP2's choice and the stage's largest unit's parameter bytes (what one micro-batch a step
            holds of it; not given: the stage's whole parameters and gradients are counted).
    """
    shards = max(int(dp_shard), 1)
    gathered = gathered_bytes(param_bytes, shards, n_microbatches=n_microbatches,
                              reshard_after_forward=reshard_after_forward, largest_unit_bytes=largest_unit_bytes)
    return param_bytes * (1 + optimizer_factor) / shards + gathered + in_flight * stash_bytes


def describe_memory(param_bytes: float, optimizer_factor: float, in_flight: int, stash_bytes: float, *,
                    dp_shard: int = 1, n_microbatches: int = 2, reshard_after_forward: bool = False,
                    largest_unit_bytes: float | None = None, fmt: Any = str) -> str:
    """The formula with the numbers, for an error that names a stage's need (``fmt`` formats bytes)."""
    text = f"parameters {fmt(param_bytes)} x (1 + optimizer_factor {optimizer_factor:g})"
    if dp_shard > 1:
        gathered = gathered_bytes(param_bytes, dp_shard, n_microbatches=n_microbatches,
                                  reshard_after_forward=reshard_after_forward, largest_unit_bytes=largest_unit_bytes)
        text += f" / dp_shard {dp_shard} + {fmt(gathered)} gathered while a step runs"
    return text + f" + {in_flight} in-flight micro-batch(es) x {fmt(stash_bytes)} of activations"
