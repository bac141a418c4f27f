"""Launching multi-process test jobs as real scripts (Lightning re-launches the script per rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_script(module: str, arg: object, timeout: float = 240, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m module '<json arg>'`` from the repository root and return the finished process."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    full_env.pop("WORLD_SIZE", None)
    text = arg if isinstance(arg, str) else json.dumps(arg)
    proc = subprocess.run(
        [sys.executable, "-m", module, text], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def processes_mentioning(text: str) -> list[str]:
    """``"pid: command line"`` of every other process whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


def merged_state(out_dir: str | Path, ranks: list[int]) -> dict[str, torch.Tensor]:
    """The union of what the given ranks saved (their stages' parameters)."""
    state: dict[str, torch.Tensor] = {}
    for r in ranks:
        state.update(torch.load(Path(out_dir) / f"rank{r}.pt")["state"])
    return state


def load_rank(out_dir: str | Path, rank: int) -> dict:
    return torch.load(Path(out_dir) / f"rank{rank}.pt")
