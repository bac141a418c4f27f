"""Experiment snapshots: what is needed to know, later, exactly what a run ran.

:func:`write_snapshot` fills ``<run dir>/snapshot/`` with

* ``config.yaml``: the resolved config, secrets redacted;
* ``stage_plan.json``: the stage plan with every stage's units spelled out (or ``"auto"``);
* ``snapshot.json``: the command and overrides, the code version (git commit plus a digest of the
  uncommitted changes, for the working directory and for the ``lightning_hpp`` checkout when it is
  another tree), the Python and platform, a digest of the installed packages, and the environment
  fingerprint of :func:`lightning_hpp.bias.fingerprint.collect_fingerprint` when that is available;
* ``packages.txt``: every installed distribution as ``name==version``.

Everything is passed through :func:`lightning_hpp.redaction.redact` before it is written.
:func:`scrub_hydra_files` applies the same redaction to the files Hydra itself writes
(``.hydra/*.yaml``, ``multirun.yaml``), which record the command-line overrides verbatim.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_hpp._git import code_version
from lightning_hpp.bias.packages import installed_packages, packages_digest
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.redaction import REDACTED, is_secret_name, redact

SNAPSHOT_DIR = "snapshot"


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
        "packages_digest": packages_digest(),
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


def environment_fingerprint() -> dict[str, Any] | None:
    """The coded-bias environment fingerprint of this process, or None when that module is absent."""
    try:
        from lightning_hpp.bias.fingerprint import collect_fingerprint
    except ImportError:
        return None
    return collect_fingerprint()


# --------------------------------------------------------------------------- Hydra's own files
def _redact_override(text: str) -> str:
    key, sep, _ = text.partition("=")
    if sep and is_secret_name(key.lstrip("+~").rsplit(".", 1)[-1]):
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
