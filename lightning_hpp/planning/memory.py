"""The memory one rank needs for one stage, unsharded or sharded over its replicas (FSDP2).

An unsharded stage (``data_parallel="ddp"``) holds its parameters, their gradients and the optimizer
state whole, and the activations its in-flight micro-batches keep for the backward::

    params · (1 + optimizer_factor) + in_flight · activations

A sharded stage (``"fsdp"``, ``"hsdp"``) keeps ``1 / dp_shard`` of the parameters, gradients and optimizer
state, and while a step runs holds gathered parameters and their unsharded gradients too (until the
schedule reduce-scatters them after the stage's last backward)::

    params · (1 + optimizer_factor) / dp_shard + gathered + in_flight · activations
    gathered = 2 · params                     reshard_after_forward=False (the default: gathered once per step)
             = 2 · the largest unit's params  reshard_after_forward=True (one unit gathered at a time)

``optimizer_factor`` is gradient plus optimizer bytes per parameter byte (3 for Adam: one gradient, two
moments).
"""

from __future__ import annotations

from typing import Any


def gathered_bytes(param_bytes: Any, dp_shard: int, reshard_after_forward: bool = False,
                   largest_unit_bytes: Any = None) -> Any:
    """What a sharded stage holds gathered while a step runs: full parameters and their unsharded gradients
    (0 for an unsharded stage). Works on numbers and numpy arrays alike."""
    if dp_shard <= 1:
        return 0.0 * param_bytes
    held = largest_unit_bytes if reshard_after_forward and largest_unit_bytes is not None else param_bytes
    return 2.0 * held


def stage_memory_bytes(param_bytes: Any, optimizer_factor: float, in_flight: Any, stash_bytes: Any, *,
                       dp_shard: int = 1, reshard_after_forward: bool = False, largest_unit_bytes: Any = None) -> Any:
    """Predicted peak bytes of one stage on one rank (the module docstring's formula).

    Args:
        param_bytes: The stage's parameter bytes (whole, unsharded).
        optimizer_factor: Gradient + optimizer-state bytes per parameter byte.
        in_flight: Micro-batches whose activations the stage holds at once.
        stash_bytes: Activation bytes one micro-batch keeps for the backward.
        dp_shard: Ranks the stage is sharded over (1: unsharded).
        reshard_after_forward: FSDP2's choice for the stage (``False``: gathered for the whole step).
        largest_unit_bytes: The stage's largest unit's parameter bytes (what ``reshard_after_forward=True``
            holds gathered at a time).
    """
    shards = max(int(dp_shard), 1)
    return (param_bytes * (1 + optimizer_factor) / shards
            + gathered_bytes(param_bytes, shards, reshard_after_forward, largest_unit_bytes)
            + in_flight * stash_bytes)


def describe_memory(param_bytes: float, optimizer_factor: float, in_flight: int, stash_bytes: float, *,
                    dp_shard: int = 1, reshard_after_forward: bool = False, largest_unit_bytes: float | None = None,
                    fmt: Any = str) -> str:
    """The formula with the numbers, for an error that names a stage's need (``fmt`` formats bytes)."""
    text = f"parameters {fmt(param_bytes)} x (1 + optimizer_factor {optimizer_factor:g})"
    if dp_shard > 1:
        gathered = gathered_bytes(param_bytes, dp_shard, reshard_after_forward, largest_unit_bytes)
        text += f" / dp_shard {dp_shard} + {fmt(gathered)} gathered while a step runs"
    return text + f" + {in_flight} in-flight micro-batch(es) x {fmt(stash_bytes)} of activations"
