"""Start a script as N real processes over torch.distributed (gloo) and collect their JSON results."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments.lightning import find_free_network_port

REPO = Path(__file__).resolve().parents[2]


def run_ranks(
    script: str | Path,
    world_size: int,
    out_dir: Path,
    env_of_rank: dict[int, dict[str, str | None]] | None = None,
    timeout: float = 120.0,
    cwd: Path | None = None,
) -> list[dict[str, Any]]:
    """Run ``script`` once per rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT set) and read ``rank{r}.json``.

    ``env_of_rank`` sets (or, with ``None``, removes) environment variables per rank before the
    interpreter starts, which is how PYTHONHASHSEED has to be set. ``cwd`` defaults to ``out_dir``.
    """
    port = find_free_network_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
        for key, value in (env_of_rank or {}).get(rank, {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        cmd = [sys.executable, str(Path(script).resolve()), str(out_dir)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=cwd or out_dir, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode != 0:
            raise AssertionError(f"rank {rank} exited with {p.returncode}:\n{log[-4000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


@functools.lru_cache(maxsize=None)
def coded_bias_gloo_run() -> tuple[dict[str, Any], ...]:
    """The 2-rank gloo run shared by the fingerprint and audit tests (started once per session).

    Rank 0 starts with PYTHONHASHSEED=1 and rank 1 with PYTHONHASHSEED=2.
    """
    out = Path(tempfile.mkdtemp(prefix="hpp-bias-gloo-"))
    atexit.register(shutil.rmtree, out, True)
    env = {0: {"PYTHONHASHSEED": "1"}, 1: {"PYTHONHASHSEED": "2"}}
    return tuple(run_ranks(Path(__file__).parent / "gloo_worker.py", 2, out, env_of_rank=env))
