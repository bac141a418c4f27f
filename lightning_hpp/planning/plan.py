"""Stage plans: which pipeline units form which stage, and how each stage runs.

A plan comes from one of three places and always ends as the same :class:`StagePlan`:

* the :func:`stage` decorator on module classes (:meth:`StagePlan.from_decorators`),
* a ``StagePlan([StageSpec(modules=[...]), ...])`` written in Python,
* a ``stage_plan.json`` file (:meth:`StagePlan.load`).

``StagePlan.resolve(unit_names)`` turns unit names and ranges (``"blocks.0-5"``) into the exact,
ordered list of units of every stage and checks that the stages cover every unit once, in order.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_hpp.errors import PlanError
from lightning_hpp.validation import check_bool, check_int, is_int, is_number

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "fp8")
"""Per-stage precision values a plan accepts."""

_PRECISION_ALIASES = {
    "32": "32-true",
    32: "32-true",
    "fp32": "32-true",
    "16": "16-mixed",
    16: "16-mixed",
    "bf16": "bf16-mixed",
    "fp16": "16-mixed",
    "transformer-engine": "fp8",
}

PLAN_FILENAME = "stage_plan.json"
"""The name of the resolved plan a run writes into its log directory."""

_RANGE = re.compile(r"^(?P<prefix>.+)\.(?P<lo>\d+)-(?P<hi>\d+)$")


def normalize_precision(value: Any, where: str) -> str | None:
    """Map a precision value (or Lightning's short forms) to one of :data:`PRECISIONS`."""
    if value is None:
        return None
    if isinstance(value, str) or is_int(value):
        value = _PRECISION_ALIASES.get(value, value)
    if value not in PRECISIONS:
        raise PlanError(
            f"{where}: precision {value!r} is not supported. Use one of {', '.join(PRECISIONS)}."
        )
    return value


@dataclass
class StageSpec:
    """One pipeline stage.

    Attributes:
        modules: Unit names of the LightningModule in this stage, in order. A name may be a range
            of ``nn.Sequential`` / ``nn.ModuleList`` items (``"blocks.0-5"``, inclusive) or a
            container name (``"blocks"``) meaning all its items.
        device: Device kind the stage should run on (``"a100"``, ``"h100"``, ``"cpu"``, ...);
            ``None`` means any.
        precision: One of :data:`PRECISIONS`; ``None`` means the Trainer's ``precision``.
        clip_norm: Gradient-clipping threshold for this stage; ``None`` means the Trainer's
            ``gradient_clip_val``.
        activation_checkpointing: ``True`` recomputes each unit's forward during the backward
            instead of keeping its activations (less memory, about one more forward of compute; the
            numerics are unchanged); ``False`` keeps them; ``None`` means the strategy's default.
    """

    modules: list[str] = field(default_factory=list)
    device: str | None = None
    precision: str | None = None
    clip_norm: float | None = None
    activation_checkpointing: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            self.modules = [self.modules]
        self.modules = list(self.modules)
        for name in self.modules:
            if not isinstance(name, str) or not name:
                raise PlanError(
                    f"`StageSpec.modules` holds {name!r}; every entry must be a unit name such as "
                    f"'encoder' or a range such as 'blocks.0-5'."
                )
        if self.device is not None:
            self.device = str(self.device).lower()
        self.precision = normalize_precision(self.precision, "`StageSpec`")
        if self.clip_norm is not None:
            try:
                if isinstance(self.clip_norm, (str, bool)):
                    raise TypeError
                self.clip_norm = float(self.clip_norm)
            except (TypeError, ValueError):
                raise PlanError(
                    f"`StageSpec.clip_norm` is {self.clip_norm!r}; it must be a positive number or None."
                ) from None
            if not self.clip_norm > 0:
                raise PlanError(
                    f"`StageSpec.clip_norm` is {self.clip_norm!r}; it must be > 0 (or None to use the "
                    f"Trainer's `gradient_clip_val`)."
                )
        check_bool(self.activation_checkpointing, "StageSpec(activation_checkpointing=...)", optional=True,
                   hint="None takes the strategy's default.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StagePlan:
    """An ordered list of stages plus facts derived for it (boundary dtypes, predictions).

    Attributes:
        stages: The stages, stage ``k`` at index ``k``.
        meta: Free-form facts written by the layers that use the plan (for example the boundary
            wire dtypes or predicted stage times); saved with the plan, never needed to load it.
    """

    stages: list[StageSpec]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        stages = []
        for i, s in enumerate(self.stages):
            if isinstance(s, dict):
                s = StageSpec(**s)
            if not isinstance(s, StageSpec):
                raise PlanError(f"`StagePlan` stage {i} is {s!r}; expected a `StageSpec` or a dict.")
            stages.append(s)
        if not stages:
            raise PlanError("`StagePlan` has no stages; give at least one `StageSpec`.")
        self.stages = stages

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # ---------------------------------------------------------------- cut points
    @classmethod
    def split_at(cls, points: Sequence[str], **stage_fields: Any) -> StagePlan:
        """A plan of ``len(points) + 1`` stages; stage ``k`` begins at module ``points[k - 1]``.

        Args:
            points: Module names at any depth (``"model.transformer.h.6"``), in the order ``forward``
                reaches them.
            **stage_fields: ``device``, ``precision``, ``clip_norm``, ``activation_checkpointing``: one
                value for every stage, or a list with one value per stage.

        Example::

            StagePlan.split_at(["model.transformer.h.6"], precision=["bf16-mixed", "32-true"])
        """
        points = [points] if isinstance(points, str) else list(points)
        if not points or not all(isinstance(p, str) and p for p in points):
            raise PlanError(f"`StagePlan.split_at` takes a non-empty list of module names, got {points!r}.")
        if len(set(points)) != len(points):
            raise PlanError(
                f"`StagePlan.split_at({points!r})` names a cut point twice; each stage begins at its own module."
            )
        n = len(points) + 1
        allowed = set(_STAGE_FIELDS)
        unknown = sorted(set(stage_fields) - allowed)
        if unknown:
            raise PlanError(f"`StagePlan.split_at` got unknown fields {unknown}; it takes {sorted(allowed)}.")
        per_stage: list[dict[str, Any]] = [{} for _ in range(n)]
        for key, value in stage_fields.items():
            values = list(value) if isinstance(value, (list, tuple)) else [value] * n
            if len(values) != n:
                raise PlanError(
                    f"`StagePlan.split_at(..., {key}=...)` has {len(values)} values for {n} stages; give one per stage."
                )
            for k, v in enumerate(values):
                per_stage[k][key] = v
        stages = [StageSpec(modules=[] if k == 0 else [points[k - 1]], **per_stage[k]) for k in range(n)]
        return cls(stages, {"cut_points": points})

    def cut_points(self, module_names: Sequence[str]) -> list[str]:
        """The module where each stage ``k >= 1`` begins (its first entry; ``"x.h.0-5"`` begins at ``x.h.0``).

        Raises:
            PlanError: a stage without modules after the first, or a name that is no module.
        """
        known = set(module_names)
        if self.meta.get("cut_points"):
            points = list(self.meta["cut_points"])
        else:
            points = []
            for k, spec in enumerate(self.stages[1:], start=1):
                if not spec.modules:
                    raise PlanError(
                        f"Stage {k} lists no modules; every stage after the first needs the module it begins at."
                    )
                m = _RANGE.match(spec.modules[0])
                points.append(f"{m['prefix']}.{m['lo']}" if m and spec.modules[0] not in known else spec.modules[0])
        for k, spec in enumerate(self.stages):
            for entry in spec.modules:
                m = _RANGE.match(entry)
                names = (
                    [f"{m['prefix']}.{i}" for i in range(int(m["lo"]), int(m["hi"]) + 1)]
                    if m and entry not in known
                    else [entry]
                )
                absent = [n for n in names if n not in known]
                if absent:
                    top = sorted(n for n in known if n and "." not in n)
                    raise PlanError(
                        f"Stage {k}: {absent} is no module of the model. Name modules at any depth as in "
                        f"`named_modules()`; the top-level ones are {top}."
                    )
        return points

    # ---------------------------------------------------------------- resolution against units
    def resolve(self, unit_names: Sequence[str]) -> list[list[str]]:
        """Expand every stage's ``modules`` against the model's units and validate the cover.

        Args:
            unit_names: The model's pipeline units in registration order (see ``units.py``).

        Returns:
            For each stage, the exact unit names it holds, in order.

        Raises:
            PlanError: unknown names, empty stages, units in no stage or in two, out of order.
        """
        unit_names = list(unit_names)
        index = {n: i for i, n in enumerate(unit_names)}
        if self.meta.get("cut_points"):
            # a container of units (a top-level `nn.Sequential` whose children are units) is cut before its first unit
            points = [
                p if p in index else next((u for u in unit_names if u.startswith(p + ".")), p)
                for p in self.meta["cut_points"]
            ]
            absent = [p for p in points if p not in index]
            if absent:
                raise PlanError(f"Cut points {absent} are not units of the model (units: {', '.join(unit_names)}).")
            bounds = [0] + [index[p] for p in points] + [len(unit_names)]
            if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
                raise PlanError(
                    f"Cut points {points} are not in the order of the model's units ({', '.join(unit_names)})."
                )
            return [unit_names[a:b] for a, b in zip(bounds, bounds[1:])]
        resolved: list[list[str]] = []
        for k, spec in enumerate(self.stages):
            names: list[str] = []
            for entry in spec.modules:
                names.extend(_expand(entry, unit_names, index, k))
            if not names:
                raise PlanError(
                    f"Stage {k} has no units. Every stage needs at least one unit; the model's units "
                    f"are: {', '.join(unit_names)}."
                )
            resolved.append(names)
        seen: dict[str, int] = {}
        for k, names in enumerate(resolved):
            for n in names:
                if n in seen:
                    raise PlanError(f"Unit {n!r} is in stage {seen[n]} and stage {k}; put it in exactly one stage.")
                seen[n] = k
        missing = [n for n in unit_names if n not in seen]
        if missing:
            raise PlanError(
                f"Units {missing} are in no stage. Add them to a `StageSpec` (every unit of the model "
                f"must belong to exactly one stage)."
            )
        flat = [n for names in resolved for n in names]
        if flat != unit_names:
            first = next(i for i, (a, b) in enumerate(zip(flat, unit_names)) if a != b)
            raise PlanError(
                f"Stages must hold contiguous units in model order; expected {unit_names[first]!r} at "
                f"position {first} but the plan has {flat[first]!r}. Units in order: {', '.join(unit_names)}."
            )
        return resolved

    def with_modules(self, modules: list[list[str]]) -> StagePlan:
        """The same plan with every stage's ``modules`` replaced (used after resolution)."""
        stages = [dataclasses.replace(s, modules=list(m)) for s, m in zip(self.stages, modules)]
        return StagePlan(stages, dict(self.meta))

    # ---------------------------------------------------------------- decorators
    @classmethod
    def from_decorators(cls, units: Sequence[tuple[str, Any]]) -> StagePlan | None:
        """Build a plan from ``@stage`` decorations on the units' classes.

        Undecorated units join the stage after the last decorated unit before them (stage 0 when no
        decorated unit precedes them). Returns ``None`` when no unit is decorated.
        """
        decls = [(name, getattr(type(mod), "__hpp_stage__", None)) for name, mod in units]
        if all(d is None for _, d in decls):
            return None
        assignment: list[int] = []
        specs: dict[int, dict[str, Any]] = {}
        last: int | None = None
        pending_next = False
        for name, decl in decls:
            if decl is None:
                sid = 0 if last is None else last + 1
                pending_next = last is not None
            else:
                sid = decl.stage_id
                if last is not None and sid < last:
                    raise PlanError(
                        f"Unit {name!r} is decorated `@stage({sid})` but comes after a unit of stage "
                        f"{last}; stages must follow the order in which the units are registered."
                    )
                if pending_next and sid == last:
                    raise PlanError(
                        f"Unit {name!r} is decorated `@stage({sid})`, but an undecorated unit before it "
                        f"already opened stage {sid + 1}. Decorate that unit too, or give {name!r} a "
                        f"later stage id."
                    )
                pending_next = False
                prev = specs.get(sid)
                fields = {key: getattr(decl, key) for key in _STAGE_FIELDS}
                if prev is not None:
                    for key, value in fields.items():
                        if value is not None and prev.get(key) is not None and prev[key] != value:
                            raise PlanError(
                                f"Stage {sid} is declared twice with different {key}: {prev[key]!r} and "
                                f"{value!r} (at unit {name!r}). Make the `@stage({sid}, ...)` declarations agree."
                            )
                        if value is not None:
                            prev[key] = value
                else:
                    specs[sid] = fields
                last = sid
            assignment.append(sid)
        ids = sorted(set(assignment))
        if ids != list(range(len(ids))):
            gaps = sorted(set(range(ids[-1] + 1)) - set(ids))
            raise PlanError(
                f"Stage ids {ids} have gaps (missing {gaps}); `@stage` ids must be 0, 1, 2, ... without "
                f"gaps in unit order."
            )
        stages = []
        for sid in ids:
            mods = [name for (name, _), a in zip(decls, assignment) if a == sid]
            stages.append(StageSpec(modules=mods, **specs.get(sid, {})))
        return cls(stages)

    # ---------------------------------------------------------------- JSON round-trip
    def to_dict(self) -> dict[str, Any]:
        return {"stages": [s.to_dict() for s in self.stages], "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "The stage plan") -> StagePlan:
        """A plan from its JSON form (``{"stages": [{"modules": [...], ...}, ...], "meta": {...}}``).

        Args:
            data: The parsed document.
            where: What the document is, for messages (``"Stage plan file 'plan.json'"``).

        Raises:
            PlanError: a field of the wrong type or value; the message names the field and the form it needs.
        """
        _check_document(data, where)
        try:
            return cls([StageSpec(**dict(s)) for s in data["stages"]], dict(data.get("meta") or {}))
        except PlanError as err:
            raise PlanError(f"{where}: {err}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, where: str = "The stage plan") -> StagePlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"{where} is not valid JSON: {err}.") from None
        return cls.from_dict(data, where)

    def save(self, path: str, **meta: Any) -> None:
        """Write the plan as JSON to ``path`` (any fsspec URL; parent directories are created),
        with ``meta`` added to its facts (schedule, degrees, ... of the run that used it)."""
        import fsspec

        fs, fs_path = fsspec.core.url_to_fs(str(path))
        parent = fs._parent(fs_path)
        if parent:
            fs.makedirs(parent, exist_ok=True)
        plan = self if not meta else StagePlan(self.stages, {**self.meta, **meta})
        with fs.open(fs_path, "w") as f:
            f.write(plan.to_json())

    @classmethod
    def load(cls, path: str) -> StagePlan:
        import fsspec

        try:
            with fsspec.open(str(path), "r") as f:
                text = f.read()
        except FileNotFoundError:
            raise PlanError(f"Stage plan file {str(path)!r} does not exist.") from None
        except IsADirectoryError:
            raise PlanError(
                f"Stage plan file {str(path)!r} is a directory; give the path of its stage_plan.json."
            ) from None
        return cls.from_json(text, where=f"Stage plan file {str(path)!r}")

    def table(self) -> str:
        """A short human-readable table of the plan."""
        checkpointing = any(s.activation_checkpointing is not None for s in self.stages)
        rows = [("stage", "units", "device", "precision", "clip_norm") + (("act_ckpt",) if checkpointing else ())]
        labels = self.meta.get("precision") or [None] * len(self.stages)
        for k, s in enumerate(self.stages):
            units = (
                ", ".join(s.modules) if len(s.modules) <= 4 else f"{s.modules[0]} .. {s.modules[-1]} ({len(s.modules)})"
            )
            row = (
                str(k),
                units,
                s.device or "any",
                labels[k] or s.precision or "trainer",
                "-" if s.clip_norm is None else f"{s.clip_norm:g}",
            )
            if checkpointing:
                row += ({None: "default", True: "on", False: "off"}[s.activation_checkpointing],)
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


_STAGE_FORMS = {
    "modules": 'a list of unit names such as ["encoder", "blocks.0-5"]',
    "device": 'a device kind such as "a100", or null',
    "precision": f"one of {', '.join(map(repr, PRECISIONS))}, or null",
    "clip_norm": "a number > 0, or null",
    "activation_checkpointing": "true or false, or null for the strategy's default (it must be True, False or None)",
}


def _field_ok(name: str, value: Any) -> bool:
    if name == "modules":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) and v for v in value))
    if value is None:
        return True
    if name == "device":
        return isinstance(value, str) and bool(value)
    if name == "precision":
        try:
            return normalize_precision(value, "") is not None
        except PlanError:
            return False
    if name == "clip_norm":
        return is_number(value) and value > 0
    return isinstance(value, bool)


def _check_document(data: Any, where: str) -> None:
    """Refuse a plan document field by field, naming the field and the form it needs."""
    example = '{"stages": [{"modules": ["layers.0-3"]}, {"modules": ["layers.4-6"], "precision": "bf16-mixed"}]}'
    if not isinstance(data, dict) or "stages" not in data:
        keys = sorted(data) if isinstance(data, dict) else "-"
        raise PlanError(
            f"{where}: a stage plan must be a mapping with a 'stages' list, got {type(data).__name__} "
            f"with keys {keys}. Write it as {example}."
        )
    unknown = sorted(set(data) - {"stages", "meta"})
    if unknown:
        raise PlanError(f"{where} has unknown top-level keys {unknown}; a plan has 'stages' and optionally 'meta'.")
    stages = data["stages"]
    if not isinstance(stages, list) or not stages:
        raise PlanError(
            f"{where}: `stages` is {stages!r}; expected a non-empty list of stage objects, as in {example}."
        )
    for i, spec in enumerate(stages):
        if not isinstance(spec, dict):
            raise PlanError(
                f'{where}: `stages[{i}]` is {spec!r}; expected an object such as {{"modules": ["layers.0-3"]}}.'
            )
        unknown = sorted(set(spec) - set(_STAGE_FORMS))
        if unknown:
            raise PlanError(
                f"{where}: Stage {i} of the plan has unknown keys {unknown}; allowed: {', '.join(_STAGE_FORMS)}."
            )
        for name, value in spec.items():
            if not _field_ok(name, value):
                raise PlanError(f"{where}: `stages[{i}].{name}` is {value!r}; expected {_STAGE_FORMS[name]}.")
    if data.get("meta") is not None and not isinstance(data["meta"], dict):
        raise PlanError(f"{where}: `meta` is {data['meta']!r}; expected an object (or leave it out).")


@dataclass(frozen=True)
class _StageDecl:
    stage_id: int
    device: str | None
    precision: str | None
    clip_norm: float | None
    activation_checkpointing: bool | None = None


_STAGE_FIELDS = ("device", "precision", "clip_norm", "activation_checkpointing")
"""The per-stage settings of a :class:`StageSpec` (every field but ``modules``)."""


def stage(
    stage_id: int,
    device: str | None = None,
    precision: str | None = None,
    clip_norm: float | None = None,
    activation_checkpointing: bool | None = None,
):
    """Class decorator: every instance of the decorated module class belongs to stage ``stage_id``.

    Example::

        @stage(0, device="a100", precision="16-mixed", clip_norm=1.0, activation_checkpointing=True)
        class VisionEncoder(nn.Module): ...
    """
    check_int(stage_id, "@stage(stage_id=...)", minimum=0, hint="It is the stage's position in the pipeline, from 0.")
    spec = StageSpec(
        device=device, precision=precision, clip_norm=clip_norm, activation_checkpointing=activation_checkpointing
    )  # validates the fields
    decl = _StageDecl(stage_id, spec.device, spec.precision, spec.clip_norm, spec.activation_checkpointing)

    def wrap(cls):
        if not isinstance(cls, type):
            raise PlanError(f"`@stage` decorates module classes; it was applied to {cls!r}.")
        cls.__hpp_stage__ = decl
        return cls

    return wrap


def _expand(entry: str, unit_names: list[str], index: dict[str, int], k: int) -> list[str]:
    if entry in index:
        return [entry]
    children = [n for n in unit_names if n.startswith(entry + ".")]
    if children:
        return children
    m = _RANGE.match(entry)
    if m:
        prefix, lo, hi = m["prefix"], int(m["lo"]), int(m["hi"])
        if hi < lo:
            raise PlanError(f"Stage {k}: range {entry!r} runs backwards; write '{prefix}.{hi}-{lo}'.")
        names = [f"{prefix}.{i}" for i in range(lo, hi + 1)]
        absent = [n for n in names if n not in index]
        if absent:
            raise PlanError(
                f"Stage {k}: range {entry!r} names units that do not exist: {absent}. The model's units "
                f"are: {', '.join(unit_names)}."
            )
        return names
    raise PlanError(f"Stage {k}: {entry!r} is not a unit of the model. The model's units are: {', '.join(unit_names)}.")
