"""Which fp8 backend each fp8 stage runs: decided for the devices that hold the stage, the same on every rank.

On a mixed cluster the ranks differ: an A100 rank cannot run Transformer Engine's fp8, an H100 rank can,
and Transformer Engine may be installed on some nodes only. A verdict taken by each rank for its own device
would refuse, on the A100 ranks, an fp8 stage that the H100 ranks hold, while the H100 ranks go on to
the next collective and wait. So at setup every rank reports what its device can do
(:class:`DeviceCapability`: kind, compute capability, memory, Transformer Engine's version or why it is
missing), the reports are gathered over the job, and every rank decides every fp8 stage from the reports of
the ranks that hold it (:func:`decide`): all of them able to run Transformer Engine -> ``"te"``; the user's
``fp8_backend="emulate"`` -> ``"emulate"``; else every rank raises the same :class:`~lightning_hpp.errors.FP8Error`
naming each refused stage, its ranks, their kinds and why. Transformer Engine with activation checkpointing
(its recompute would advance TE's scaling state twice) is refused there too, on every rank, not at the first
training forward on the stage's ranks only.

**A mixed cluster on CPU (tests only).** ``HPP_SIMULATED_DEVICES`` gives ranks the capabilities a GPU would
report, so that a plan for a mixed cluster runs its real setup path and verdicts on gloo ranks: a JSON object
whose keys are device kinds (``"h100"``: every rank of that kind, see ``device_map`` / ``HPP_DEVICE_KIND``) or
ranks (``"1"``, which win over kinds), each ``{"capability": [9, 0], "memory_gb": 80, "te": true}``; missing
fields default to the kind's datasheet (:data:`~lightning_hpp.planning.devices.DEVICE_SPECS`) and no Transformer
Engine. A simulated device with ``"te": true`` passes the verdict as a GPU with Transformer Engine would, and its
stage then runs the quantize-dequantize emulation standing in for TE, labelled so (never claimed as fp8
speed). Never set it for a real job: it overrides what the hardware reports.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from lightning_hpp._dist import all_gather_object
from lightning_hpp.errors import FP8Error
from lightning_hpp.planning.devices import DEVICE_SPECS
from lightning_hpp.precision import fp8

SIMULATED_ENV = "HPP_SIMULATED_DEVICES"
"""The test-only variable that fakes the device capabilities of some ranks (see the module docstring)."""


@dataclass(frozen=True)
class DeviceCapability:
    """What one rank's device can do for fp8, as reported at setup.

    Attributes:
        rank: The rank.
        kind: Its device kind (``"h100"``, ``"a100"``, ``"cpu"``...).
        device: Its ``torch.device`` type (``"cuda"``, ``"cpu"``).
        name: The device's name (``"NVIDIA H100 80GB HBM3"``, ``"simulated h100"``).
        capability: CUDA compute capability, ``None`` off CUDA.
        memory_gb: Device memory, ``None`` where unknown.
        te_version: Transformer Engine's version where it imports here, else ``None``.
        reason: Why this device cannot run Transformer Engine's fp8 (``""``: it can).
        simulated: The capabilities come from ``HPP_SIMULATED_DEVICES``.
    """

    rank: int
    kind: str
    device: str
    name: str
    capability: tuple[int, int] | None
    memory_gb: float | None
    te_version: str | None
    reason: str
    simulated: bool = False

    @property
    def runs_te(self) -> bool:
        return not self.reason

    def describe(self) -> str:
        """``"device 'cuda' (device kind 'a100', rank 0: NVIDIA A100-SXM4-80GB, compute capability 8.0)"``."""
        cap = f", compute capability {self.capability[0]}.{self.capability[1]}" if self.capability else ""
        te = f", Transformer Engine {self.te_version}" if self.te_version else ""
        name = f": {self.name}" if self.name != self.device else ""
        return f"device {self.device!r} (device kind {self.kind!r}, rank {self.rank}{name}{cap}{te})"


def simulated_devices(env: Mapping[str, str] | None = None) -> dict[str, dict]:
    """``HPP_SIMULATED_DEVICES`` parsed (``{}`` when unset).

    Raises:
        FP8Error: not a JSON object of objects with the fields above.
    """
    text = (os.environ if env is None else env).get(SIMULATED_ENV, "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise FP8Error(f"${SIMULATED_ENV}={text!r} is not JSON ({err}); write e.g. "
                       f"'{{\"h100\": {{\"te\": true}}, \"a100\": {{}}}}'.") from None
    fields = {"capability", "memory_gb", "te", "name"}
    if not isinstance(value, dict) or not all(isinstance(v, dict) and set(v) <= fields for v in value.values()):
        raise FP8Error(f"${SIMULATED_ENV}={text!r}: give an object of device kinds or ranks, each an object with the "
                       f"fields {sorted(fields)}.")
    return {str(k).lower(): v for k, v in value.items()}


def local_capability(rank: int, kind: str, device: torch.device,
                     env: Mapping[str, str] | None = None) -> DeviceCapability:
    """What this rank's ``device`` can do for fp8: simulated where ``HPP_SIMULATED_DEVICES`` names this rank or its
    kind, else the hardware (:func:`~lightning_hpp.precision.fp8.fp8_capable`) and Transformer Engine's import."""
    simulated = simulated_devices(env)
    entry = simulated.get(str(rank), simulated.get(kind))
    if entry is not None:
        spec = DEVICE_SPECS.get(kind)
        cap = entry.get("capability", spec.capability if spec else None)
        cap = tuple(int(c) for c in cap) if cap is not None else None
        te = bool(entry.get("te", False))
        if cap is None or cap < fp8.MIN_CAPABILITY:
            reason = (f"compute capability {cap[0]}.{cap[1]} < {fp8.MIN_CAPABILITY[0]}.{fp8.MIN_CAPABILITY[1]}"
                      if cap is not None else f"{kind} has no fp8 tensor cores")
        else:
            reason = "" if te else "transformer_engine is not installed"
        return DeviceCapability(rank, kind, device.type, str(entry.get("name", f"simulated {kind}")), cap,
                                entry.get("memory_gb", spec.memory_gb if spec else None),
                                "simulated" if te else None, reason, simulated=True)
    ok, reason = fp8.fp8_capable(device)
    cap = name = memory = None
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap, name = torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index)
        memory = torch.cuda.get_device_properties(index).total_memory / 1e9
    version = None
    if ok:
        version = fp8.te_version()
    return DeviceCapability(rank, kind, device.type, name or device.type, cap, memory, version, "" if ok else reason)


