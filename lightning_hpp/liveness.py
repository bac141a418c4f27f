"""What every rank of a job is doing, and which rank holds the job up when it stops.

A rank that stops answering leaves its peers only a broken collective: gloo's ``Timed out waiting 15000ms
for recv operation`` or ``Connection closed by peer``, NCCL's watchdog, none naming the rank or what it
did. So every rank publishes a heartbeat record in the job's rendezvous store every :data:`BEAT_S`
seconds (:class:`Heartbeat`, driven by :mod:`lightning_hpp.launch`'s first-error watcher thread):

* who it is: rank, host, pid and, once its pipeline is built (:func:`set_role`: every rank's place, so a
  diagnosis names a rank's position from the grid, not from a heartbeat of its setup), its pipeline
  position, replica and stages, and the optimizer step it is at;
* what its main thread is doing, sampled from its Python stack: the innermost frame of the user's code or
  of this package (``on_train_batch_end (train.py:41): time.sleep(600)``), what it called there (a library
  entry point, storage I/O through fsspec), an :func:`activity` label where the code set one, and whether
  it waits on a peer (a frame of ``torch.distributed``, a ``work.wait()``) or does something else, and for
  how long that has not changed;
* a beat counter, which stops when the process is stopped (``SIGSTOP``) or gone.

:meth:`Heartbeat.diagnose` (run by the rank that records the job's first error, once its collective broke
or timed out) reads every rank's record twice, :data:`STALE_S` apart, and names the rank that holds the
job up, first found first:

1. a rank whose process is gone (on this host: no such process, or a zombie) or stopped (state ``T``);
   a stopped rank on this host is ended with ``SIGKILL``, since it would never end by itself;
2. a rank on another host whose heartbeat stopped (stopped, frozen or gone; on this host the process's own
   state says it, and a watcher thread starved on a loaded host may miss a beat);
3. a live rank that does not wait on a peer (a callback that sleeps, a forward that never returns, storage
   that does not answer), the one in that state for longest;
4. none: every rank waits on a peer (a collective some ranks never entered); the peers' errors stand.

When the store itself does not answer, the rank hosting it (rank 0 under Lightning's launcher) is the one:
stopped (ended here), gone, or not answering (:meth:`Heartbeat.diagnose_store_host`), with its last record,
which every rank keeps at each beat.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import re
import signal
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

BEAT_S = 1.0
"""How often a rank publishes its heartbeat record."""
STALE_S = 2.5 * BEAT_S
"""A heartbeat that did not advance in this long belongs to a process that does not run."""

_KEY = "beat/{}"
_ROLE: dict[str, Any] = {}
_ACTIVITY: list[str] = []
_LIBRARIES = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "fsspec", "s3fs",
              "botocore", "aiobotocore", "urllib3", "gcsfs", "transformers", "numpy", "threading", "concurrent",
              "asyncio", "selectors", "socket", "ssl", "http", "queue", "multiprocessing", "runpy", "contextlib",
              "functools", "typing_extensions", "tenacity", "importlib")
_STORAGE = ("fsspec", "s3fs", "botocore", "aiobotocore", "gcsfs")
_WAIT_LINE = re.compile(r"\.wait\(")
_USERINFO = re.compile(r"//[^/@\s]+@")
_LIBRARY_ROOTS = tuple(
    {os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def set_role(
    *, grid: Sequence[Sequence[int]], stages: Sequence[Sequence[int]], tp: int, step: Callable[[], int]
) -> None:
    """Every rank's place in the pipeline, named in heartbeats and diagnoses (set once the pipeline is built).

    Args:
        grid: ``grid[position][column]``: the global rank at each pipeline position of each pipeline
            (:class:`~lightning_hpp.pipeline.mesh.Mesh`; ``column = replica * tp + tp_rank``).
        stages: The stages each position holds.
        tp: The tensor-parallel degree.
        step: The optimizer step being run (read at every beat).
    """
    _ROLE.update(
        grid=[list(row) for row in grid],
        stages=[list(s) for s in stages],
        tp=tp,
        step=step,
        version=_ROLE.get("version", 0) + 1,
    )


@contextlib.contextmanager
def activity(what: str) -> Iterator[None]:
    """Name what the main thread does inside the block (``"listing 's3://bucket/run'"``) in its heartbeat;
    a no-op on other threads."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _ACTIVITY.append(what)
    try:
        yield
    finally:
        _ACTIVITY.pop()


