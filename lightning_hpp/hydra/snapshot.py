"""Experiment snapshots: what is needed to know, later, exactly what a run ran.

:func:`write_snapshot` fills ``<run dir>/snapshot/`` with

* ``config.yaml``: the resolved config, secrets redacted;
* ``stage_plan.json``: the stage plan with every stage's units spelled out (or ``"auto"``);
* ``snapshot.json``: the command and overrides, the code version (git commit plus a digest of the
  uncommitted changes, for the working directory and for the ``lightning_hpp`` checkout when it is
  another tree), the Python and platform, a digest of the installed packages, and the environment
  fingerprint of :func:`lightning_hpp.bias.fingerprint.collect_fingerprint` when that is available;
* ``packages.txt``: every installed distribution as ``name==version``.

Everything is passed through :func:`lightning_hpp.checkpoint.s3.redact` before it is written.
:func:`scrub_hydra_files` applies the same redaction to the files Hydra itself writes
(``.hydra/*.yaml``, ``multirun.yaml``), which record the command-line overrides verbatim.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_hpp.checkpoint.s3 import REDACTED, redact
from lightning_hpp.planning.plan import StagePlan

SNAPSHOT_DIR = "snapshot"
_UNTRACKED_LIMIT = 16 * 2**20
"""Untracked files larger than this enter the digest by size and mtime, not by content."""


def write_snapshot(
    run_dir: str | os.PathLike,
    config: Mapping[str, Any],
    *,
    plan: StagePlan | str | None,
    overrides: Sequence[str] = (),
    cwd: str | os.PathLike | None = None,
) -> Path:
    """Write the snapshot of one run.

    Args:
        run_dir: The run directory; the snapshot goes to its ``snapshot/`` folder.
        config: The resolved config (plain containers).
        plan: The resolved stage plan, ``"auto"``, or None (no pipeline plan: DDP / FSDP).
        overrides: The command-line overrides of the run.
        cwd: Directory whose git tree is recorded; default: the working directory.

    Returns:
        The snapshot folder.
    """
    out = Path(run_dir) / SNAPSHOT_DIR
    out.mkdir(parents=True, exist_ok=True)
    cwd = Path(cwd or os.getcwd())
    (out / "config.yaml").write_text(yaml.safe_dump(redact(_plain(config)), sort_keys=False))
    plan_data: Any = plan.to_dict() if isinstance(plan, StagePlan) else plan
    (out / "stage_plan.json").write_text(json.dumps(redact(plan_data), indent=2))
    packages = installed_packages()
    (out / "packages.txt").write_text("\n".join(packages) + "\n")
    code = {"cwd": code_version(cwd)}
    package = code_version(Path(__file__).resolve().parents[1])
    if package["root"] != code["cwd"]["root"]:
        code["lightning_hpp"] = package
    info = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [sys.executable, *sys.argv],
        "cwd": str(cwd),
        "overrides": list(overrides),
        "code": code,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages_digest": hashlib.sha256("\n".join(packages).encode()).hexdigest()[:16],
        "fingerprint": environment_fingerprint(),
    }
    (out / "snapshot.json").write_text(json.dumps(_redact_overrides(redact(info)), indent=2, default=str))
    return out


def _plain(obj: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra
        pass
    return obj


def installed_packages() -> list[str]:
    """Every installed distribution as ``name==version``, sorted."""
    names = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") if dist.metadata is not None else None
        if name:
            names.add(f"{name.lower().replace('_', '-')}=={dist.version}")
    return sorted(names)


def _git(args: Sequence[str], cwd: Path) -> bytes | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def code_version(path: str | os.PathLike) -> dict[str, Any]:
    """The git commit of the tree holding ``path`` and a digest of its uncommitted changes.

    The digest covers ``git status``, the diff of tracked files against ``HEAD`` and the content of
    untracked, not ignored files, so two runs with the same digest ran the same code.

    Returns:
        ``{"root", "commit", "dirty", "dirty_digest", "changed"}``; ``{"root": None, ...}`` outside git.
    """
    path = Path(path)
    root = _git(["rev-parse", "--show-toplevel"], path)
    if root is None:
        return {"root": None, "commit": None, "dirty": None, "dirty_digest": None, "changed": []}
    top = Path(root.decode().strip())
    commit = (_git(["rev-parse", "HEAD"], top) or b"").decode().strip() or None
    status = _git(["status", "--porcelain=v1", "--untracked-files=normal"], top) or b""
    changed = [line[3:] for line in status.decode(errors="replace").splitlines() if line]
    if not status.strip():
        return {"root": str(top), "commit": commit, "dirty": False, "dirty_digest": None, "changed": []}
    h = hashlib.sha256(status)
    h.update(_git(["diff", "HEAD", "--binary", "--no-ext-diff"], top) or b"")
    untracked = (_git(["ls-files", "--others", "--exclude-standard", "-z"], top) or b"").split(b"\0")
    for name in sorted(filter(None, untracked)):
        file = top / name.decode(errors="replace")
        h.update(b"\0" + name + b"\0")
        try:
            size = file.stat().st_size
            h.update(file.read_bytes() if size <= _UNTRACKED_LIMIT else f"{size}:{file.stat().st_mtime_ns}".encode())
        except OSError:
            h.update(b"<unreadable>")
    return {"root": str(top), "commit": commit, "dirty": True, "dirty_digest": h.hexdigest()[:16], "changed": changed}


def environment_fingerprint() -> dict[str, Any] | None:
    """The coded-bias environment fingerprint of this process, or None when that module is absent."""
    try:
        from lightning_hpp.bias.fingerprint import collect_fingerprint
    except ImportError:
        return None
    return collect_fingerprint()


# --------------------------------------------------------------------------- Hydra's own files
def _is_secret_key(key: str) -> bool:
    return redact({key: "placeholder-value"}, env={})[key] == REDACTED


def _redact_override(text: str) -> str:
    key, sep, value = text.partition("=")
    if sep and _is_secret_key(key.lstrip("+~").rsplit(".", 1)[-1]):
        return f"{key}={REDACTED}"
    return text


def _redact_overrides(obj: Any) -> Any:
    """Redact ``key=value`` strings whose key names a secret (Hydra records overrides that way)."""
    if isinstance(obj, str):
        return _redact_override(obj)
    if isinstance(obj, Mapping):
        return {k: _redact_overrides(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact_overrides(v) for v in obj]
    return obj


def scrub_hydra_files(run_dir: str | os.PathLike) -> list[Path]:
    """Redact secrets in the YAML files Hydra wrote into ``run_dir`` (``.hydra/``, ``multirun.yaml``).

    Returns:
        The files that were rewritten.
    """
    run_dir = Path(run_dir)
    files = [*run_dir.glob(".hydra/*.yaml"), run_dir / "multirun.yaml"]
    changed = []
    for file in files:
        try:
            data = yaml.safe_load(file.read_text())
        except (OSError, yaml.YAMLError):
            continue
        clean = _redact_overrides(redact(data))
        if clean != data:
            file.write_text(yaml.safe_dump(clean, sort_keys=False))
            changed.append(file)
    return changed