def gather_capabilities(rank: int, kind: str, device: torch.device) -> list[DeviceCapability]:
    """Every rank's :func:`local_capability`, index = rank (collective over the world)."""
    mine = local_capability(rank, kind, device)
    return [DeviceCapability(**{**c, "capability": tuple(c["capability"]) if c["capability"] else None})
            for c in all_gather_object(asdict(mine))]


@dataclass(frozen=True)
class Verdict:
    """How one fp8 stage runs.

    Attributes:
        backend: ``"te"`` (Transformer Engine) or ``"emulate"``: what the plan reports.
        run_as: What this job runs: ``backend``, or ``"emulate"`` standing in for Transformer Engine on simulated
            devices.
        label: The stage's label in the log and in ``stage_plan.json``.
    """

    backend: str
    run_as: str
    label: str


def decide(fp8_stages: Sequence[int], stage_ranks: Mapping[int, Sequence[int]],
           capabilities: Sequence[DeviceCapability], backend: str | None, recipe: str, recompute: Sequence[bool] = (),
           device: str = "cpu") -> dict[int, Verdict]:
    """Every fp8 stage's :class:`Verdict` from the capabilities of the ranks that hold it (the same on every rank).

    Args:
        fp8_stages: The stages whose precision is ``"fp8"``.
        stage_ranks: The global ranks holding each stage (every replica of it).
        capabilities: Every rank's :class:`DeviceCapability` (empty where ``backend == "emulate"``: nothing is asked).
        backend: The user's ``fp8_backend``: ``None`` / ``"te"`` (Transformer Engine, refused where it cannot run)
            or ``"emulate"``.
        recipe: The scaling recipe (in the labels).
        recompute: Whether each stage recomputes its activations (activation checkpointing).
        device: This rank's device type (where an emulation runs, in its label).

    Raises:
        FP8Error: stages whose ranks cannot run Transformer Engine, or that run it with activation checkpointing:
            one message naming every such stage.
    """
    rc = fp8.FP8Recipe.coerce(recipe)
    if backend == "emulate":
        return {k: Verdict("emulate", "emulate", fp8.describe_backend("emulate", rc, device)) for k in fp8_stages}
    refused: list[str] = []
    out: dict[int, Verdict] = {}
    for k in fp8_stages:
        holders = [capabilities[r] for r in stage_ranks[k]]
        unable = [c for c in holders if not c.runs_te]
        if unable:
            refused.append(f"Stage {k} has precision 'fp8' but runs on " + "; and on ".join(
                f"{c.describe()}, which cannot run fp8: {c.reason}" for c in unable))
            continue
        if k < len(recompute) and recompute[k]:
            refused.append(f"Stage {k} runs Transformer Engine (fp8) with activation checkpointing; its recompute "
                           f"would advance TE's fp8 scaling state a second time. Turn "
                           f"`StageSpec(activation_checkpointing=False)` for stage {k}")
            continue
        simulated = any(c.simulated for c in holders)
        versions = sorted({c.te_version for c in holders if c.te_version})
        label = (f"fp8 (Transformer Engine, simulated: quantize-dequantize on {holders[0].device}; not fp8 speed)"
                 if simulated else f"fp8 (Transformer Engine {', '.join(versions)}, {rc.scaling} scaling)")
        out[k] = Verdict("te", "emulate" if simulated else "te", label)
    if refused:
        raise FP8Error(
            f"{'. '.join(refused)}. fp8 runs through Transformer Engine on GPUs of compute capability >= 8.9 "
            f"(H100/H200) with `transformer_engine` installed (decided for every rank that holds the stage, the "
            f"same on every rank). Fix: place the stage on 'h100' or 'h200' ranks with Transformer Engine installed "
            f"(`StageSpec(device='h100')`, the ranks' kinds by `PlacementOptions(device_map=...)`), give it another "
            f"precision (e.g. 'bf16-mixed'), or pass fp8_backend='emulate' (`HPPPrecision(fp8_backend='emulate')`) "
            f"for a quantize-dequantize emulation (fp8 numerics on any device, not fp8 speed).")
    return out

