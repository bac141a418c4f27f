"""The memory one rank needs for one stage, unsharded or sharded over its replicas (FSDP2).

An unsharded stage (``data_parallel="ddp"``) holds its parameters, their gradients and the optimizer
state whole, and the activations its in-flight micro-batches keep for the backward::

    params · (1 + optimizer_factor) + in_flight · activations

A sharded stage (``"fsdp"``, ``"hsdp"``) keeps ``1 / dp_shard`` of the parameters, gradients and optimizer
state, and while a step runs holds its gathered parameters and their unsharded gradients too::

    params · (1 + optimizer_factor) / dp_shard + 2 · params + in_flight · activations

``2 · params`` whatever ``reshard_after_forward`` and however many micro-batches: torch pipelining runs
every backward of a stage, its last included, with ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)``, and only the schedule's ``REDUCE_GRAD`` after the stage's last
backward reshards the parameters and reduce-scatters the gradients (torch 2.13,
``PipelineStage.backward_maybe_with_nosync`` and ``perform_reduce_grad``). So by the end of the backward
every unit is gathered and every gradient whole; freeing units after each forward
(``reshard_after_forward=True``) lowers what the forwards hold, not what the end of the backward holds,
and adds all-gathers.
benchmarks/memory measures the same peak with and without it, at 4 micro-batches and at one.

``optimizer_factor`` is gradient plus optimizer bytes per parameter byte (3 for Adam: one gradient, two
moments).
"""

from __future__ import annotations

from typing import Any


def gathered_bytes(param_bytes: Any, dp_shard: int) -> Any:
    """What a sharded stage holds gathered while a step runs: full parameters and their unsharded gradients
    (0 for an unsharded stage). Works on numbers and numpy arrays alike."""
    return 0.0 * param_bytes if dp_shard <= 1 else 2.0 * param_bytes


def stage_memory_bytes(param_bytes: Any, optimizer_factor: float, in_flight: Any, stash_bytes: Any, *,
                       dp_shard: int = 1) -> Any:
    """Predicted peak bytes of one stage on one rank (the module docstring's formula).

    Args:
        param_bytes: The stage's parameter bytes (whole, unsharded).
        optimizer_factor: Gradient + optimizer-state bytes per parameter byte.
        in_flight: Micro-batches whose activations the stage holds at once.
        stash_bytes: Activation bytes one micro-batch keeps for the backward.
        dp_shard: Ranks the stage is sharded over (1: unsharded).
    """
    shards = max(int(dp_shard), 1)
    return param_bytes * (1 + optimizer_factor) / shards + gathered_bytes(param_bytes, shards) + in_flight * stash_bytes


def describe_memory(param_bytes: float, optimizer_factor: float, in_flight: int, stash_bytes: float, *,
                    dp_shard: int = 1, fmt: Any = str) -> str:
    """The formula with the numbers, for an error that names a stage's need (``fmt`` formats bytes)."""
    text = f"parameters {fmt(param_bytes)} x (1 + optimizer_factor {optimizer_factor:g})"
    if dp_shard > 1:
        text += f" / dp_shard {dp_shard} + {fmt(gathered_bytes(param_bytes, dp_shard))} gathered while a step runs"
    return text + f" + {in_flight} in-flight micro-batch(es) x {fmt(stash_bytes)} of activations"
