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
    cmd = [sys.executable, "-m", module, _word(arg)]
    # a session of its own: on timeout every process of the job goes (the ranks Lightning started, their
    # DataLoader workers), not only the first, which would leave the others waiting forever
    job = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(job)
        raise
    proc = subprocess.CompletedProcess(cmd, job.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def run_scripts(jobs: list[tuple], timeout: float = 240, check: bool = True) -> list[subprocess.CompletedProcess]:
    """:func:`run_script` for independent jobs started side by side: ``python -m module '<json arg>'`` for
    every ``(module, arg)`` or ``(module, arg, env)`` at once (each still launches its own ranks through
    Lightning, or :func:`forked` ones under ``lightning_hpp.torchrun``; ``env``: more environment variables,
    ``None`` removing one), then wait for all.

    Only for jobs that share nothing (no directory, no port, no process count) and whose timing bounds hold
    with company: a job of 2 ranks spends most of its time with one core idle while one rank imports Lightning
    after the other. Each result has ``seconds``: from the start of all the jobs to the end of this one.
    """
    import tempfile
    import time

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    full_env.pop("LOCAL_RANK", None)
    full_env.pop("WORLD_SIZE", None)
    started = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hpp-jobs-") as logs:
        for i, (module, arg, *more) in enumerate(jobs):
            argv = arg if isinstance(arg, list) else [_word(arg)]
            out, err = Path(logs) / f"{i}.out", Path(logs) / f"{i}.err"
            env = {k: v for k, v in {**full_env, **(more[0] if more else {})}.items() if v is not None}
            with open(out, "w") as out_file, open(err, "w") as err_file:  # the child keeps its own copies
                proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, env=env, stdout=out_file,
                                        stderr=err_file, text=True, start_new_session=True)
            started.append((module, argv, proc, out, err))
        deadline = start + timeout
        ended: dict[int, float] = {}
        try:
            while len(ended) < len(started):
                for i, (_, _, proc, _, _) in enumerate(started):
                    if i not in ended and proc.poll() is not None:
                        ended[i] = time.monotonic() - start
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired([p.args for _, _, p, _, _ in started], timeout)
                time.sleep(0.05)
        finally:
            for _, _, proc, _, _ in started:
                if proc.poll() is None:
                    _kill_group(proc)
        done = []
        for i, (module, argv, proc, out, err) in enumerate(started):
            result = subprocess.CompletedProcess([sys.executable, "-m", module, *argv], proc.returncode,
                                                 out.read_text(), err.read_text())
            result.seconds = ended.get(i)  # from the start of all the jobs to the end of this one
            if check and result.returncode != 0:
                raise AssertionError(f"{module} exited with {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n"
                                     f"--- stderr\n{result.stderr[-8000:]}")
            done.append(result)
    return done


def forked(module: str, arg: object, ranks: int, env: dict | None = None) -> tuple:
    """A :func:`run_scripts` job that runs ``python -m module '<json arg>'`` on ``ranks`` ranks at once under
    ``lightning_hpp.torchrun --standalone``: every rank a fork of one process that imported torch, Lightning and
    lightning_hpp, instead of Lightning re-running the module per rank, each importing them again (6-7 s of CPU
    a rank on this kind of machine) once rank 0 has. For jobs whose subject is not Lightning's own launcher."""
    argv = ["--standalone", "--nproc-per-node", str(ranks), "-m", module, _word(arg)]
    return "lightning_hpp.torchrun", argv, env or {}


def _word(arg: object) -> str:
    """A job's argument as one command-line word: a string as it is, anything else as JSON."""
    return arg if isinstance(arg, str) else json.dumps(arg)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (session) ``proc`` leads, then reap ``proc``."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


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
    """The union of what the given ranks saved (their stages' parameters).

    A name several ranks hold (data-parallel replicas of a stage, a tied weight on two stages) must hold
    the same values on each of them (1e-6): every copy is compared, not only the last rank's."""
    state: dict[str, torch.Tensor] = {}
    holder: dict[str, int] = {}
    for r in ranks:
        for name, value in torch.load(Path(out_dir) / f"rank{r}.pt")["state"].items():
            if name in state:
                torch.testing.assert_close(value, state[name], rtol=1e-6, atol=1e-6,
                                           msg=lambda m, n=name, a=holder[name], b=r: f"{n} differs between rank {a} and rank {b}: {m}")
            else:
                state[name], holder[name] = value, r
    return state


def load_rank(out_dir: str | Path, rank: int) -> dict:
    return torch.load(Path(out_dir) / f"rank{rank}.pt")
