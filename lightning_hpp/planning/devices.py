"""Device kinds per rank and the mapping of pipeline stages onto ranks.

Every rank has a *kind*: a short lowercase name such as ``"a100"``, ``"h100"`` or ``"cpu"``. It is
detected from the CUDA device name and compute capability, and can be overridden per rank (this is
how a mixed cluster is simulated on one kind of hardware):

* the ``device_map`` option: ``{0: "a100", 1: "h100"}``, ``["a100", "h100"]`` or
  ``"0:a100,1:h100"``;
* the environment variable ``HPP_DEVICE_KIND``: one kind (``"h100"``) for the process that sets it,
  or a map in the string form above, looked up by the rank.

A stage plan's ``device=`` is matched against these kinds by :func:`assign_ranks`. The table
:data:`DEVICE_SPECS` holds public datasheet numbers per kind; the partitioner uses them for memory
limits and to scale costs measured on one kind to another (an assumption it labels as such).

Everything here is a pure function of its arguments (plus ``torch.cuda`` queries in
:func:`detect_device_kind`); nothing needs ``torch.distributed``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_hpp.errors import PlacementError
from lightning_hpp.validation import check_int

ENV_VAR = "HPP_DEVICE_KIND"
"""Environment variable that overrides the detected device kind."""

_KIND_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@dataclass(frozen=True)
class DeviceSpec:
    """Public datasheet numbers for one device kind (dense math, no sparsity).

    Attributes:
        kind: The kind name.
        capability: CUDA compute capability ``(major, minor)``.
        memory_gb: Device memory in GB (1e9 bytes).
        hbm_gbps: Memory bandwidth in GB/s.
        tflops: Dense peak TFLOP/s per math class: ``"fp32"`` (no tensor cores), ``"fp16"``,
            ``"bf16"``, ``"fp8"`` (tensor cores, fp32 accumulate where the sheet distinguishes).
            A missing class means the device does not support it.
        source: Which datasheet variant the numbers come from.
    """

    kind: str
    capability: tuple[int, int]
    memory_gb: float
    hbm_gbps: float
    tflops: Mapping[str, float] = field(default_factory=dict)
    source: str = ""


DEVICE_SPECS: dict[str, DeviceSpec] = {
    s.kind: s
    for s in [
        DeviceSpec("a100", (8, 0), 80, 2039, {"fp32": 19.5, "fp16": 312, "bf16": 312}, "A100 SXM4 80GB"),
        DeviceSpec("h100", (9, 0), 80, 3350, {"fp32": 67, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9}, "H100 SXM5"),
        DeviceSpec("h200", (9, 0), 141, 4800, {"fp32": 67, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9}, "H200 SXM"),
        DeviceSpec("l4", (8, 9), 24, 300, {"fp32": 30.3, "fp16": 121, "bf16": 121, "fp8": 242.5}, "L4"),
        DeviceSpec("l40s", (8, 9), 48, 864, {"fp32": 91.6, "fp16": 362.05, "bf16": 362.05, "fp8": 733}, "L40S"),
        DeviceSpec(
            "a10g", (8, 6), 24, 600, {"fp32": 31.2, "fp16": 125, "bf16": 125}, "A10 datasheet (A10G is not published)"
        ),
        DeviceSpec("a10", (8, 6), 24, 600, {"fp32": 31.2, "fp16": 125, "bf16": 125}, "A10"),
        DeviceSpec("v100", (7, 0), 32, 900, {"fp32": 15.7, "fp16": 125}, "V100 SXM2 32GB"),
        DeviceSpec("t4", (7, 5), 16, 320, {"fp32": 8.1, "fp16": 65}, "T4"),
        DeviceSpec(
            "rtx4090", (8, 9), 24, 1008, {"fp32": 82.6, "fp16": 165.2, "bf16": 165.2, "fp8": 330.3}, "GeForce RTX 4090"
        ),
        DeviceSpec("rtx3090", (8, 6), 24, 936, {"fp32": 35.6, "fp16": 71, "bf16": 71}, "GeForce RTX 3090"),
    ]
}
"""Datasheet numbers per kind. They are assumptions when used to predict speed, and are labelled so."""

# Name tokens that identify a kind directly, checked in this order.
_NAME_TOKENS = (
    "h200",
    "h100",
    "h800",
    "gh200",
    "b200",
    "b100",
    "a100",
    "a800",
    "l40s",
    "l40",
    "l4",
    "a10g",
    "a10",
    "a30",
    "a40",
    "v100",
    "p100",
    "t4",
    "mi300x",
    "mi250x",
)


def normalize_kind(kind: object, where: str = "device kind") -> str:
    """Lowercase and validate a device kind name.

    Raises:
        PlacementError: ``kind`` is not a non-empty name of letters, digits, ``_``, ``.`` or ``-``.
    """
    text = str(kind).strip().lower() if kind is not None else ""
    if not _KIND_RE.match(text):
        raise PlacementError(
            f"{where} {kind!r} is not a device kind; use a short name such as 'a100', 'h100' or 'cpu' "
            f"(letters, digits, '_', '.', '-')."
        )
    return text


def kind_from_name(name: str, capability: tuple[int, int] | None = None) -> str:
    """The device kind for a CUDA device name such as ``"NVIDIA A100-SXM4-80GB"``.

    Args:
        name: ``torch.cuda.get_device_name()``.
        capability: ``torch.cuda.get_device_capability()``; names an unrecognised device
            (``"sm90"``) when its name is empty after sanitising.

    Returns:
        A known kind (``"a100"``, ``"h100"``, ``"rtx4090"``, ...) or the lowercased name with
        everything but letters and digits removed and vendor words dropped.
    """
    tokens = re.findall(r"[a-z0-9]+", name.lower())
    for token in _NAME_TOKENS:
        if token in tokens:
            return token
    if "rtx" in tokens:
        i = tokens.index("rtx")
        if i + 1 < len(tokens):
            return "rtx" + tokens[i + 1] + ("ada" if "ada" in tokens else "")
    words = [t for t in tokens if t not in ("nvidia", "geforce", "tesla", "amd", "generation")]
    text = "".join(words)
    if not text and capability is not None:
        text = f"sm{capability[0]}{capability[1]}"
    return text or "unknown"


def parse_device_map(device_map: Mapping[int, str] | Sequence[str] | str | None) -> dict[int, str]:
    """Normalise a ``device_map`` option to ``{rank: kind}``.

    Args:
        device_map: ``{0: "a100", 1: "h100"}``, ``["a100", "h100"]`` (index = rank),
            ``"0:a100,1:h100"`` or ``None`` (empty map).

    Raises:
        PlacementError: entries that are not ``rank:kind`` pairs, negative or repeated ranks,
            invalid kind names.
    """
    if device_map is None:
        return {}
    if isinstance(device_map, str):
        out: dict[int, str] = {}
        for item in filter(None, (p.strip() for p in device_map.split(","))):
            rank, sep, kind = item.partition(":")
            if not sep or not rank.strip().isdigit():
                raise PlacementError(
                    f"device_map entry {item!r} (in {device_map!r}) is not 'RANK:KIND'; write for "
                    f"example '0:a100,1:h100'."
                )
            r = int(rank)
            if r in out:
                raise PlacementError(f"device_map {device_map!r} gives rank {r} twice; give each rank once.")
            out[r] = normalize_kind(kind, f"device_map kind for rank {r}")
        return out
    if isinstance(device_map, Mapping):
        out = {}
        for rank, kind in device_map.items():
            check_int(rank, "`device_map` key", minimum=0, error=PlacementError, hint="Keys are ranks: 0, 1, 2, ...")
            out[rank] = normalize_kind(kind, f"device_map kind for rank {rank}")
        return out
    if isinstance(device_map, Sequence):
        return {r: normalize_kind(k, f"device_map kind for rank {r}") for r, k in enumerate(device_map)}
    raise PlacementError(
        f"device_map {device_map!r} must be a dict rank->kind, a list of kinds or a string '0:a100,1:h100'."
    )


def detect_device_kind(device=None, *, rank: int | None = None, device_map=None) -> str:
    """The device kind of this rank.

    Precedence: ``device_map`` (when given), then ``HPP_DEVICE_KIND``, then the hardware.

    Args:
        device: A ``torch.device``, an index or a string; ``None`` means the current CUDA device
            when CUDA is available, else the CPU.
        rank: This process's global rank, used to look up a map; defaults to ``$RANK`` or 0.
        device_map: Per-rank override, see :func:`parse_device_map`.

    Returns:
        The kind, for example ``"a100"`` or ``"cpu"``.

    Raises:
        PlacementError: a map that has no entry for this rank, or an invalid kind name.
    """
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    if device_map is not None:
        mapping = parse_device_map(device_map)
        if rank not in mapping:
            raise PlacementError(f"device_map {device_map!r} has no entry for rank {rank}; give a kind for every rank.")
        return mapping[rank]
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        if ":" in env:
            mapping = parse_device_map(env)
            if rank not in mapping:
                raise PlacementError(
                    f"${ENV_VAR}={env!r} has no entry for rank {rank}; give a kind for every rank, "
                    f"or a single kind for this process."
                )
            return mapping[rank]
        return normalize_kind(env, f"${ENV_VAR}")
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return "cpu"
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return kind_from_name(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


def device_capability(kind: str) -> tuple[int, int] | None:
    """The compute capability of a known kind, ``None`` for ``cpu`` and unknown kinds."""
    spec = DEVICE_SPECS.get(str(kind).lower())
    return spec.capability if spec else None


def supports_fp8(kind_or_capability: str | tuple[int, int]) -> bool:
    """Whether fp8 tensor-core math is available: compute capability >= 8.9 (Ada, Hopper and newer).

    Args:
        kind_or_capability: A kind (``"h100"``) or a capability tuple (``(8, 9)``). Unknown kinds
            and ``cpu`` answer ``False``.
    """
    if isinstance(kind_or_capability, str):
        cap = device_capability(kind_or_capability)
        if cap is None:
            return False
    else:
        cap = tuple(kind_or_capability)
    return cap >= (8, 9)


def supports_bf16(kind_or_capability: str | tuple[int, int]) -> bool:
    """Whether bf16 tensor-core math is available: compute capability >= 8.0 (``cpu`` answers ``True``)."""
    if isinstance(kind_or_capability, str):
        if kind_or_capability == "cpu":
            return True
        cap = device_capability(kind_or_capability)
        if cap is None:
            return False
    else:
        cap = tuple(kind_or_capability)
    return cap >= (8, 0)


def precision_preference(kind: str) -> list[str]:
    """Precisions a stage on ``kind`` runs in when the user did not fix one, best first.

    fp8 only where supported (capability >= 8.9), then bf16 autocast (>= 8.0), then fp16 autocast
    (>= 7.0), then fp32; ``cpu`` is fp32 only. For kinds without a datasheet entry the order is
    fp32 first, then the autocast modes (their support is unknown).
    """
    if kind == "cpu":
        return ["32-true"]
    cap = device_capability(kind)
    if cap is None:
        return ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
    prefs = []
    if cap >= (8, 9):
        prefs.append("fp8")
    if cap >= (8, 0):
        prefs.append("bf16-mixed")
    if cap >= (7, 0):
        prefs.append("16-mixed")
    prefs.append("32-true")
    return prefs


def _rank_kinds_text(rank_kinds: Sequence[str]) -> str:
    return ", ".join(f"rank {r}: {k}" for r, k in enumerate(rank_kinds))


def _greedy_rows(wanted: Sequence[str | None], have: Sequence[str], dp: int) -> list[list[int]] | None:
    """Rows of ranks per stage such that every replica's pipeline ascends in rank, or ``None``.

    Each stage takes, replica by replica, the lowest free rank of its kind above the rank that
    replica's previous stage got. Taking the lowest ranks leaves the highest ones to later stages,
    so this finds an arrangement whenever one exists (for stages with fixed kinds). A stage that
    accepts any kind only takes ranks of kinds that later stages do not need.
    """
    free = set(range(len(have)))
    prev = [-1] * dp
    rows: list[list[int]] = []
    for s, w in enumerate(wanted):
        later: dict[str, int] = {}
        for k in wanted[s + 1 :]:
            if k is not None:
                later[k] = later.get(k, 0) + dp
        row: list[int] = []
        for d in range(dp):
            lo = max(prev[d], row[-1] if row else -1)
            pick = None
            for r in sorted(free):
                if r <= lo:
                    continue
                if w is not None and have[r] != w:
                    continue
                if w is None and sum(1 for f in free if have[f] == have[r]) <= later.get(have[r], 0):
                    continue
                pick = r
                break
            if pick is None:
                return None
            row.append(pick)
            free.discard(pick)
        rows.append(row)
        prev = row
    return rows


def assign_ranks(
    stage_kinds: Sequence[str | None],
    rank_kinds: Sequence[str],
    pp_degree: int,
    dp_degree: int,
) -> list[list[int]]:
    """Choose, for every stage, the global ranks (one per data-parallel replica) that hold it.

    When every stage accepts any kind, or the default layout already matches the requested kinds,
    the layout is pipeline-outer: ``rank = stage * dp_degree + dp_index``, so the ranks of one stage
    are contiguous. Otherwise each stage takes the lowest free ranks of its kind. In every case the
    ranks of one replica ascend along the pipeline (stage ``s`` of replica ``d`` has a lower rank than
    stage ``s + 1``), because torch's pipelining addresses stage peers in group-rank order.

    Args:
        stage_kinds: Requested kind per stage (``None`` = any); one entry per stage.
        rank_kinds: The kind of every global rank, index = rank.
        pp_degree: Number of pipeline stages.
        dp_degree: Number of data-parallel replicas.

    Returns:
        ``ranks[stage][dp_index]``; replica ``d`` is the pipeline ``[ranks[s][d] for s in stages]``.
        This is the ``grid`` of :class:`lightning_hpp.pipeline.mesh.Mesh`.

    Raises:
        PlacementError: wrong lengths, kinds that are absent or too few, or kinds whose ranks cannot
            be ordered along the pipelines (the message lists the kind of every rank).
    """
    if pp_degree < 1 or dp_degree < 1:
        raise PlacementError(f"pp_degree={pp_degree!r} and dp_degree={dp_degree!r} must both be >= 1.")
    if len(stage_kinds) != pp_degree:
        raise PlacementError(
            f"{len(stage_kinds)} stage kinds given for pp_degree={pp_degree}; give one kind (or None) per stage."
        )
    world = pp_degree * dp_degree
    if len(rank_kinds) != world:
        raise PlacementError(
            f"{len(rank_kinds)} ranks for pp_degree={pp_degree} x dp_degree={dp_degree} = {world}; "
            f"the world size must equal pp_degree * dp_degree."
        )
    wanted = [None if k is None else normalize_kind(k, f"stage {s} device") for s, k in enumerate(stage_kinds)]
    have = [normalize_kind(k, f"rank {r} kind") for r, k in enumerate(rank_kinds)]

    default = [[s * dp_degree + d for d in range(dp_degree)] for s in range(pp_degree)]
    if all(w is None or all(have[r] == w for r in default[s]) for s, w in enumerate(wanted)):
        return default

    need: dict[str, int] = {}
    for w in wanted:
        if w is not None:
            need[w] = need.get(w, 0) + dp_degree
    count = {k: have.count(k) for k in set(have)}
    short = {k: (n, count.get(k, 0)) for k, n in need.items() if count.get(k, 0) < n}
    if short:
        what = "; ".join(f"{k!r}: needs {n} rank(s), has {h}" for k, (n, h) in sorted(short.items()))
        raise PlacementError(
            f"The plan asks for device kinds the ranks cannot supply ({what}). Stage kinds: {wanted}; "
            f"ranks: {_rank_kinds_text(have)}. Change the stages' `device=` (or None for any), or set "
            f"the ranks' kinds with `device_map` / ${ENV_VAR}."
        )
    rows = _greedy_rows(wanted, have, dp_degree)
    if rows is None:
        raise PlacementError(
            f"Stage kinds {wanted} cannot be laid out so that every pipeline's ranks ascend (stage s must "
            f"sit on a lower rank than stage s + 1 of the same replica); ranks: {_rank_kinds_text(have)}. "
            f"Give the earlier stages the kinds of the lower ranks, or order the ranks' kinds with "
            f"`device_map` / ${ENV_VAR}."
        )
    return rows


def tp_group_kinds(rank_kinds: Sequence[str], tp: int) -> list[str]:
    """The kind of every tensor-parallel group of ``tp`` neighbouring ranks (group ``g``: ranks ``g · tp ..
    g · tp + tp - 1``), what stages are placed on when each replica is split over ``tp`` ranks.

    Raises:
        PlacementError: a group of ranks of different kinds (a split layer runs at its slowest rank's pace).
    """
    groups = [list(rank_kinds[g * tp : (g + 1) * tp]) for g in range(len(rank_kinds) // tp)]
    mixed = [g for g, kinds in enumerate(groups) if len(set(kinds)) > 1]
    if mixed:
        g = mixed[0]
        raise PlacementError(
            f"Tensor-parallel group {g} (ranks {g * tp}-{g * tp + tp - 1}) mixes device kinds {groups[g]}; the ranks "
            f"that split one layer must be of one kind. Order the ranks' kinds so that every {tp} neighbours share "
            f"one (`device_map` / ${ENV_VAR}), or use another tp_degree."
        )
    return [kinds[0] for kinds in groups]


def stage_kind_orders(rank_kinds: Sequence[str], pp_degree: int, dp_degree: int, limit: int = 4096) -> list[list[str]]:
    """Every sequence of stage kinds that :func:`assign_ranks` can lay out on these ranks.

    Args:
        rank_kinds: The kind of every global rank.
        pp_degree, dp_degree: The layout; ``len(rank_kinds)`` must be their product.
        limit: Stop with an error beyond this many sequences.

    Returns:
        The sequences (each of length ``pp_degree``), in lexicographic order of kinds.

    Raises:
        PlacementError: wrong world size, or more than ``limit`` sequences.
    """
    have = [normalize_kind(k, f"rank {r} kind") for r, k in enumerate(rank_kinds)]
    if pp_degree < 1 or dp_degree < 1 or len(have) != pp_degree * dp_degree:
        raise PlacementError(
            f"{len(have)} ranks do not form pp_degree={pp_degree!r} x dp_degree={dp_degree!r}; the world "
            f"size must equal pp_degree * dp_degree."
        )
    kinds = sorted(set(have))
    out: list[list[str]] = []

    def extend(prefix: list[str]) -> None:
        if len(prefix) == pp_degree:
            out.append(list(prefix))
            if len(out) > limit:
                raise PlacementError(
                    f"More than {limit} stage-kind orders fit ranks {_rank_kinds_text(have)}; fix the stages' "
                    f"kinds instead of searching them."
                )
            return
        for k in kinds:
            if _greedy_rows(prefix + [k], have, dp_degree) is not None:
                extend(prefix + [k])

    extend([])
    return out
