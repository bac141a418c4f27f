"""Environment fingerprints: what each rank runs on, gathered and compared across ranks.

A fingerprint is a JSON-serialisable dict of the facts that change numerics or data order
between processes: library versions (Python, torch, Lightning, CUDA runtime, cuDNN, NCCL,
Transformer Engine), the driver, the device, the environment variables that steer
reproducibility, the deterministic-algorithm flags, a probe of Python's string hash, the code
version (git commit plus a digest of uncommitted changes) and a digest of the installed packages.

Every rank collects its own (:func:`collect_fingerprint`), the ranks exchange them
(:func:`gather_fingerprints`) and every rank compares them the same way
(:func:`compare_fingerprints`), so all ranks reach the same verdict. A difference reads::

    cuda_version_mismatch: 11.7.1 (ranks 0-3) vs 11.7.0 (ranks 4-7)

In a heterogeneous plan, ranks of different device kinds (say A100 and H100) legitimately differ
in device name and compute capability; those differences are not reported. A difference inside
one stage's data-parallel group is always reported: those ranks must compute the same thing.

This module also holds what the coded-bias guards share: the policy values, the configuration
error and the warning category.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import socket
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_hpp._dist import all_gather_object
from lightning_hpp._git import code_version
from lightning_hpp.bias.packages import packages_digest
from lightning_hpp.errors import BiasConfigError, FingerprintMismatchError

POLICIES = ("warn", "error", "off")
"""What a guard does with a finding: warn, raise, or stay silent."""

ENV_VARS = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF")
"""Environment variables recorded in every fingerprint (plus every ``NCCL_*`` variable)."""

DEVICE_FIELDS = frozenset({"device_name", "compute_capability"})
"""Fields expected to differ between ranks of different device kinds."""

IGNORED_FIELDS = frozenset({"hostname"})
"""Fields recorded for the reader but never compared (they differ between nodes by design)."""

REPRODUCIBILITY_FIELDS = frozenset({"hash_probe", "hash_randomization", "env.PYTHONHASHSEED"})
"""Fields whose difference makes runs unrepeatable but does not skew one run (severity "reproducibility"):
with PYTHONHASHSEED unset each process draws its own str-hash seed. Every other field is "skew": different
builds, devices or settings compute different numbers on ranks that must agree."""

HASH_PROBE = "lightning_hpp-probe"
"""The string whose ``hash()`` is recorded; it differs between processes unless PYTHONHASHSEED is set."""

_TE_DISTRIBUTIONS = ("transformer_engine", "transformer-engine", "transformer_engine_torch")

_log = logging.getLogger(__name__)


class CodedBiasWarning(UserWarning):
    """A coded-bias guard found something that skews training between ranks or runs."""


def check_policy(policy: Any, where: str) -> str:
    """Validate a guard policy.

    Args:
        policy: The value given by the user.
        where: The option's name, for the message.

    Returns:
        The policy, one of :data:`POLICIES`.

    Raises:
        BiasConfigError: ``policy`` is not one of :data:`POLICIES`.
    """
    if policy not in POLICIES:
        raise BiasConfigError(
            f"{where} is {policy!r}; use one of {', '.join(repr(p) for p in POLICIES)} "
            f"('warn' reports and continues, 'error' stops, 'off' skips the check)."
        )
    return policy


# --------------------------------------------------------------------------------- collection
def collect_fingerprint(device: torch.device | str | None = None, cwd: str | None = None) -> dict[str, Any]:
    """Describe the environment of this process.

    Call it after the rank selected its device (``torch.cuda.set_device``), so that asking for the
    current device does not create a CUDA context on device 0.

    Args:
        device: The device this rank computes on; ``None`` means the current CUDA device when CUDA
            is available, else the CPU.
        cwd: Directory whose git tree gives the code version; ``None`` means the working directory.

    Returns:
        A JSON-serialisable dict; fields that do not apply (for example ``cuda_version`` on a
        CPU-only build) are ``None``.
    """
    fp: dict[str, Any] = {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "os": platform.system(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "torch": str(torch.__version__),
        "torch_git": getattr(torch.version, "git_version", None),
        "lightning": _dist_version("lightning"),
        "pytorch_lightning": _dist_version("pytorch_lightning"),
        "numpy": _dist_version("numpy"),
        "cuda_version": torch.version.cuda,
        "cudnn_version": None,
        "nccl_version": None,
        "driver_version": _driver_version(),
        "transformer_engine": next(
            (v for v in (_dist_version(d) for d in _TE_DISTRIBUTIONS) if v is not None), None
        ),
    }
    cuda = torch.cuda.is_available()
    if cuda:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        fp["cudnn_version"] = None if cudnn is None else str(cudnn)
        try:
            nccl = torch.cuda.nccl.version()
            fp["nccl_version"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
        except (AttributeError, RuntimeError):
            fp["nccl_version"] = None
    fp.update(_device_facts(device, cuda))
    fp["env"] = _env_vars()
    fp["determinism"] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    fp["hash_probe"] = hash(HASH_PROBE)
    fp["hash_randomization"] = int(sys.flags.hash_randomization)
    fp.update(_git_facts(cwd))
    fp["packages_digest"] = packages_digest()
    return fp


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        text = ""
    for token in text.split():
        parts = token.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return token
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # pynvml missing, or no driver: the field does not apply
        return None


def _device_facts(device: torch.device | str | None, cuda: bool) -> dict[str, Any]:
    dev = torch.device(device) if device is not None else None
    if dev is None and cuda:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev is not None and dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"device_type": "cuda", "device_name": torch.cuda.get_device_name(index),
                "compute_capability": f"{major}.{minor}"}
    return {"device_type": "cpu" if dev is None else dev.type, "device_name": _cpu_model(),
            "compute_capability": None}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _env_vars() -> dict[str, str | None]:
    env = {name: os.environ.get(name) for name in ENV_VARS}
    env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")})
    return env


def _git_facts(cwd: str | None) -> dict[str, Any]:
    # The same commit and digest as the experiment snapshot's `code_version`, by construction.
    version = code_version(cwd or os.getcwd())
    return {"git_commit": version["commit"], "git_dirty_digest": version["dirty_digest"]}


# --------------------------------------------------------------------------------- gathering
def gather_fingerprints(group: Any = None, fingerprint: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """All-gather the fingerprints of every rank of ``group``.

    Every rank of ``group`` must call this (it is a collective).

    Args:
        group: A ``torch.distributed`` process group; ``None`` means the world.
        fingerprint: This rank's fingerprint; ``None`` collects it now.

    Returns:
        The fingerprints, in rank order of ``group``. Without an initialised process group, a
        list holding this process's fingerprint only.
    """
    fp = collect_fingerprint() if fingerprint is None else fingerprint
    return all_gather_object(fp, group=group)


def save_fingerprints(per_rank: Sequence[dict[str, Any]], path: str) -> None:
    """Write the gathered fingerprints as JSON (any fsspec path: local, ``s3://`` ...)."""
    import fsspec

    with fsspec.open(path, "w") as f:
        json.dump({"format": 1, "ranks": list(per_rank)}, f, indent=1, sort_keys=True)


def load_fingerprints(path: str) -> list[dict[str, Any]]:
    """Read fingerprints written by :func:`save_fingerprints`.

    Raises:
        FingerprintMismatchError: the file is not a fingerprint file.
    """
    import fsspec

    with fsspec.open(path, "r") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
        raise FingerprintMismatchError(
            f"{path!r} is not a fingerprint file (expected a JSON object with a 'ranks' list); "
            f"write it with `save_fingerprints`."
        )
    return data["ranks"]


# --------------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class FingerprintDifference:
    """One field whose value differs, with who holds which value.

    Attributes:
        field: The fingerprint field (nested fields joined by dots, e.g. ``env.PYTHONHASHSEED``).
        values: The distinct values, in order of first appearance.
        holders: For each value, who holds it: ``"ranks 0-3"``, ``"rank 4"``, ``"saved"``, ...
        ranks: For each value, the ranks holding it (empty for a saved-versus-current check).
        scope: Where the difference was found when it is not the whole world, e.g.
            ``"stage 1's data-parallel group"``.
    """

    field: str
    values: tuple[Any, ...]
    holders: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...] = ()
    scope: str | None = None

    @property
    def code(self) -> str:
        """A stable identifier such as ``cuda_version_mismatch``."""
        return f"{self.field}_mismatch"

    @property
    def severity(self) -> str:
        """``"reproducibility"`` for the hash-seed fields (:data:`REPRODUCIBILITY_FIELDS`), else ``"skew"``."""
        return "reproducibility" if self.field in REPRODUCIBILITY_FIELDS else "skew"

    def blocks(self, deterministic: bool) -> bool:
        """Whether the fingerprint policy acts on this difference (skew always; reproducibility under determinism)."""
        return self.severity == "skew" or deterministic

    def to_dict(self) -> dict[str, Any]:
        """The difference as plain JSON types (values as text)."""
        return {"code": self.code, "severity": self.severity, "field": self.field, "scope": self.scope,
                "values": [_show(v) for v in self.values], "holders": list(self.holders)}

    def __str__(self) -> str:
        where = f" in {self.scope}" if self.scope else ""
        parts = " vs ".join(f"{_show(v)} ({h})" for v, h in zip(self.values, self.holders))
        return f"{self.code}{where}: {parts} [{self.severity}]"


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` → ``"ranks 0-3, 6"``; ``[5]`` → ``"rank 5"``."""
    ranks = sorted(ranks)
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(runs)}"


def flatten(fp: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested fields: ``{"env": {"X": 1}}`` → ``{"env.X": 1}``."""
    out: dict[str, Any] = {}
    for k, v in fp.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _difference(
    field: str, values: Sequence[Any], ranks: Sequence[int], scope: str | None
) -> FingerprintDifference | None:
    by_value: dict[str, list[int]] = {}
    first: dict[str, Any] = {}
    for r, v in zip(ranks, values):
        k = _key(v)
        by_value.setdefault(k, []).append(r)
        first.setdefault(k, v)
    if len(by_value) < 2:
        return None
    keys = list(by_value)
    return FingerprintDifference(
        field=field,
        values=tuple(first[k] for k in keys),
        holders=tuple(format_ranks(by_value[k]) for k in keys),
        ranks=tuple(tuple(by_value[k]) for k in keys),
        scope=scope,
    )


def compare_fingerprints(
    per_rank: Sequence[dict[str, Any]],
    stage_of_rank: Sequence[int] | None = None,
    device_kind_of_rank: Sequence[str] | None = None,
) -> list[FingerprintDifference]:
    """Find the fields whose values differ between ranks.

    Args:
        per_rank: Fingerprints indexed by rank (as :func:`gather_fingerprints` returns them).
        stage_of_rank: The pipeline stage each rank holds; ranks with the same stage form one
            data-parallel group, inside which every field must agree.
        device_kind_of_rank: The device kind each rank runs on (``"a100"``, ``"h100"``, ...).
            When given, device-specific fields (:data:`DEVICE_FIELDS`) may differ between kinds;
            they must still agree within a kind and within a stage's data-parallel group.

    Returns:
        The differences, sorted by field. Empty when the ranks agree.

    Raises:
        BiasConfigError: ``stage_of_rank`` or ``device_kind_of_rank`` does not have one entry per rank.
    """
    n = len(per_rank)
    for name, seq in (("stage_of_rank", stage_of_rank), ("device_kind_of_rank", device_kind_of_rank)):
        if seq is not None and len(seq) != n:
            raise BiasConfigError(
                f"`{name}` has {len(seq)} entries ({list(seq)!r}) but there are {n} fingerprints; "
                f"give one entry per rank, in rank order."
            )
    flat = [flatten(fp) for fp in per_rank]
    fields = sorted(set().union(*flat) - IGNORED_FIELDS) if flat else []
    diffs: list[FingerprintDifference] = []
    all_ranks = list(range(n))
    for field in fields:
        values = [f.get(field) for f in flat]
        if field not in DEVICE_FIELDS or device_kind_of_rank is None:
            d = _difference(field, values, all_ranks, None)
            if d is not None:
                diffs.append(d)
            continue
        seen: set[tuple[int, ...]] = set()
        scopes: list[tuple[str, list[int]]] = []
        for kind in dict.fromkeys(device_kind_of_rank):
            scopes.append((f"device kind {kind!r}", [r for r in all_ranks if device_kind_of_rank[r] == kind]))
        if stage_of_rank is not None:
            for stage in sorted(set(stage_of_rank)):
                scopes.append((f"stage {stage}'s data-parallel group",
                               [r for r in all_ranks if stage_of_rank[r] == stage]))
        for scope, ranks in scopes:
            if tuple(ranks) in seen:
                continue
            d = _difference(field, [values[r] for r in ranks], ranks, scope)
            if d is not None:
                seen.add(tuple(ranks))
                diffs.append(d)
    return diffs


def compare_with_saved(saved: dict[str, Any], current: dict[str, Any]) -> list[FingerprintDifference]:
    """Compare the fingerprint saved with a run (or checkpoint) against the current one.

    Use it on resume: compare each rank's current fingerprint with the saved fingerprint of the
    same rank (or of rank 0 when the world size changed).

    Args:
        saved: The fingerprint stored with the run.
        current: The fingerprint of this process now.

    Returns:
        One difference per changed field, holders ``"saved"`` and ``"current"``.
    """
    a, b = flatten(saved), flatten(current)
    diffs = []
    for field in sorted((set(a) | set(b)) - IGNORED_FIELDS):
        if _key(a.get(field)) != _key(b.get(field)):
            diffs.append(FingerprintDifference(field, (a.get(field), b.get(field)), ("saved", "current")))
    return diffs


def enforce(
    differences: Sequence[FingerprintDifference],
    policy: str,
    what: str = "environment fingerprint",
    deterministic: bool = False,
) -> None:
    """Act on differences according to a policy and their severity.

    Skew differences (and, with ``deterministic``, reproducibility ones) follow the policy; the other
    reproducibility differences are notes, logged at INFO level (except with ``"off"``).

    Args:
        differences: From :func:`compare_fingerprints` or :func:`compare_with_saved`.
        policy: ``"warn"`` emits one :class:`CodedBiasWarning`, ``"error"`` raises, ``"off"`` does nothing.
        what: What was compared, for the message.
        deterministic: The run asked for bitwise reproducibility: reproducibility differences count too.

    Raises:
        FingerprintMismatchError: ``policy == "error"`` and there is at least one difference the policy acts on.
        BiasConfigError: ``policy`` is not one of :data:`POLICIES`.
    """
    check_policy(policy, "fingerprint policy")
    if policy == "off" or not differences:
        return
    for d in differences:
        if not d.blocks(deterministic):
            _log.info("%s note: %s", what, d)
    differences = [d for d in differences if d.blocks(deterministic)]
    if not differences:
        return
    lines = "\n".join(f"  {d}" for d in differences)
    message = (
        f"The {what} differs ({len(differences)} field(s)):\n{lines}\n"
        f"Run every rank from the same image and environment (same library builds, same "
        f"PYTHONHASHSEED / CUBLAS_WORKSPACE_CONFIG / NCCL_* settings), or set the fingerprint "
        f"policy to 'warn' to continue anyway."
    )
    if policy == "error":
        raise FingerprintMismatchError(message)
    warnings.warn(message, CodedBiasWarning, stacklevel=2)
