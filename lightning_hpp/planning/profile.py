"""Cost profiles: measured time and memory of every pipeline unit, per device kind and precision.

:func:`profile_units` runs each unit forward and backward on a real micro-batch (each unit gets the
previous unit's output, as it would inside the pipeline) and records, per unit:

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

A :class:`CostProfile` holds such measurements for one model signature (class name, unit names,
parameter counts) and input shapes, with one :class:`ProfileEntry` per (device kind, precision).
It round-trips through JSON, so a profile measured once, or written by hand for hardware one does
not have, can be loaded instead of measuring. :func:`load_or_profile` is the cache.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from lightning_hpp.errors import ProfileError, ProfileMismatchError
from lightning_hpp.planning.devices import normalize_kind
from lightning_hpp.planning.plan import normalize_precision
from lightning_hpp.validation import check_int

log = logging.getLogger(__name__)

FORMAT = "lightning_hpp.cost_profile/1"

MIN_WINDOW_S = 0.3
"""Least timed work per unit: three 100 ms CFS periods, so a CPU quota's pauses are sampled."""


@dataclass
class UnitCost:
    """Cost of one pipeline unit for one micro-batch, on one device kind in one precision.

    Attributes:
        name: Unit name (as in the stage plan).
        fwd_ms: Forward time in milliseconds.
        bwd_ms: Backward time in milliseconds.
        param_bytes: Parameter bytes.
        activation_bytes: Bytes of the unit's output (the boundary tensor after this unit).
        saved_bytes: Bytes kept for the backward per micro-batch; 0 when unknown (the partitioner
            then uses ``activation_bytes``).
        fixed_ms: The part of ``fwd_ms + bwd_ms`` that does not grow with the micro-batch size
            (reading the weights, launching the kernels), paid once per micro-batch; fitted from a
            second measurement at another micro-batch size, 0 when unknown.
    """

    name: str
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    activation_bytes: int
    saved_bytes: int = 0
    fixed_ms: float = 0.0

    @property
    def step_ms(self) -> float:
        """Forward plus backward time."""
        return self.fwd_ms + self.bwd_ms


@dataclass
class Overheads:
    """Costs of a training step on one device kind that no single unit accounts for.

    All times in milliseconds; every field defaults to 0 (not modelled).

    Attributes:
        microbatch_ms: Fixed cost of every micro-batch on every stage (the schedule's bookkeeping
            of one forward and one backward action).
        step_ms: Fixed cost of one step of the schedule, whatever the number of micro-batches.
        loss_ms: The step's loss (the user's ``training_step`` after ``self(...)``, and its
            backward) on one micro-batch of the profile's size, paid on the last stage.
        loss_fixed_ms: The part of ``loss_ms`` that does not grow with the micro-batch size.
        optimizer_ms_per_mb: Optimizer update time per MB of parameters (an SGD-with-momentum
            update measured on this kind), paid once per step by every stage for its parameters.
        p2p_latency_ms: Fixed cost of one point-to-point message between two ranks.
        p2p_gbps: Measured point-to-point bandwidth in GB/s (0: the cluster's ``link_gbps``).
        allreduce_gbps: Measured bus bandwidth of an all-reduce over the job's ranks in GB/s (the
            gradient all-reduce of data parallelism; 0: ``p2p_gbps``). On CPUs an all-reduce also sums on
            the cores that compute, so it runs well below the point-to-point bandwidth.
        allreduce_overlap: How much of the gradient all-reduce the backward hides: 1 (the default) lets a
            rank's last backward hide it, as NCCL's kernels beside the backward's do on a GPU; 0 hides nothing,
            as on CPU ranks, where gloo sums the gradients on the cores the backward computes on (the
            runtime profile sets 0 on CPUs).
    """

    microbatch_ms: float = 0.0
    step_ms: float = 0.0
    loss_ms: float = 0.0
    loss_fixed_ms: float = 0.0
    optimizer_ms_per_mb: float = 0.0
    p2p_latency_ms: float = 0.0
    p2p_gbps: float = 0.0
    allreduce_gbps: float = 0.0
    allreduce_overlap: float = 1.0


