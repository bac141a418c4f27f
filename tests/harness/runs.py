"""The typed run descriptions the training workers take (``tests.workers.run_hpp``, ``tests.workers.run_real``).

A job's argument is a :class:`Runs`: the number of ranks and the configurations the job runs one after another,
each a :class:`HppRun` or a :class:`RealRun`. It is serialised to JSON for the job's command line and parsed back
in the worker; a key that is not a field is an error in both places (a typo in a test fails the test instead of
falling back to a default silently)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


def _strict(cls, data: dict[str, Any]):
    """``cls(**data)``, or a ValueError naming the keys that are not fields of ``cls``."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))} (in {data.get('name', data)!r});"
                         f" its fields: {', '.join(sorted(names))}")
    return cls(**data)


@dataclass(frozen=True)
class HppRun:
    """One configuration of ``tests.workers.run_hpp``: ``tests.harness.zoo.MLP`` of ``depth`` under HPPStrategy.

    ``stages``: the modules of each stage (``None``: ``plan="auto"``), with ``precisions``, ``clip_norms`` and
    ``devices_kinds`` per stage; ``precision``: HPPPrecision keyword arguments, handed to the strategy (or, with
    ``init_scale``, to the Trainer as a plugin); ``strategy``: more HPPStrategy keyword arguments (option sections
    as dicts); ``validate`` / ``predict``: run them after ``fit``. Outputs go to ``out``."""

    out: str
    steps: int
    batch: int
    name: str = ""
    stages: list | None = None
    depth: int = 4
    precisions: list | None = None
    clip_norms: list | None = None
    devices_kinds: list | None = None
    precision: dict | None = None
    init_scale: float | None = None
    schedule: str | None = None
    n_micro: int | None = None
    pp: int | None = None
    timeout: float = 60
    strategy: dict = field(default_factory=dict)
    bias_monitor: bool = False
    num_nodes: int = 1
    accumulate: int = 1
    gradient_clip_val: float | None = None
    limit_val_batches: int | float = 0
    validate: bool = False
    predict: bool = False


@dataclass(frozen=True)
class RealRun:
    """One configuration of ``tests.workers.run_real``: a real model (a ``tests.harness.zoo.real`` kind, or
    ``"mlp"``) under HPPStrategy; the fields are described in that worker's docstring."""

    out: str
    model: str
    steps: int
    batch: int
    name: str = ""
    schedule: str | None = None
    n_micro: int | None = None
    points: list | str | None = None
    precision: list | None = None
    pp: int | None = None
    frontend: str = "auto"
    n: int | None = None
    limit_val_batches: int | float = 0
    model_kw: dict = field(default_factory=dict)
    wrapper: str | None = None
    strategy: dict = field(default_factory=dict)
    ckpt_dir: str | None = None
    every: int | None = None
    resume: str | None = None
    fp8_backend: str | None = None
    fp8_capable: bool = False
    gradient_clip_val: float | None = None
    refused: bool = False


@dataclass(frozen=True)
class Runs:
    """A job's argument: ``devices`` ranks run every one of ``runs`` in turn (each with its own Trainer)."""

    devices: int
    runs: tuple
    kinds: ClassVar[dict[str, type]] = {"hpp": HppRun, "real": RealRun}

    @classmethod
    def of(cls, devices: int, kind: str, runs: list[dict]) -> Runs:
        """The job of ``devices`` ranks running ``runs`` (dicts of a ``kind``'s fields, checked here)."""
        return cls(devices, tuple(_strict(cls.kinds[kind], dict(r)) for r in runs))

    def to_json(self) -> str:
        kinds = {type(r) for r in self.runs}
        kind = next(k for k, c in self.kinds.items() if {c} == kinds) if self.runs else "hpp"
        return json.dumps({"devices": self.devices, "kind": kind, "runs": [dataclasses.asdict(r) for r in self.runs]})

    @classmethod
    def from_json(cls, text: str) -> Runs:
        """The job's argument parsed back (in the worker), as strictly as :meth:`of`."""
        data = json.loads(text)
        unknown = sorted(set(data) - {"devices", "kind", "runs"})
        if unknown:
            raise ValueError(f"Runs has no field {', '.join(map(repr, unknown))}")
        return cls.of(data["devices"], data["kind"], data["runs"])
