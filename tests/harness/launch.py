"""The one launcher of the test suite's multi-process jobs.

A :class:`Job` says what runs (a module or a script, with its argument), on how many ranks, how the ranks start
(``"lightning"``: one process that Lightning's launcher re-runs per rank; ``"forked"``: ranks forked under
``lightning_hpp.torchrun --standalone`` from one process that imported torch, Lightning and lightning_hpp;
``"per_rank"``: one process per rank started here with RANK / WORLD_SIZE / MASTER_* and its own environment, the
only way PYTHONHASHSEED differs by rank; ``"plain"``: one process, whatever it launches itself), with which extra
environment and within which time. :func:`run_jobs` starts jobs side by side, each in a process group of its own,
kills a job's whole group when it runs past its timeout (the ranks, their DataLoader workers) and returns every
job finished, with its output and its seconds. :func:`start` / :func:`finish` are the two halves, for the tests
that act on a running job (kill it, wait for a file).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
Start = Literal["lightning", "forked", "per_rank", "plain"]
# what a parent's distributed run would hand down to a job that must start its own
_INHERITED = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "MASTER_ADDR", "GROUP_RANK")


@dataclass(frozen=True)
class Job:
    """One multi-process job. ``target``: a module run as ``python -m target`` or, with ``script=True``, a file
    path or a list of argv words (an executable first); ``arg``: its argument (a string as it is, a list as words,
    anything else as one JSON word, ``None`` for none); ``ranks`` and ``start`` as in the module's docstring;
    ``env``: more environment variables (``None`` removes one) for every process; ``rank_env``: more per rank
    (``per_rank`` only, before the interpreter starts); ``cwd``: the working directory (the repository root by
    default); ``timeout``: seconds from the start of :func:`run_jobs` until the job's group is killed."""

    target: str | tuple[str, ...]
    arg: object = None
    ranks: int = 1
    start: Start = "lightning"
    env: Mapping[str, str | None] = field(default_factory=dict)
    rank_env: Mapping[int, Mapping[str, str | None]] = field(default_factory=dict)
    cwd: Path | None = None
    timeout: float = 240
    script: bool = False

    def __post_init__(self) -> None:
        if self.start not in ("lightning", "forked", "per_rank", "plain"):
            raise ValueError(f"Job.start={self.start!r}: expected 'lightning', 'forked', 'per_rank' or 'plain'")
        if self.rank_env and self.start != "per_rank":
            raise ValueError(f"Job.rank_env needs start='per_rank' (got start={self.start!r})")
        if self.start == "forked" and self.script:
            raise ValueError("Job(start='forked') runs a module (-m): give the module's name with script=False")

    def argv(self) -> list[str]:
        """The command line of the job (of each rank, for ``per_rank``)."""
        words = [] if self.arg is None else self.arg if isinstance(self.arg, list) else [_word(self.arg)]
        if self.script:
            head = list(self.target) if isinstance(self.target, tuple) else [sys.executable, str(self.target)]
            return head + words
        if self.start == "forked":
            return [sys.executable, "-m", "lightning_hpp.torchrun", "--standalone", "--nproc-per-node",
                    str(self.ranks), "-m", str(self.target), *words]
        return [sys.executable, "-m", str(self.target), *words]


@dataclass
class Finished:
    """A finished job: its exit status (the first failing rank's, for ``per_rank``), its output (every rank's,
    one after another, for ``per_rank``), and the seconds from the start of all the jobs to its end."""

    job: Job
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    rank_returncodes: list[int] = field(default_factory=list)

    def check(self) -> Finished:
        """``self``, or an AssertionError with the tail of the job's output when it failed."""
        if self.returncode != 0:
            raise AssertionError(f"{self.job.target} exited with {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n"
                                 f"--- stderr\n{self.stderr[-8000:]}")
        return self


