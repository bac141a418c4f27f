"""The devices a plan may use: kinds, counts, memory and links, and the hosts they sit on.

A :class:`Cluster` is described as ``"128xa100,128xh100"`` (``"2xa100:40"``: 40 GB each), a mapping
``{"a100": 128}`` or a list of :class:`DeviceGroup`; :meth:`Cluster.rank_kinds` lays it out as the ranks of a
job, kind after kind, and :meth:`Cluster.hosts` puts every ``devices_per_host`` consecutive ranks of one kind on
one host (what keeps a tensor-parallel group inside a host).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_hpp.errors import PartitionError
from lightning_hpp.planning.devices import DEVICE_SPECS, normalize_kind
from lightning_hpp.validation import check_int

DEFAULT_LINK_GBPS = 25.0
"""Assumed link speed per device for stage boundaries and gradient all-reduce (200 Gb/s InfiniBand)."""

DEFAULT_DEVICES_PER_HOST = 8
"""Devices of one host where a cluster description does not say (an 8-GPU server)."""

@dataclass(frozen=True)
class DeviceGroup:
    """Devices of one kind.

    Attributes:
        kind: Device kind (``"a100"``, ``"h100"``, ``"cpu"``, ...).
        count: Number of devices.
        memory_bytes: Memory per device; ``None`` takes the datasheet value of a known kind and
            means "no limit" for ``cpu`` and unknown kinds.
        link_gbps: GB/s each device sends at (stage boundaries, gradient all-reduce).
    """

    kind: str
    count: int
    memory_bytes: float | None = None
    link_gbps: float = DEFAULT_LINK_GBPS

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", normalize_kind(self.kind, "cluster device kind"))
        check_int(self.count, f"DeviceGroup({self.kind!r}, count=...)", minimum=0, error=PartitionError)
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise PartitionError(f"Memory {self.memory_bytes!r} for kind {self.kind!r} must be > 0 bytes (or None).")
        if not self.link_gbps > 0:
            raise PartitionError(f"link_gbps {self.link_gbps!r} for kind {self.kind!r} must be > 0.")

    @property
    def memory_limit(self) -> float:
        """Memory per device in bytes (``inf`` when unlimited)."""
        if self.memory_bytes is not None:
            return float(self.memory_bytes)
        spec = DEVICE_SPECS.get(self.kind)
        return spec.memory_gb * 1e9 if spec else math.inf


_GROUP_RE = re.compile(r"^(?P<count>\d+)\s*[x*]\s*(?P<kind>[A-Za-z0-9_.-]+?)(?::(?P<mem>[0-9.]+)\s*(?:gb)?)?$",
                       re.IGNORECASE)


@dataclass
class Cluster:
    """The devices a plan may use, by kind.

    Build one from a string ``"128xa100,128xh100"`` (``"2xa100:40"`` sets 40 GB of memory), a
    mapping ``{"a100": 128, "h100": 128}``, or a list of :class:`DeviceGroup`.
    """

    groups: list[DeviceGroup]

    def __post_init__(self) -> None:
        kinds = [g.kind for g in self.groups]
        dup = sorted({k for k in kinds if kinds.count(k) > 1})
        if dup:
            raise PartitionError(f"Cluster lists kind(s) {dup} more than once; give each kind once with its count.")

    @classmethod
    def parse(cls, spec: Cluster | str | Mapping[str, int] | Sequence[DeviceGroup],
              link_gbps: float | None = None) -> Cluster:
        """Build a cluster from any accepted description.

        Args:
            spec: The description (see the class docstring).
            link_gbps: Link speed for every group that does not set its own.

        Raises:
            PartitionError: an unreadable description.
        """
        link = DEFAULT_LINK_GBPS if link_gbps is None else link_gbps
        if isinstance(spec, Cluster):
            return spec
        if isinstance(spec, str):
            groups = []
            for item in filter(None, (p.strip() for p in spec.split(","))):
                m = _GROUP_RE.match(item)
                if not m:
                    raise PartitionError(
                        f"Cluster entry {item!r} (in {spec!r}) is not 'COUNTxKIND' or 'COUNTxKIND:MEMORY_GB'; "
                        f"write for example '128xa100,128xh100' or '2xa100:40'."
                    )
                mem = float(m["mem"]) * 1e9 if m["mem"] else None
                groups.append(DeviceGroup(m["kind"], int(m["count"]), mem, link))
            if not groups:
                raise PartitionError(f"Cluster {spec!r} names no devices; write for example '128xa100,128xh100'.")
            return cls(groups)
        if isinstance(spec, Mapping):
            return cls([DeviceGroup(k, n, None, link) for k, n in spec.items()])
        if isinstance(spec, Sequence):
            return cls([g if isinstance(g, DeviceGroup) else DeviceGroup(**g) for g in spec])
        raise PartitionError(f"Cluster {spec!r} must be a string, a mapping kind->count or a list of DeviceGroup.")

    @classmethod
    def from_rank_kinds(
        cls, rank_kinds: Sequence[str], memory_bytes: Mapping[str, float] | None = None,
        link_gbps: float = DEFAULT_LINK_GBPS,
    ) -> Cluster:
        """The cluster formed by the ranks of a job, from each rank's kind."""
        memory_bytes = dict(memory_bytes or {})
        counts: dict[str, int] = {}
        for k in rank_kinds:
            counts[k] = counts.get(k, 0) + 1
        return cls([DeviceGroup(k, n, memory_bytes.get(k), link_gbps) for k, n in counts.items()])

    @property
    def kinds(self) -> list[str]:
        return [g.kind for g in self.groups]

    @property
    def total(self) -> int:
        return sum(g.count for g in self.groups)

    def group(self, kind: str) -> DeviceGroup | None:
        return next((g for g in self.groups if g.kind == kind), None)

    def describe(self) -> str:
        return ", ".join(f"{g.count}x{g.kind}" for g in self.groups)

    def rank_kinds(self) -> list[str]:
        """The kind of every rank of a job on the whole cluster: the groups' devices in turn, as listed."""
        return [g.kind for g in self.groups for _ in range(g.count)]

    def memory_bytes(self) -> dict[str, float]:
        """The memory per device of every kind that sets one."""
        return {g.kind: float(g.memory_bytes) for g in self.groups if g.memory_bytes is not None}

    def hosts(self, devices_per_host: int = DEFAULT_DEVICES_PER_HOST) -> list[str]:
        """The host of every rank of :meth:`rank_kinds`: each kind's devices fill hosts of ``devices_per_host``.

        Raises:
            PartitionError: ``devices_per_host`` not a positive integer.
        """
        per = check_int(devices_per_host, "devices_per_host", error=PartitionError)
        return [f"{g.kind}-{i // per}" for g in self.groups for i in range(g.count)]
