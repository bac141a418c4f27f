"""Cost profiles: the measured time and memory of every pipeline unit, per device kind and precision, as data.

A :class:`CostProfile` holds the costs of one model signature (class name, unit names, parameter counts)
at one input shape, with one :class:`ProfileEntry` per (device kind, precision), each a :class:`UnitCost`
per unit and the step's :class:`Overheads`. It round-trips through JSON, so a profile measured once
(:mod:`~lightning_hpp.planning.measure`), or written by hand for hardware one does not have, can be loaded
instead of measuring (:mod:`~lightning_hpp.planning.cache`). The ranks' own speeds and the mean over ranks are
in :mod:`~lightning_hpp.planning.speeds`.

Tensor parallel is a property of the model, not of a kind: ``tp_split`` (per unit, the share of its parameter
bytes a tensor-parallel plan splits), ``tp_allreduces`` (per unit, the all-reduces of its output's size a
split forward and backward run) and ``tp_degrees`` (the degrees the model's plan divides), each ``None``
where not recorded (every byte split, two all-reduces each way per unit: a transformer block as Megatron
splits it; any degree).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_hpp.errors import ProfileError, ProfileMismatchError
from lightning_hpp.planning.devices import normalize_kind
from lightning_hpp.planning.plan import normalize_precision

FORMAT = "lightning_hpp.cost_profile/1"
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
        tp_split: Per unit, the share of its parameter bytes the model's tensor-parallel plan splits (``None``: all).
        tp_allreduces: Per unit, ``[forward, backward]``: the all-reduces of its output's size that its split
            modules run for one micro-batch (a rowwise module's output, a colwise module's input gradient);
            ``None``: ``[2, 2]`` each.
        tp_degrees: The tensor-parallel degrees the model's plan divides (``[]``: none, the model has no plan;
            ``None``: any).
    """

    model: str
    unit_names: list[str]
    param_counts: list[int]
    input_shapes: list[list[int] | None]
    entries: list[ProfileEntry] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    tp_split: list[float] | None = None
    tp_allreduces: list[list[int]] | None = None
    tp_degrees: list[int] | None = None

    def __post_init__(self) -> None:
        self.unit_names = list(self.unit_names)
        self.param_counts = [int(c) for c in self.param_counts]
        if len(self.param_counts) != len(self.unit_names):
            raise ProfileError(
                f"Profile of {self.model!r} has {len(self.unit_names)} unit names but "
                f"{len(self.param_counts)} parameter counts; give one count per unit."
            )
        self.input_shapes = [None if s is None else [int(d) for d in s] for s in self.input_shapes]
        n = len(self.unit_names)
        for name, value in (("tp_split", self.tp_split), ("tp_allreduces", self.tp_allreduces)):
            if value is not None and len(value) != n:
                raise ProfileError(f"Profile of {self.model!r} gives {name} for {len(value)} units, but it has {n} "
                                   f"units; give one entry per unit (or none).")
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
            **{k: getattr(self, k) for k in ("tp_split", "tp_allreduces", "tp_degrees")
               if getattr(self, k) is not None},
        }

    def tp_shape(self) -> tuple[list[float], list[tuple[int, int]]]:
        """Per unit: the share of its parameter bytes tensor parallel splits, and its ``(forward, backward)``
        all-reduces of one micro-batch (the defaults of the class docstring where not recorded)."""
        n = len(self.unit_names)
        split = [float(x) for x in self.tp_split] if self.tp_split is not None else [1.0] * n
        reduces = [(int(f), int(b)) for f, b in self.tp_allreduces] if self.tp_allreduces is not None else [(2, 2)] * n
        return split, reduces

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
                tp_split=data.get("tp_split"),
                tp_allreduces=data.get("tp_allreduces"),
                tp_degrees=data.get("tp_degrees"),
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