@dataclass
class ProfileEntry:
    """The costs of all units on one device kind in one precision.

    Attributes:
        device_kind: Kind the costs were measured (or estimated) on.
        precision: Precision they were measured in.
        units: One :class:`UnitCost` per unit, in unit order.
        source: How the numbers were obtained (``"measured"`` or a description of an estimate).
        overheads: What a step costs on this kind besides the units (see :class:`Overheads`).
    """

    device_kind: str
    precision: str
    units: list[UnitCost]
    source: str = "measured"
    overheads: Overheads | None = None

    def __post_init__(self) -> None:
        self.device_kind = normalize_kind(self.device_kind, "profile device_kind")
        self.precision = normalize_precision(self.precision, "profile entry")
        self.units = [u if isinstance(u, UnitCost) else UnitCost(**u) for u in self.units]
        if isinstance(self.overheads, dict):
            self.overheads = Overheads(**self.overheads)


@dataclass
class CostProfile:
    """Per-unit costs of one model on one input shape, for any number of (kind, precision) pairs.

    Attributes:
        model: The model's name (class name of the LightningModule, or any label).
        unit_names: Unit names in pipeline order.
        param_counts: Number of parameters of every unit (part of the signature).
        input_shapes: Shapes of the example micro-batch's tensor arguments (``None`` for
            non-tensor arguments).
        entries: One entry per (device kind, precision).
        meta: Free-form notes saved with the profile (assumptions, hardware, command).
    """

    model: str
    unit_names: list[str]
    param_counts: list[int]
    input_shapes: list[list[int] | None]
    entries: list[ProfileEntry] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.unit_names = list(self.unit_names)
        self.param_counts = [int(c) for c in self.param_counts]
        if len(self.param_counts) != len(self.unit_names):
            raise ProfileError(
                f"Profile of {self.model!r} has {len(self.unit_names)} unit names but "
                f"{len(self.param_counts)} parameter counts; give one count per unit."
            )
        self.input_shapes = [None if s is None else [int(d) for d in s] for s in self.input_shapes]
        entries = [e if isinstance(e, ProfileEntry) else ProfileEntry(**e) for e in self.entries]
        self.entries = []
        for e in entries:
            self.add(e)

    # ------------------------------------------------------------------ identity
    @property
    def signature(self) -> dict[str, Any]:
        """What a cached profile must match: model, units, parameter counts and input shapes."""
        return {
            "model": self.model,
            "units": [[n, c] for n, c in zip(self.unit_names, self.param_counts)],
            "input_shapes": self.input_shapes,
        }

    @property
    def microbatch_size(self) -> int | None:
        """Leading dimension of the first tensor input (samples per micro-batch), if known."""
        for s in self.input_shapes:
            if s:
                return s[0]
        return None

    # ------------------------------------------------------------------ entries
    def add(self, entry: ProfileEntry) -> None:
        """Add or replace the entry for ``(entry.device_kind, entry.precision)``.

        Raises:
            ProfileMismatchError: the entry's units are not this profile's units.
        """
        names = [u.name for u in entry.units]
        if names != self.unit_names:
            raise ProfileMismatchError(
                f"Profile entry ({entry.device_kind}, {entry.precision}) has units {names}, but the "
                f"profile of {self.model!r} has units {self.unit_names}; every entry must list the "
                f"same units in the same order."
            )
        self.entries = [
            e for e in self.entries if (e.device_kind, e.precision) != (entry.device_kind, entry.precision)
        ] + [entry]

    def get(self, device_kind: str, precision: str) -> ProfileEntry | None:
        """The entry for ``(device_kind, precision)``, or ``None``."""
        for e in self.entries:
            if e.device_kind == device_kind and e.precision == precision:
                return e
        return None

    def pairs(self) -> list[tuple[str, str]]:
        """All ``(device_kind, precision)`` pairs the profile holds."""
        return [(e.device_kind, e.precision) for e in self.entries]

    def merge(self, other: CostProfile) -> CostProfile:
        """A new profile with the entries of both (``other`` wins on equal pairs).

        Raises:
            ProfileMismatchError: the two profiles have different signatures.
        """
        if other.signature != self.signature:
            raise ProfileMismatchError(
                f"Cannot merge profiles of different models/shapes: {self.signature} vs {other.signature}."
            )
        out = copy.deepcopy(self)
        for e in other.entries:
            out.add(copy.deepcopy(e))
        out.meta.update(other.meta)
        return out

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "unit_names": self.unit_names,
            "param_counts": self.param_counts,
            "input_shapes": self.input_shapes,
            "entries": [asdict(e) for e in self.entries],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> CostProfile:
        """Build a profile from :meth:`to_dict` output.

        Raises:
            ProfileError: not a profile mapping, or fields of the wrong type.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ProfileError(f"{where} is not a cost profile (format {got!r}, expected {FORMAT!r}).")
        try:
            return cls(
                model=data["model"],
                unit_names=data["unit_names"],
                param_counts=data["param_counts"],
                input_shapes=data["input_shapes"],
                entries=[ProfileEntry(**e) for e in data.get("entries", [])],
                meta=dict(data.get("meta") or {}),
            )
        except (KeyError, TypeError) as err:
            raise ProfileError(f"{where} has a missing or malformed field: {err!r}.") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON (parent directories are created)."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostProfile:
        """Read a profile written by :meth:`save` (or by hand in the same format).

        Raises:
            ProfileError: the file is missing, not JSON, or not a profile.
        """
        path = os.fspath(path)
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ProfileError(f"Profile file {path!r} does not exist.") from None
        except json.JSONDecodeError as err:
            raise ProfileError(f"Profile file {path!r} is not valid JSON: {err}.") from None
        return cls.from_dict(data, where=f"Profile file {path!r}")


def check_profile_matches(
    profile: CostProfile, unit_names: Sequence[str], param_counts: Sequence[int] | None = None
) -> None:
    """Check that a profile describes the model's units.

    Args:
        profile: The profile to check.
        unit_names: The model's units in pipeline order.
        param_counts: The units' parameter counts; when given, a changed unit is an error too.

    Raises:
        ProfileMismatchError: names the units the profile lacks, the units it has in excess, units
            out of order or with a different parameter count.
    """
    unit_names = list(unit_names)
    missing = [n for n in unit_names if n not in profile.unit_names]
    extra = [n for n in profile.unit_names if n not in unit_names]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing units {missing}")
        if extra:
            parts.append(f"extra units {extra} the model does not have")
        raise ProfileMismatchError(
            f"The cost profile of {profile.model!r} does not match the model: {'; '.join(parts)}. "
            f"Profile the model again (delete the cached profile file) or load the profile made for it."
        )
    if profile.unit_names != unit_names:
        raise ProfileMismatchError(
            f"The cost profile of {profile.model!r} lists the units in a different order "
            f"({profile.unit_names}) than the model ({unit_names}); profile the model again."
        )
    if param_counts is not None:
        changed = [
            (n, a, b) for n, a, b in zip(unit_names, profile.param_counts, param_counts) if int(a) != int(b)
        ]
        if changed:
            desc = ", ".join(f"{n!r}: profile {a} vs model {b}" for n, a, b in changed)
            raise ProfileMismatchError(
                f"The cost profile of {profile.model!r} was made for units of other sizes ({desc} "
                f"parameters); profile the model again."
            )


# ---------------------------------------------------------------------------- measurement
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


def _shapes(args: tuple) -> list[list[int] | None]:
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_signature_counts(units: Sequence[tuple[str, nn.Module]]) -> list[int]:
    """Parameter counts of the units (the numeric part of a profile's signature)."""
    return [sum(p.numel() for p in m.parameters()) for _, m in units]


_SCALARS = (bool, int, float, str, type(None))
_INDEX_ATTRS = frozenset({"idx", "index", "layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
"""Attributes that only number a layer (transformers' ``layer_idx``): two blocks differing in them alone compute the same."""


def unit_signature(module: nn.Module, args: tuple) -> tuple:
    """What makes two units the same computation on the same input: every submodule's class (the class
    object: a traced ``GraphModule``'s is its own), ``extra_repr()``, public scalar attributes (a sliding
    window, a dropout rate; not a layer's index), a ``forward`` set on the instance and its hooks, the
    parameters' and buffers' names, shapes, dtypes and ``requires_grad``, and the input tensors' shapes,
    dtypes and ``requires_grad``."""
    parts = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items() if not k.startswith("_") and k != "training"
                             and k not in _INDEX_ATTRS and isinstance(v, _SCALARS)))
        hooks = tuple((*sub._forward_pre_hooks.values(), *sub._forward_hooks.values(), *sub._backward_hooks.values()))
        parts.append((name, type(sub), sub.extra_repr(), attrs, vars(sub).get("forward"), hooks))
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                    for n, t in (*module.named_parameters(), *module.named_buffers()))
    inputs = tuple((tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else type(a).__qualname__
                   for a in args)
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
        _sync(device)
        t0 = time.perf_counter()
        out = run_forward()
        _sync(device)
        t1 = time.perf_counter()
        run_backward(out)
        _sync(device)
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
    pipeline stage does over micro-batches; the parameters' ``.grad`` are restored afterwards, buffers (batch-norm statistics) are restored afterwards and the random number
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
            "(lightning_hpp.precision.fp8, on a GPU with compute capability >= 8.9), or add fp8 costs to the profile file."
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
        input_shapes=_shapes(as_args(example_input)),
        entries=[ProfileEntry(device_kind, precision, costs, source=source)],
        meta={"torch": str(torch.__version__), "repeats": repeats, "warmup": warmup, "identical_units": identical},
    )


