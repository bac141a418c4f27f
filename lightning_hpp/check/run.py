"""Running a user's module both ways — one process per replica under Lightning's DDP, and under HPPStrategy — and
comparing every rank: :func:`check`.

Two ways in:

* a LightningCLI script and its configuration (``Target(script=..., config=[...])``): the script runs as the user
  runs it, with ``fit`` and the checker's overrides on its command line: the strategy (``ddp`` for the reference;
  HPPStrategy, the configuration's own if it names it, with ``pp_degree=2``), ``devices``, ``max_steps`` and a
  :class:`~lightning_hpp.check.record.CheckRecorder` appended to the callbacks;
* factories (``Target(model="pkg.mod:make_model", data="pkg.mod:make_data")``, a module path or a ``file.py``
  path): :mod:`lightning_hpp.check.worker` builds the module, the data and a Trainer.

Each job runs in a directory of its own (the run's relative paths land there), the layouts one after another,
a layout's two jobs side by side; every job's ranks start through Lightning's own launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_hpp.check.report import differences, render
from lightning_hpp.check.worker import load

LAYOUTS = {"pp2": (2, 1), "pp2dp2": (2, 2)}
"""The pipeline layouts the checker runs: ``name -> (pp, dp)``."""


@dataclass(frozen=True)
class Target:
    """What to check: a LightningCLI ``script`` with its ``config`` files and ``args``, or ``model`` / ``data``
    factories (``"pkg.mod:name"`` or ``"path/file.py:name"``, called without arguments) with the ``trainer``
    and ``strategy`` keyword arguments."""

    script: str | None = None
    config: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    model: str | None = None
    data: str | None = None
    trainer: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


@dataclass
class Report:
    """The differences per layout (empty where the layout equals the reference on every rank) and the text."""

    found: dict[str, list[tuple[str, str, str]]]
    text: str
    out: str

    @property
    def equal(self) -> bool:
        return not any(self.found.values())


def check(target: Target, *, layouts: tuple[str, ...] = ("pp2", "pp2dp2"), steps: int = 4, out: str | None = None,
          timeout: float = 900) -> Report:
    """Run ``target`` for ``steps`` training steps under each layout and its reference and compare every rank.

    Raises:
        ValueError: an unknown layout, or a target with neither a script nor a model.
        RuntimeError: a job failed (its output's tail in the message).
    """
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown}; the checker runs {sorted(LAYOUTS)}")
    if target.script is None and target.model is None:
        raise ValueError("give a LightningCLI script (with its --config) or a model factory ('pkg.module:name')")
    for ref in (target.model, target.data):
        if ref is not None:
            load(ref)  # here, before any job starts: a name that names nothing is refused with the fix
    if target.script is not None and not Path(target.script).is_file():
        raise ValueError(f"{target.script!r} is not a file; give the path of the LightningCLI script")
    root = Path(out or tempfile.mkdtemp(prefix="lightning-hpp-check-")).resolve()
    found = {}
    for name in layouts:
        pp, dp = LAYOUTS[name]
        jobs = {"reference": _job(target, root / name / "reference", devices=dp, hpp=False, pp=pp, steps=steps),
                "pipeline": _job(target, root / name / "pipeline", devices=pp * dp, hpp=True, pp=pp, steps=steps)}
        _run_side_by_side(jobs, timeout)
        records = {side: _records(root / name / side / "records") for side in jobs}
        found[name] = differences(name, dp, records["pipeline"], records["reference"])
    return Report(found, render(found), str(root))


def _job(target: Target, where: Path, *, devices: int, hpp: bool, pp: int, steps: int) -> tuple[list[str], Path]:
    """The command of one job and the directory it runs in."""
    run, records = where / "run", where / "records"
    run.mkdir(parents=True, exist_ok=True)
    if target.script is not None:
        cmd = [sys.executable, str(Path(target.script).resolve()), "fit"]
        for config in target.config:
            cmd += ["--config", str(Path(config).resolve())]
        cmd += list(target.args)
        cmd += [f"--trainer.devices={devices}", f"--trainer.max_steps={steps}",
                "--trainer.callbacks+=lightning_hpp.check.CheckRecorder", f"--trainer.callbacks.out={records}"]
        cmd += _cli_strategy(target, hpp, pp)
    else:
        spec = {"model": target.model, "data": target.data, "trainer": target.trainer, "strategy": target.strategy,
                "devices": devices, "hpp": hpp, "pp": pp, "steps": steps, "records": str(records), "seed": target.seed}
        cmd = [sys.executable, "-m", "lightning_hpp.check.worker", json.dumps(spec)]
    return cmd, run


def _cli_strategy(target: Target, hpp: bool, pp: int) -> list[str]:
    if not hpp:
        return ["--trainer.strategy=ddp"]
    named = any("HPPStrategy" in Path(c).read_text() for c in target.config) or any(
        "HPPStrategy" in a for a in target.args
    )
    return ([] if named else ["--trainer.strategy=lightning_hpp.HPPStrategy"]) + [f"--trainer.strategy.pp_degree={pp}"]


def _run_side_by_side(jobs: dict[str, tuple[list[str], Path]], timeout: float) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    started = {}
    for side, (cmd, run) in jobs.items():
        log = open(run / "output.log", "w")  # noqa: SIM115 - closed below, once the job ends
        started[side] = (
            subprocess.Popen(cmd, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
            log,
            run,
        )
    deadline = time.monotonic() + timeout
    failed = []
    for side, (proc, log, run) in started.items():
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = "timed out"
        log.close()
        if code != 0:
            failed.append(
                f"the {side} job ({' '.join(jobs[side][0])}) ended with {code}:\n"
                f"{(run / 'output.log').read_text()[-4000:]}"
            )
    if failed:
        raise RuntimeError("\n\n".join(failed))


def _records(path: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): torch.load(p, weights_only=False) for p in sorted(path.glob("rank*.pt"))}
