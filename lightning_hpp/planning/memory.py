"""The memory one rank needs for one stage, unsharded or sharded over its replicas (FSDP2).

An unsharded stage (``data_parallel="ddp"``) holds its parameters, their gradients and the optimizer
state whole, and the activations its in-flight micro-batches keep for the backward::

    params · (1 + optimizer_factor) + in_flight · activations

A sharded stage (``"fsdp"``, ``"hsdp"``) keeps ``1 / dp_shard`` of the parameters, gradients and optimizer
state, and while a step runs holds gathered parameters and their unsharded gradients too (until the
schedule reduce-scatters them after the stage's last backward)::

    params · (1 + optimizer_factor) / dp_shard + gathered + in_flight · activations
    gathered = 2 · params                     reshard_after_forward=False (the default: gathered once per step),
                                              or any schedule of more than one micro-batch
             = 2 · the largest unit's params  reshard_after_forward=True and one micro-batch a step

``reshard_after_forward=True`` saves memory only when a step is one micro-batch: torch pipelining keeps a
stage's parameters gathered after every backward but the last of a step (``set_reshard_after_backward(False)``)
and its gradients unsharded until the last (``set_requires_gradient_sync(False)``), so under any schedule of
several micro-batches the stage holds its whole parameters and gradients from its first backward on, and
freeing blocks after each forward only adds all-gathers.

``optimizer_factor`` is gradient plus optimizer bytes per parameter byte (3 for Adam: one gradient, two
moments).
"""

from __future__ import annotations

from typing import Any


def gathered_bytes(param_bytes: Any, dp_shard: int, reshard_after_forward: bool = False,
                   largest_unit_bytes: Any = None, n_microbatches: int = 1) -> Any:
    """What a sharded stage holds gathered while a step runs: full parameters and their unsharded gradients
    (0 for an unsharded stage); one unit's worth only with ``reshard_after_forward`` and one micro-batch a step
    (the module docstring says why). Works on numbers and numpy arrays alike."""
    if dp_shard <= 1:
        return 0.0 * param_bytes
    per_unit = reshard_after_forward and largest_unit_bytes is not None and n_microbatches <= 1
    return 2.0 * (largest_unit_bytes if per_unit else param_bytes)


def stage_memory_bytes(param_bytes: Any, optimizer_factor: float, in_flight: Any, stash_bytes: Any, *,
                       dp_shard: int = 1, reshard_after_forward: bool = False, largest_unit_bytes: Any = None,
                       n_microbatches: int = 1) -> Any:
    """Predicted peak bytes of one stage on one rank (the module docstring's formula).

    Args:
        param_bytes: The stage's parameter bytes (whole, unsharded).
        optimizer_factor: Gradient + optimizer-state bytes per parameter byte.
        in_flight: Micro-batches whose activations the stage holds at once.
        stash_bytes: Activation bytes one micro-batch keeps for the backward.
        dp_shard: Ranks the stage is sharded over (1: unsharded).
        reshard_after_forward: FSDP2's choice for the stage (``False``: gathered for the whole step).
        largest_unit_bytes: The stage's largest unit's parameter bytes (what ``reshard_after_forward=True``
            holds gathered at a time when a step is one micro-batch).
        n_microbatches: Micro-batches a step (more than one: the stage is held gathered whatever
            ``reshard_after_forward``).
    """
    shards = max(int(dp_shard), 1)
    return (param_bytes * (1 + optimizer_factor) / shards
            + gathered_bytes(param_bytes, shards, reshard_after_forward, largest_unit_bytes, n_microbatches)
            + in_flight * stash_bytes)


def describe_memory(param_bytes: float, optimizer_factor: float, in_flight: int, stash_bytes: float, *,
                    dp_shard: int = 1, reshard_after_forward: bool = False, largest_unit_bytes: float | None = None,
                    n_microbatches: int = 1, fmt: Any = str) -> str:
    """The formula with the numbers, for an error that names a stage's need (``fmt`` formats bytes)."""
    text = f"parameters {fmt(param_bytes)} x (1 + optimizer_factor {optimizer_factor:g})"
    if dp_shard > 1:
        gathered = gathered_bytes(param_bytes, dp_shard, reshard_after_forward, largest_unit_bytes, n_microbatches)
        text += f" / dp_shard {dp_shard} + {fmt(gathered)} gathered while a step runs"
    return text + f" + {in_flight} in-flight micro-batch(es) x {fmt(stash_bytes)} of activations"