SPEED_TOLERANCE = 0.1
"""Recorded speeds within this of 1.0 leave a rank on its kind's measured costs."""


def with_rank_speeds(profile: CostProfile, rank_kinds: Sequence[str],
                     speeds: dict[int, float] | None) -> tuple[CostProfile, list[str]]:
    """The profile and rank kinds to plan with when some ranks run slower than their kind was measured.

    A rank whose recorded speed (the share of its kind's measured speed it has left, as the straggler watch
    records it in a checkpoint) differs from 1 by more than :data:`SPEED_TOLERANCE` gets a kind of its own,
    ``"<kind>-r<rank>"``, whose entries are its kind's with every time divided by the speed (unit forward,
    backward and fixed costs, and the per-micro-batch, per-step, loss and optimizer overheads; the link
    numbers stay). The planner then places stages on that rank as on a device of that speed.

    Args:
        profile: The measured (or loaded) profile.
        rank_kinds: Every rank's kind.
        speeds: ``{rank: speed}``; ``None`` or empty: nothing changes.

    Returns:
        ``(profile, kinds)``: a new profile with the derived entries, and every rank's kind to plan with.
    """
    kinds = list(rank_kinds)
    if not speeds:
        return profile, kinds
    out = copy.deepcopy(profile)
    for rank, speed in sorted(speeds.items()):
        if rank >= len(kinds) or abs(float(speed) - 1.0) <= SPEED_TOLERANCE or not speed > 0:
            continue
        base = rank_kinds[rank]
        derived = normalize_kind(f"{base}-r{rank}", "derived device kind")
        for entry in [e for e in profile.entries if e.device_kind == base]:
            slow = copy.deepcopy(entry)
            slow.device_kind = derived
            slow.source = f"{entry.source}, divided by the recorded speed {float(speed):.3f} of rank {rank}"
            for u in slow.units:
                u.fwd_ms, u.bwd_ms, u.fixed_ms = u.fwd_ms / speed, u.bwd_ms / speed, u.fixed_ms / speed
            if slow.overheads is not None:
                o = slow.overheads
                o.microbatch_ms, o.step_ms, o.loss_ms = o.microbatch_ms / speed, o.step_ms / speed, o.loss_ms / speed
                o.loss_fixed_ms, o.optimizer_ms_per_mb = o.loss_fixed_ms / speed, o.optimizer_ms_per_mb / speed
            out.add(slow)
        kinds[rank] = derived
    return out, kinds


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