def role_text(rank: int) -> str:
    """``"pipeline position 1 of 2, replica 0 of 2, stage 1"``, or where the rank is before its pipeline exists."""
    grid = _ROLE.get("grid")
    position = next((r for r, row in enumerate(grid) if rank in row), None) if grid else None
    if position is None:
        return "before its pipeline was built"
    tp, stages = _ROLE["tp"], _ROLE["stages"][position]
    replica, dp = grid[position].index(rank) // tp, len(grid[position]) // tp
    return (
        f"pipeline position {position} of {len(grid)}, replica {replica} of {dp}, "
        f"stage{'s' if len(stages) != 1 else ''} {', '.join(map(str, stages))}"
    )


def progress() -> tuple[int, int | None]:
    """``(role version, optimizer step)``: a heartbeat goes out at once when it changes."""
    return int(_ROLE.get("version", 0)), _step()


def _step() -> int | None:
    step = _ROLE.get("step")
    try:
        return int(step()) if step is not None else None
    except Exception:  # noqa: BLE001 - a heartbeat never fails on a step counter
        return None


@dataclass(frozen=True)
class Peer:
    """A rank's process, as it was when the job started: to tell later whether it still runs."""

    rank: int
    host: str
    pid: int
    start: str  # the process's start time (``/proc/<pid>/stat``): a reused pid is another process

    @classmethod
    def of_this_process(cls, rank: int) -> Peer:
        pid = os.getpid()
        return cls(rank, socket.gethostname(), pid, _proc_stat(pid)[1])

    def where(self) -> str:
        return f"host {self.host}, pid {self.pid}"

    def state(self) -> str:
        """``"running"``, ``"stopped"`` (SIGSTOP), ``"gone"`` (ended, or a zombie) or ``"unknown"`` (another host,
        or no ``/proc``)."""
        if self.host != socket.gethostname() or not Path("/proc").is_dir():
            return "unknown"
        state, start = _proc_stat(self.pid)
        if state is None or (self.start and start != self.start) or state in "ZX":
            return "gone"
        return "stopped" if state in "Tt" else "running"


def _proc_stat(pid: int) -> tuple[str | None, str]:
    """``(state, start time)`` of ``pid`` from ``/proc/<pid>/stat`` (``(None, "")`` when there is none)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None, ""
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], fields[19]


@dataclass
class Sample:
    """The main thread's stack at one moment: what it does, whether it waits on a peer, since when."""

    doing: str
    waiting: bool
    signature: tuple = field(repr=False, default=())


def sample_main_thread() -> Sample:
    """What the main thread is doing now (from its Python stack; see the module docstring)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None and len(frames) < 200:
        # what is read of a frame, not the frame: a frame held here would keep its locals alive past their return
        # (a start-up broadcast's bucket staged on the device, the next one staged beside it)
        frames.append(_Frame(frame.f_code, frame.f_lineno, frame.f_globals))
        frame = frame.f_back
    del frame
    if not frames:
        return Sample("not running Python code", False)
    signature = tuple((f.f_code, f.f_lineno) for f in frames[:16])
    own = next((i for i, f in enumerate(frames) if not _is_library(f) and _module(f) != __name__), None)
    waiting = any(_module(f).startswith("torch.distributed") for f in frames[:4]) or (
        own is not None and own <= 1 and bool(_WAIT_LINE.search(_line(frames[own])))
    )
    if own is None:
        text = _describe_frame(frames[0])
    else:
        text = _describe_frame(frames[own])
        if own > 0:  # what it called there: the library function it is inside
            called = frames[own - 1]
            text += f" -> {_module(called)}.{called.f_code.co_name}"
        caller = next((f for f in frames[own + 1 :] if not _is_library(f)), None)
        if caller is not None and caller.f_code.co_name != "<module>":
            text += f", called from {caller.f_code.co_name} ({_short(caller.f_code.co_filename)}:{caller.f_lineno})"
    if any(_module(f).split(".")[0] in _STORAGE for f in frames):
        text += f" (storage I/O through fsspec{_endpoint()})"
    if _ACTIVITY:
        text = f"{_ACTIVITY[-1]}: {text}"
    return Sample(("waiting on a peer in " if waiting else "in ") + text, waiting, signature)


class _Frame(NamedTuple):
    """The parts of a frame the diagnosis reads (its code, line and module), without its locals."""

    f_code: Any
    f_lineno: int
    f_globals: dict


def _module(frame: Any) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _is_library(frame: Any) -> bool:
    """Whether ``frame`` runs an installed library's code (or the standard library's), not the user's or ours."""
    name = _module(frame)
    if name.startswith("lightning_hpp"):
        return False
    top = name.split(".")[0]
    path = frame.f_code.co_filename
    return (
        top in _LIBRARIES
        or top in sys.stdlib_module_names
        or not name
        or path.startswith("<")
        or any(path.startswith(root) for root in _LIBRARY_ROOTS)
    )


