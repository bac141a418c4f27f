"""Measuring a cost profile: the time and memory of every pipeline unit on a real micro-batch.

:func:`profile_units` runs each unit forward and backward on a real micro-batch (each unit gets the
previous unit's output, as it would inside the pipeline) and records, per unit
(:class:`~lightning_hpp.planning.profile.UnitCost`):

* ``fwd_ms`` / ``bwd_ms``: mean wall time of the forward and of the backward (input gradients
  and parameter gradients) over at least :data:`MIN_WINDOW_S` of repetitions, synchronised on
  CUDA (a mean over a window, so CPU quotas that pause the process are counted);
* ``param_bytes``: bytes of the unit's parameters in the measured precision;
* ``activation_bytes``: bytes of the unit's output, i.e. what crosses a stage boundary cut after it;
* ``saved_bytes``: bytes the forward keeps alive for the backward (autograd's saved tensors,
  parameters excluded), i.e. the activation memory of one in-flight micro-batch.

Units that are the same computation (:func:`unit_signature`: module classes, hyperparameters, parameter
and input shapes; a transformer's or an MLP's repeated blocks) get the mean of their measured times:
each measurement of a short unit carries its own noise (a CPU quota's period, another process), and a
cut search reads the difference between two blocks that compute the same as a reason to cut unevenly.
:func:`fit_fixed_costs` splits each unit's time into a part per micro-batch and a part per sample from
two such measurements at different micro-batch sizes.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_hpp._timing import synchronize
from lightning_hpp.errors import ProfileError, ProfileMismatchError
from lightning_hpp.planning.devices import normalize_kind
from lightning_hpp.planning.plan import normalize_precision
from lightning_hpp.planning.profile import CostProfile, ProfileEntry, UnitCost
from lightning_hpp.validation import check_int

MIN_WINDOW_S = 0.3
"""Least timed work per unit: three 100 ms CFS periods, so a CPU quota's pauses are sampled."""


_TRUE_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}
_AUTOCAST_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def as_args(x: Any) -> tuple:
    """A unit's input as positional arguments: a tuple stays, anything else becomes a 1-tuple."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def to_device(obj: Any, device: torch.device) -> Any:
    """Tensors of a nested tuple / list / dict moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def input_shapes(args: tuple) -> list[list[int] | None]:
    """The shapes of a call's tensor arguments (``None`` for the others): a profile's ``input_shapes``."""
    return [list(a.shape) if isinstance(a, torch.Tensor) else None for a in args]


def _boundary(out: Any, dtype: torch.dtype | None) -> tuple:
    """Detached copies of a unit's output that require grad, as the next stage receives them."""

    def conv(o):
        if isinstance(o, torch.Tensor):
            o = o.detach()
            if o.is_floating_point():
                if dtype is not None:
                    o = o.to(dtype)
                o.requires_grad_(True)
            return o
        if isinstance(o, (tuple, list)):
            return type(o)(conv(i) for i in o)
        return o

    return as_args(conv(out))


def model_signature_counts(units: Sequence[tuple[str, nn.Module]]) -> list[int]:
    """Parameter counts of the units (the numeric part of a profile's signature)."""
    return [sum(p.numel() for p in m.parameters()) for _, m in units]