def mean_over_ranks(parts: Sequence[CostProfile]) -> CostProfile:
    """Several ranks' profiles of the same units as one: a (kind, precision) entry that more than one rank
    measured gets the mean of their unit times (forward, backward, fixed part) and overheads; the bytes are
    the same on every rank, the other entries are taken as they are.

    Raises:
        ProfileMismatchError: no profiles, or profiles of different signatures.
    """
    if not parts:
        raise ProfileMismatchError("`mean_over_ranks` got no profiles.")
    out = copy.deepcopy(parts[0])
    for part in parts[1:]:
        out = out.merge(part)
    groups: dict[tuple[str, str], list[ProfileEntry]] = {}
    for part in parts:
        for entry in part.entries:
            groups.setdefault((entry.device_kind, entry.precision), []).append(entry)
    for entries in groups.values():
        if len(entries) < 2:
            continue
        mean = copy.deepcopy(entries[0])
        for i, u in enumerate(mean.units):
            u.fwd_ms = statistics.fmean(e.units[i].fwd_ms for e in entries)
            u.bwd_ms = statistics.fmean(e.units[i].bwd_ms for e in entries)
            u.fixed_ms = statistics.fmean(e.units[i].fixed_ms for e in entries)
        if all(e.overheads is not None for e in entries):
            for f in fields(Overheads):
                setattr(mean.overheads, f.name, statistics.fmean(getattr(e.overheads, f.name) for e in entries))
        mean.source = f"{mean.source}, mean of {len(entries)} ranks"
        out.add(mean)
    return out