def _line(frame: Any) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


def _short(path: str) -> str:
    return next(
        (path[path.rfind(m) + 1 :] for m in ("/lightning_hpp/", "/tests/") if m in path), os.path.basename(path)
    )


def _describe_frame(frame: Any) -> str:
    line = _line(frame)
    where = f"{frame.f_code.co_name} ({_short(frame.f_code.co_filename)}:{frame.f_lineno})"
    return where + (f": `{line[:120]}`" if line else "")


def _endpoint() -> str:
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return f"; S3 endpoint {_USERINFO.sub('//***@', os.environ[name])}"
    return ""


@dataclass(frozen=True)
class Blame:
    """The rank that holds the job up, and the sentence that names it.

    Attributes:
        rank: Its global rank.
        text: ``"rank 3 (host h, pid 12, pipeline position 1 of 2, ...) stopped answering at step 3: ..."``.
        gone: Ranks whose processes are gone or were ended (they will never read the first error).
    """

    rank: int
    text: str
    gone: tuple[int, ...] = ()

    def record(self) -> dict[str, Any]:
        """The job's first-error record (:mod:`lightning_hpp.launch`) for this blame."""
        return {"rank": self.rank, "error": self.text, "blame": True, "gone": list(self.gone)}


class Heartbeat:
    """This rank's heartbeat in the job's store, and the diagnosis over every rank's.

    Args:
        rank, world_size: This rank and the job's size.
        peers: Every rank's :class:`Peer`, index = rank (gathered when the job started).
        store_host: The rank whose process hosts the store (``None``: another process, torchrun's agent).
    """

    def __init__(self, rank: int, world_size: int, peers: Sequence[Peer], store_host: int | None) -> None:
        self.rank, self.world_size, self.peers, self.store_host = rank, world_size, list(peers), store_host
        self.beats = 0
        self.host_record: dict[str, Any] | None = None  # the store host's last record, for when the store is gone
        self._last: Sample | None = None
        self._since = time.monotonic()

    def now(self) -> dict[str, Any]:
        """This rank's record now: the main thread sampled (and how long that has not changed)."""
        s = sample_main_thread()
        t = time.monotonic()
        if self._last is None or s.signature != self._last.signature or s.waiting != self._last.waiting:
            self._since = t
        self._last = s
        step = _step()
        self.beats += 1
        return {
            "rank": self.rank,
            "beat": self.beats,
            "role": role_text(self.rank),
            "step": step,
            "doing": s.doing,
            "waiting": s.waiting,
            "for_s": round(t - self._since, 1),
        }

    def publish(self, store: Any) -> dict[str, Any]:
        """Write this rank's record to ``store`` and keep the store host's last one; returns this rank's."""
        record = self.now()
        store.set(_KEY.format(self.rank), json.dumps(record))
        host = self.store_host
        if host is not None and host != self.rank and store.check([_KEY.format(host)]):
            self.host_record = json.loads(store.get(_KEY.format(host)))
        return record

    def read(self, store: Any) -> list[dict[str, Any] | None]:
        """Every rank's last record (``None`` where a rank never published one)."""
        keys = [_KEY.format(r) for r in range(self.world_size)]
        if store.check(keys):
            return [json.loads(v) for v in store.multi_get(keys)]
        return [json.loads(store.get(k)) if store.check([k]) else None for k in keys]

    def diagnose(self, store: Any, wait_s: float = STALE_S, min_busy_s: float = 0.0) -> Blame | None:
        """The rank that holds the job up (see the module docstring), or ``None`` where every rank waits on a
        peer; stopped ranks on this host are ended with ``SIGKILL``.

        Args:
            store: The job's store (every rank's record).
            wait_s: How long apart the two reads of the records are.
            min_busy_s: A live rank counts as holding the job up once it has been busy this long (half the
                job's timeout: a rank busy for less is reacting to the break, as this one is).

        Raises:
            RuntimeError: the store does not answer (see :meth:`diagnose_store_host`).
        """
        first = self.read(store)
        time.sleep(wait_s)
        second = self.read(store)
        found: list[tuple[int, float, int, str]] = []  # (order, -for_s, rank, verdict)
        gone: list[int] = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            a, b = first[r], second[r]
            state = self.peers[r].state() if r < len(self.peers) else "unknown"
            # a heartbeat that did not advance says something only of another host's rank: on this host the
            # process's own state does (a starved watcher thread on a loaded host misses a beat or two)
            silent = state == "unknown" and (b is None or (a is not None and b["beat"] <= a["beat"]))
            if state == "gone":
                found.append((0, 0.0, r, "is gone (its process ended: killed or crashed)"))
                gone.append(r)
            elif state == "stopped":
                killed = self._end(r)
                found.append(
                    (
                        0,
                        0.0,
                        r,
                        "is stopped (SIGSTOP: its process does not run)"
                        + (f"; rank {self.rank} ended it with SIGKILL" if killed else ""),
                    )
                )
                gone.append(r)
            elif silent:
                found.append(
                    (
                        1,
                        0.0,
                        r,
                        "stopped answering (its heartbeat stopped: the process is stopped, "
                        "frozen or gone; end it on its host)",
                    )
                )
            elif b is not None and not b["waiting"] and float(b["for_s"]) >= min_busy_s:
                found.append((2, -float(b["for_s"]), r, f"stopped answering: for {b['for_s']:g} s it has been"))
        if not found:
            return None
        found.sort()
        _, _, r, verdict = found[0]
        text = self._sentence(r, verdict, second[r] or first[r])
        also = [o for order, _, o, _ in found[1:] if order < 2]  # other ranks gone, stopped or silent
        waited = self.world_size - 1 - len(also)
        text += f"; the other {waited} rank(s) waited for it in collectives or pipeline transfers"
        if also:
            text += f"; not answering either: {', '.join(f'rank {o}' for o in also)}"
        return Blame(r, text, tuple(gone))

    def diagnose_store_host(self) -> Blame | None:
        """The blame when the job's store did not answer: its host rank, stopped (ended here), gone or unanswering.
        ``None`` when the store lives in another process (torchrun's agent)."""
        r = self.store_host
        if r is None or r == self.rank or r >= len(self.peers):
            return None
        state = self.peers[r].state()
        for _ in range(10):  # a process being ended (by a peer's SIGKILL) runs for a moment before it is gone
            if state != "running":
                break
            time.sleep(0.1)
            state = self.peers[r].state()
        if state == "stopped":
            killed = self._end(r)
            verdict = "is stopped (SIGSTOP: its process does not run), and the job's store it hosts with it" + (
                f"; rank {self.rank} ended it with SIGKILL" if killed else ""
            )
        elif state == "gone":
            verdict = "is gone (its process ended: killed or crashed), and the job's store it hosted with it"
        else:
            verdict = "does not answer: the job's store it hosts gave no answer (stopped, frozen, gone or cut off)"
        return Blame(r, self._sentence(r, verdict, self.host_record), (r,) if state in ("stopped", "gone") else ())

    def _sentence(self, r: int, verdict: str, record: dict[str, Any] | None) -> str:
        """``"rank 3 (host h, pid 12, pipeline position 1 of 2, ...) <verdict> at step 3: <what it was doing>"``."""
        peer = self.peers[r] if r < len(self.peers) else None
        where = peer.where() if peer is not None else "host unknown"
        role = role_text(r)  # known here once the pipeline is built: fresher than a heartbeat of the setup
        if record is None:
            return f"rank {r} ({where}{'' if role.startswith('before') else ', ' + role}) {verdict}"
        if not role.startswith("before"):
            record = {**record, "role": role}
        step = f" at step {record['step']}" if record.get("step") is not None else ""
        busy = "stopped answering: "
        if verdict.startswith(busy):  # "stopped answering: for 11 s it has been" -> "... at step 3: for 11 s ..."
            return f"rank {r} ({where}, {record['role']}) {busy[:-2]}{step}: {verdict[len(busy) :]} {record['doing']}"
        step = f", at step {record['step']}" if record.get("step") is not None else ""
        return f"rank {r} ({where}, {record['role']}) {verdict}; its last heartbeat{step}: {record['doing']}"

    def _end(self, r: int) -> bool:
        """``SIGKILL`` rank ``r``'s stopped process on this host (it would never end by itself)."""
        peer = self.peers[r]
        if peer.state() != "stopped":
            return False
        with contextlib.suppress(OSError):
            os.kill(peer.pid, signal.SIGKILL)
            return True
        return False