_SCALARS = (bool, int, float, str, type(None))
_INDEX_ATTRS = frozenset({"idx", "index", "layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
"""Attributes that only number a layer (transformers' ``layer_idx``): two blocks differing in them alone
compute the same."""


def unit_signature(module: nn.Module, args: tuple) -> tuple:
    """What makes two units the same computation on the same input: every submodule's class (the class
    object: a traced ``GraphModule``'s is its own), ``extra_repr()``, public scalar attributes (a sliding
    window, a dropout rate; not a layer's index), a ``forward`` set on the instance and its hooks, the
    parameters' and buffers' names, shapes, dtypes and ``requires_grad``, and the input tensors' shapes,
    dtypes and ``requires_grad``."""
    parts = []
    for name, sub in module.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(sub).items()
                if not k.startswith("_") and k != "training" and k not in _INDEX_ATTRS and isinstance(v, _SCALARS)
            )
        )
        hooks = tuple((*sub._forward_pre_hooks.values(), *sub._forward_hooks.values(), *sub._backward_hooks.values()))
        parts.append((name, type(sub), sub.extra_repr(), attrs, vars(sub).get("forward"), hooks))
    tensors = tuple(
        (n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in (*module.named_parameters(), *module.named_buffers())
    )
    inputs = tuple(
        (tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else type(a).__qualname__
        for a in args
    )
    return tuple(parts), tensors, inputs


def _pool_identical(costs: list[UnitCost], signatures: list[tuple]) -> list[list[str]]:
    """Give units of one signature the mean of their forward and backward times; returns the groups."""
    groups: dict[tuple, list[UnitCost]] = {}
    for sig, cost in zip(signatures, costs):
        groups.setdefault(sig, []).append(cost)
    pooled = []
    for group in groups.values():
        if len(group) > 1:
            fwd, bwd = statistics.fmean(c.fwd_ms for c in group), statistics.fmean(c.bwd_ms for c in group)
            for c in group:
                c.fwd_ms, c.bwd_ms = fwd, bwd
            pooled.append([c.name for c in group])
    return pooled


def _measure_unit(
    module: nn.Module,
    args: tuple,
    device: torch.device,
    precision: str,
    repeats: int,
    warmup: int,
    context: Callable[[], AbstractContextManager] | None,
) -> tuple[UnitCost, Any]:
    params = [p for p in module.parameters() if p.requires_grad]
    param_ids = {p.untyped_storage().data_ptr() for p in module.parameters()}
    grad_inputs = [a for a in _tensors(args) if a.requires_grad]
    if context is not None:
        ctx = context
    elif precision in _AUTOCAST_DTYPES:
        dtype = _AUTOCAST_DTYPES[precision]

        def ctx():
            return torch.autocast(device.type, dtype=dtype)
    else:
        ctx = nullcontext

    def run_forward():
        with ctx():
            return module(*args)

    def run_backward(out):
        outs = [o for o in _tensors(out) if o.requires_grad]
        if not outs:
            return
        targets = params + grad_inputs
        if targets:
            # into .grad, as a pipeline stage's backward accumulates over micro-batches (that traffic
            # is part of each micro-batch's cost); the caller restores .grad afterwards
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs], inputs=targets)

    # Saved-tensor bytes: one untimed forward with hooks (hooks would distort the timing).
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ids:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    saved = sum(seen.values())
    del out

    fwd, bwd = [], []
    i, start = 0, None
    # Repeat for at least MIN_WINDOW_S of timed work and keep the mean: a CPU quota (cgroups,
    # Kubernetes limits) stops a process for whole scheduler periods, which a median of a few short
    # repetitions would skip, so a throttled device would look as fast as a free one.
    while i < warmup + repeats or (time.perf_counter() - start) < MIN_WINDOW_S:
        if i == warmup:
            start = time.perf_counter()
        synchronize(device)
        t0 = time.perf_counter()
        out = run_forward()
        synchronize(device)
        t1 = time.perf_counter()
        run_backward(out)
        synchronize(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
        i += 1
        if start is None:
            start = time.perf_counter()
    cost = UnitCost(
        name="",
        fwd_ms=statistics.fmean(fwd),
        bwd_ms=statistics.fmean(bwd),
        param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
        activation_bytes=sum(t.numel() * t.element_size() for t in _tensors(out)),
        saved_bytes=saved,
    )
    return cost, out


def profile_units(
    units: Sequence[tuple[str, nn.Module]],
    example_input: Any,
    device_kind: str,
    precision: str = "32-true",
    repeats: int = 5,
    warmup: int = 2,
    model_name: str | None = None,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    context: Callable[[], AbstractContextManager] | None = None,
    source: str = "measured",
    device: torch.device | str | None = None,
) -> CostProfile:
    """Measure every unit's forward+backward time and memory on one real micro-batch.

    The units are run where their parameters are (no device moves). Unit ``i`` gets unit ``i-1``'s
    output, detached and requiring grad, as a pipeline stage would receive it; the first unit gets
    ``example_input`` as its positional arguments (a tuple or list is unpacked). The backward is
    ``torch.autograd.backward`` with all-ones output gradients, accumulating into ``.grad`` as a
    pipeline stage does over micro-batches; the parameters' ``.grad`` are restored afterwards, buffers (batch-norm
    statistics) are restored afterwards and the random number
    generators are forked, so training after profiling is the same as without it. ``"16-true"`` and
    ``"bf16-true"`` are measured on a converted copy of each unit; the autocast modes under
    ``torch.autocast``. ``"fp8"`` needs the two hooks of the fp8 backend, for example
    ``prepare=lambda m: convert_module_to_fp8(m, "te")`` and
    ``context=lambda: fp8_autocast_context("te")`` from :mod:`lightning_hpp.precision.fp8`, on a GPU that
    supports fp8. Units of one :func:`unit_signature` get the mean of their times (the groups are
    ``meta["identical_units"]``).

    Args:
        units: ``(name, module)`` pairs in pipeline order.
        example_input: One micro-batch of the real shape.
        device_kind: Kind to record the costs under (see ``devices.detect_device_kind``).
        precision: One of ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``,
            ``"bf16-true"``.
        repeats: Minimum timed repetitions per unit (more run until MIN_WINDOW_S has passed; the mean is kept).
        warmup: Untimed repetitions before them.
        model_name: Name recorded in the profile's signature (default ``"model"``).
        prepare: Converts a copy of each unit before it is measured (the model is untouched).
        context: Context manager factory wrapped around each forward, replacing the precision's
            default (``torch.autocast`` for the mixed modes).
        source: How the entry is labelled (say so when the numbers are not real speed, e.g. an
            fp8 emulation).
        device: Where to measure: each unit is moved there for its own measurement and back
            afterwards (so only one unit at a time occupies the device), and the input is moved
            there. Default: where the units' parameters are.

    Returns:
        A profile with one entry, ``(device_kind, precision)``.

    Raises:
        ProfileError: no units, ``repeats < 1``, or precision ``"fp8"`` without ``prepare`` and
            ``context`` (fp8 speed needs the fp8 backend; or supply fp8 costs in a profile file).
    """
    units = list(units)
    if not units:
        raise ProfileError("`profile_units` got no units; pass the model's (name, module) pairs.")
    check_int(repeats, "profile_units(repeats=...)", error=ProfileError)
    check_int(warmup, "profile_units(warmup=...)", minimum=0, error=ProfileError)
    device_kind = normalize_kind(device_kind, "`profile_units` device_kind")
    precision = normalize_precision(precision, "`profile_units`") or "32-true"
    if precision == "fp8" and (prepare is None or context is None):
        raise ProfileError(
            "`profile_units` cannot measure precision 'fp8' by itself: pass the fp8 backend's hooks, "
            "prepare=lambda m: convert_module_to_fp8(m, 'te') and context=lambda: fp8_autocast_context('te') "
            "(lightning_hpp.precision.fp8, on a GPU with compute capability >= 8.9), or add fp8 costs to the profile "
            "file."
        )
    args = as_args(example_input)
    first_param = next((p for _, m in units for p in m.parameters()), None)
    home = first_param.device if first_param is not None else None
    if device is not None:
        device = torch.device(device)
        args = to_device(args, device)
    else:
        device = home or next((t.device for t in _tensors(args)), torch.device("cpu"))
    true_dtype = _TRUE_DTYPES.get(precision)
    if true_dtype is not None:
        args = tuple(a.to(true_dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    costs: list[UnitCost] = []
    signatures: list[tuple] = []
    # Dropout draws random numbers: measure on a forked RNG so training sees the same stream.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for name, module in units:
            unit_home = next((t.device for t in (*module.parameters(), *module.buffers())), device)
            if unit_home != device:
                module.to(device)
            buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
            grads = [(p, p.grad) for p in module.parameters()]
            runner = copy.deepcopy(module).to(true_dtype) if true_dtype is not None else module
            if prepare is not None:
                runner = prepare(copy.deepcopy(runner) if runner is module else runner)
            try:
                cost, out = _measure_unit(runner, args, device, precision, repeats, warmup, context)
            finally:
                with torch.no_grad():
                    for k, b in module.named_buffers():
                        b.copy_(buffers[k])
                for p, g in grads:
                    p.grad = g
                if unit_home != device:
                    module.to(unit_home)
            cost.name = name
            costs.append(cost)
            signatures.append(unit_signature(runner, args))
            args = _boundary(out, true_dtype)
    identical = _pool_identical(costs, signatures)
    return CostProfile(
        model=model_name or "model",
        unit_names=[n for n, _ in units],
        param_counts=model_signature_counts(units),
        input_shapes=input_shapes(as_args(example_input)),
        entries=[ProfileEntry(device_kind, precision, costs, source=source)],
        meta={"torch": str(torch.__version__), "repeats": repeats, "warmup": warmup, "identical_units": identical},
    )


def fit_fixed_costs(big: CostProfile, small: CostProfile) -> CostProfile:
    """``big`` with every unit's ``fixed_ms`` fitted from the same units measured at a smaller micro-batch.

    Each unit's forward+backward is taken as ``fixed + per_sample * b``: the line through the two
    measurements, with ``fixed`` clipped to ``[0, step_ms]`` (timing noise can tip the line).

    Raises:
        ProfileMismatchError: the profiles are of different units or micro-batch sizes are not
            ``small < big``.
    """
    b_big, b_small = big.microbatch_size, small.microbatch_size
    if big.unit_names != small.unit_names or not b_big or not b_small or b_small >= b_big:
        raise ProfileMismatchError(
            f"`fit_fixed_costs` needs the same units at two micro-batch sizes small < big; got units "
            f"{small.unit_names} at {b_small!r} and {big.unit_names} at {b_big!r}."
        )
    out = copy.deepcopy(big)
    for entry in out.entries:
        other = small.get(entry.device_kind, entry.precision)
        if other is None:
            continue
        for u, v in zip(entry.units, other.units):
            per_sample = (u.step_ms - v.step_ms) / (b_big - b_small)
            u.fixed_ms = min(u.step_ms, max(0.0, u.step_ms - per_sample * b_big))
    out.meta["fixed_ms_from_microbatch_sizes"] = [b_small, b_big]
    return out