def load_or_profile(
    path: str | os.PathLike,
    units: Sequence[tuple[str, nn.Module]],
    example_input: Any,
    device_kind: str,
    precision: str = "32-true",
    model_name: str | None = None,
    **kwargs: Any,
) -> CostProfile:
    """Return the cached profile at ``path`` when it matches, else measure and update the file.

    A cached file matches when its signature (model name, unit names, parameter counts, input
    shapes) equals the model's and it has an entry for ``(device_kind, precision)``. With the same
    signature but without that entry, the new measurement is added to the file; with another
    signature the file is replaced (and a warning is logged).

    Args:
        path: JSON file of the cache.
        units, example_input, device_kind, precision, model_name: As for :func:`profile_units`.
        **kwargs: ``repeats`` and ``warmup`` for :func:`profile_units`.

    Returns:
        A profile that holds at least the requested entry.

    Raises:
        ProfileError: the file exists but is not a profile (it is not overwritten), or the
            measurement fails (see :func:`profile_units`).
    """
    path = os.fspath(path)
    kind = normalize_kind(device_kind, "`load_or_profile` device_kind")
    prec = normalize_precision(precision, "`load_or_profile`") or "32-true"
    units = list(units)
    wanted = {
        "model": model_name or "model",
        "units": [[n, c] for (n, _), c in zip(units, model_signature_counts(units))],
        "input_shapes": _shapes(as_args(example_input)),
    }
    cached = CostProfile.load(path) if os.path.exists(path) else None
    if cached is not None and cached.signature == wanted and cached.get(kind, prec) is not None:
        return cached
    fresh = profile_units(units, example_input, kind, prec, model_name=model_name, **kwargs)
    if cached is not None and cached.signature == wanted:
        fresh = cached.merge(fresh)
    elif cached is not None:
        log.warning(
            "Cost profile %s was made for another model or input shape (%s); replacing it.",
            path,
            cached.signature,
        )
    fresh.save(path)
    return fresh
