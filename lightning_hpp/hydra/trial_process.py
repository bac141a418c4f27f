"""The process side of one trial of a sweep: its command, its process group, and what it leaves on disk.

:func:`lightning_hpp.hydra.train.launch_trial` starts every trial of a multirun as a fresh single-run
process in a session of its own. What that needs apart from the config lives here: the trial's command
line (:func:`trial_command`), running it and ending what it left behind (:func:`run_trial_process`,
:func:`end_process_group`, over the live members of its process group) and reading its ``result.json``
and log afterwards. None of it composes or checks a config, so :mod:`lightning_hpp.hydra.train` imports
it and not the other way round; it was split from there to keep that module to one concept.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

_SAFE_OVERRIDE_VALUE = re.compile(r"^[\w./:@+-]+$")


def override_arg(key: str, value: str) -> str:
    """A ``key=value`` override for the command line, the value quoted for Hydra unless it is plain."""
    if _SAFE_OVERRIDE_VALUE.match(value):
        return f"{key}={value}"
    return f"{key}=" + '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def trial_command(hc: DictConfig, run_dir: str) -> list[str]:
    """The command of one trial: ``lightning_hpp.hydra.train`` as a single run, pinned to the trial's directory."""
    cmd = [sys.executable, "-m", "lightning_hpp.hydra.train"]
    if hc.job.config_name and hc.job.config_name != "train":
        cmd += ["--config-name", hc.job.config_name]
    for source in hc.runtime.config_sources:
        if source.provider == "command-line":
            cmd += ["--config-dir", source.path if source.schema == "file" else f"{source.schema}://{source.path}"]
    passthrough = ("hydra.searchpath", "hydra/job_logging", "hydra/hydra_logging", "hydra.verbose", "hydra.job.env_set")
    cmd += [o for o in hc.overrides.hydra if o.startswith(passthrough)]
    cmd += list(hc.overrides.task)
    cmd += [override_arg("hydra.run.dir", run_dir), "hydra.mode=RUN"]
    return cmd


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def end_process_group(pgid: int, wait: float, grace: float) -> int:
    """End what is left of a trial: wait for its processes, then SIGTERM, then SIGKILL them.

    Args:
        pgid: The trial's process group (its session leader's pid).
        wait: Seconds to let the processes exit on their own (ranks finishing after rank 0).
        grace: Seconds between SIGTERM and SIGKILL.

    Returns:
        How many processes had to be signalled.
    """
    deadline = time.monotonic() + wait
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = group_members(pgid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_members(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return len(left)


def run_trial_process(
    cmd: list[str], env: dict[str, str], log_path: Path, timeout: float | None, grace: float
) -> tuple[str, int, int]:
    """Run a trial's command in a session of its own, its output to ``log_path``; end what it leaves behind.

    Args:
        cmd: The trial's command (:func:`trial_command`).
        env: The trial's environment.
        log_path: Where its stdout and stderr go (``trial.log``).
        timeout: Seconds the trial may run (``sweep.trial_timeout``); ``None``: no limit.
        grace: Seconds its other processes get after it exits, and between SIGTERM and SIGKILL.

    Returns:
        ``(status, returncode, leftovers)``: ``"ok"`` or ``"timeout"``, the exit status, and how many
        processes of its group had to be signalled (:func:`end_process_group`).
    """
    status = "ok"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finished = False
        try:
            returncode = proc.wait(timeout=timeout)
            finished = True
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:  # also on KeyboardInterrupt: the trial runs in a session of its own
            leftovers = end_process_group(proc.pid, grace if finished else 0.0, grace)
            returncode = proc.wait()
    return status, returncode, leftovers


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's content, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def error_line(text: str) -> str | None:
    """The last ``SomeError: message`` line of a log (what a failed trial died of)."""
    found = [line for line in text.splitlines() if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", line)]
    # the class name alone (`TrainConfigError: ...`), not its module path
    return re.sub(r"^(?:\w+\.)+(?=\w+:)", "", found[-1]) if found else None


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log (empty when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