@dataclass
class Running:
    """A started job: its processes (one, or one per rank), where their output goes, and when it started."""

    job: Job
    procs: list[subprocess.Popen]
    logs: list[tuple[Path, Path]]
    started: float

    @property
    def pid(self) -> int:
        """The id of the job's first process (which leads its process group)."""
        return self.procs[0].pid

    def poll(self) -> int | None:
        """``None`` while a process of the job runs, else its exit status (the first non-zero one)."""
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def kill(self) -> None:
        """SIGKILL the job's process groups (every process it started), then reap its processes."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.procs:
            proc.wait()


def base_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a job: this one without a parent's distributed variables, the repository first on
    PYTHONPATH, unbuffered output, then ``extra`` (``None`` removes a variable)."""
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def start(job: Job, logs: Path) -> Running:
    """Start ``job`` without waiting, its output into files under ``logs``; its process (each rank's, for
    ``per_rank``) leads a session of its own, so that killing the job's groups ends every process it started."""
    logs.mkdir(parents=True, exist_ok=True)
    tag = f"{id(job):x}-{time.monotonic_ns()}"
    cwd = job.cwd or ROOT
    procs, files = [], []
    if job.start == "per_rank":
        from lightning.fabric.plugins.environments.lightning import find_free_network_port

        port = find_free_network_port()
        for rank in range(job.ranks):
            env = base_env({**job.env, "RANK": str(rank), "WORLD_SIZE": str(job.ranks), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port), **job.rank_env.get(rank, {})})
            out, err = logs / f"{tag}.{rank}.out", logs / f"{tag}.{rank}.err"
            procs.append(_popen(job.argv(), cwd, env, out, err))
            files.append((out, err))
    else:
        out, err = logs / f"{tag}.out", logs / f"{tag}.err"
        procs.append(_popen(job.argv(), cwd, base_env(job.env), out, err))
        files.append((out, err))
    return Running(job, procs, files, time.monotonic())


def finish(running: Running, deadline: float | None = None, since: float | None = None) -> Finished:
    """Wait for ``running`` until ``deadline`` (monotonic; its start + its timeout by default); past it kill its
    process group and raise ``subprocess.TimeoutExpired`` with the tail of its output."""
    deadline = running.started + running.job.timeout if deadline is None else deadline
    while running.poll() is None:
        if time.monotonic() > deadline:
            running.kill()
            out, err = _read(running)
            raise subprocess.TimeoutExpired(running.job.argv(), running.job.timeout, out[-4000:], err[-8000:])
        time.sleep(0.05)
    return _finished(running, time.monotonic() - (running.started if since is None else since))


def run_jobs(jobs: Sequence[Job], check: bool = True) -> list[Finished]:
    """Start every job at once, wait for all, and return them finished in order; a job past its timeout has its
    process group killed (the others are killed too, and ``subprocess.TimeoutExpired`` raised). With ``check``, a
    job that failed raises AssertionError with its output.

    Only for jobs that share nothing (no directory, no port) and whose timing bounds hold with company."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hpp-jobs-") as logs:
        running = [start(job, Path(logs)) for job in jobs]
        ended: dict[int, Finished] = {}
        try:
            while len(ended) < len(running):
                for i, r in enumerate(running):
                    if i not in ended and r.poll() is not None:
                        ended[i] = _finished(r, time.monotonic() - t0)
                    elif i not in ended and time.monotonic() > t0 + r.job.timeout:
                        r.kill()
                        out, err = _read(r)
                        raise subprocess.TimeoutExpired(r.job.argv(), r.job.timeout, out[-4000:], err[-8000:])
                time.sleep(0.05)
        finally:
            for r in running:
                if r.poll() is None:
                    r.kill()
    done = [ended[i] for i in range(len(running))]
    if check:
        for f in done:
            f.check()
    return done


def run_job(job: Job, check: bool = True) -> Finished:
    """:func:`run_jobs` for one job."""
    return run_jobs([job], check=check)[0]


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


def _word(arg: object) -> str:
    """A job's argument as one command-line word: a string as it is, a run description or anything else as JSON."""
    if isinstance(arg, str):
        return arg
    if hasattr(arg, "to_json"):
        return arg.to_json()
    return json.dumps(arg)


def _popen(argv: list[str], cwd: Path, env: dict, out: Path, err: Path) -> subprocess.Popen:
    """``argv`` started in a session (process group) of its own, its output into ``out`` / ``err``."""
    with open(out, "w") as out_file, open(err, "w") as err_file:  # the child keeps its own copies
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out_file, stderr=err_file, text=True,
                                start_new_session=True)


def _read(running: Running) -> tuple[str, str]:
    outs, errs = [], []
    for out, err in running.logs:
        outs.append(out.read_text(errors="replace") if out.exists() else "")
        errs.append(err.read_text(errors="replace") if err.exists() else "")
    return "".join(outs), "".join(errs)


def _finished(running: Running, seconds: float) -> Finished:
    out, err = _read(running)
    codes = [p.returncode for p in running.procs]
    return Finished(running.job, next((c for c in codes if c != 0), 0), out, err, seconds, codes)
