"""Start Lightning-launched test jobs side by side (each job's ranks are started by Lightning itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from tests.launch import ROOT


def start_module(module: str, arg: object, env: dict[str, str | None] | None = None) -> subprocess.Popen:
    """Start ``python -m module '<json arg>'`` from the repository root without waiting.

    ``env`` sets (or, with ``None``, removes) variables before the interpreter starts, which is the
    only way PYTHONHASHSEED takes effect.
    """
    full = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    full.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    text = arg if isinstance(arg, str) else json.dumps(arg)
    return subprocess.Popen([sys.executable, "-m", module, text], cwd=ROOT, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(procs: Sequence[subprocess.Popen], timeout: float = 300) -> None:
    """Wait for every job; raise with the tail of its log if one failed (all are killed on timeout)."""
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise AssertionError(f"{' '.join(p.args[:3])} exited with {p.returncode}:\n{log[-6000:]}")
