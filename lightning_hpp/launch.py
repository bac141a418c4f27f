"""Starting and ending the processes of a pipeline job, the way Lightning starts DDP.

* :class:`Launcher`: Lightning's subprocess launcher, with one hook that rewrites ``Trainer.fit``'s
  ``ckpt_path`` on every rank before the run starts (``resume="auto"``, ``"last"`` on ``s3://``),
  and the first error of the job reported by every rank (:func:`first_error`);
* :func:`init_process_group`: Lightning's connection set-up, plus the store prefix that restarts
  under torchrun's c10d rendezvous need;
* :func:`shutdown`: at interpreter exit, finish a background checkpoint upload, then close the
  process groups.

**The first error wins.** When one rank raises, its peers only learn that a connection closed
(gloo's ``Connection closed by peer``) or that a collective timed out. So the rank that fails
first writes its exception to the job's rendezvous store (``TCPStore``) before its connections
close, and every rank that fails after it reads it back: a rank whose own error is a broken
collective raises :class:`~lightning_hpp.errors.RankFailedError` naming the first rank and
repeating its exception; a rank with an error of its own keeps it, with the first one added as a
note. Rank 0 hosts the store (unless torchrun's agent does), so after closing its process groups
it waits, at most :data:`STORE_GRACE_S` seconds, until the other ranks have read it and exited.

**A rank that hangs or dies ends every rank**, within ``HPPStrategy(timeout=...)`` plus a margin, each with
an error naming it. Every group takes the timeout (:mod:`lightning_hpp._dist`), so the peers' collectives
break instead of waiting torch's 30 minutes; the rank that records the first error of such a break first
asks :mod:`lightning_hpp.liveness` which rank held the job up (rank, host, pid, pipeline position, step, what
its main thread was doing) and records that instead of its own broken collective. Every rank's watcher
thread, once it learns the first error, aborts the process groups (NCCL; :func:`~lightning_hpp._dist.abort_groups`)
and gives the main thread :data:`GRACE_S` seconds to end; a main thread still stuck then (the rank that
hangs, a collective without end) is ended by the watcher with the error printed and exit code 1. A rank
whose main thread has waited on a peer for the timeout plus :data:`GRACE_S` records the first error itself.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_hpp import _dist, liveness
from lightning_hpp.checkpoint.save import wait_for_pending_save
from lightning_hpp.errors import PlanError, RankFailedError
from lightning_hpp.redaction import redact
from lightning_hpp.validation import is_number

STORE_GRACE_S = 30.0
"""The longest that the rank hosting the store stays up after an error for the others to read it."""
WATCH_SLICE_S = 0.2
"""How often a rank's first-error watcher looks for the job's first error in the store."""
GRACE_S = 10.0
"""How long a rank's main thread has to end once the job's first error is known, before its watcher ends it."""
STORE_OP_S = 10.0
"""The longest one call to the job's store may take (a store that does not answer is a stopped or gone host)."""
FIRST_WAIT_S = 10.0
"""How long a failing rank waits for the rank recording the job's first error (which may be naming a hung rank)."""

_FIRST = "first_error"
_COUNT = "errors"
_LEFT = "left"
_COMM_FAILURES = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out", "gloo", "NCCL")


BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
"""The ``torch.distributed`` backends ``HPPStrategy(process_group_backend=...)`` accepts."""


def check_backend(value: Any) -> str | None:
    """``HPPStrategy(process_group_backend=...)``: a backend name or ``None`` (gloo on CPU, nccl on CUDA)."""
    if value is not None and value not in BACKENDS:
        raise PlanError(
            f"`HPPStrategy(process_group_backend={value!r})` is not a torch.distributed backend; use one of "
            f"{', '.join(map(repr, BACKENDS))} or None (gloo on CPU, nccl on CUDA)."
        )
    return value


def check_timeout(value: Any) -> timedelta:
    """``HPPStrategy(timeout=...)`` as a ``timedelta``: a positive one, or a positive number of seconds."""
    if isinstance(value, timedelta) and value.total_seconds() > 0:
        return value
    if is_number(value) and value > 0:
        return timedelta(seconds=float(value))
    raise PlanError(
        f"`HPPStrategy(timeout={value!r})`: use a positive number of seconds or a `datetime.timedelta`, "
        f"e.g. `timeout=600`."
    )


class Launcher(_SubprocessScriptLauncher):
    """Lightning's launcher; ``resolve_fit_ckpt(trainer, ckpt_path)`` runs on every rank first."""

    def __init__(self, resolve_fit_ckpt: Callable[[Any, Any], Any], *args: Any) -> None:
        super().__init__(*args)
        self._resolve_fit_ckpt = resolve_fit_ckpt

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Trainer.fit calls launch(_fit_impl, model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)
        if trainer is not None and getattr(function, "__name__", "") == "_fit_impl" and len(args) >= 5:
            args = (*args[:4], self._resolve_fit_ckpt(trainer, args[4]), *args[5:])
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except Exception as exc:
            error = first_error(exc)
            if error is exc:
                raise
            raise error from exc


_STUCK = threading.Event()  # a call to the job's store did not return: its host is stopped (or the network is)


def _bounded(fn: Callable[[], Any], seconds: float = STORE_OP_S) -> Any:
    """``fn()`` (a call to the job's store), or :class:`RuntimeError` after ``seconds``.

    torch's ``TCPStore`` client waits forever for a host process that is stopped (its operations do not take
    the client's timeout), so every call runs on a daemon thread of its own and is given up on after the
    bound; once one was, the store counts as gone and later calls fail at once.
    """
    if _STUCK.is_set():
        raise RuntimeError("the job's store did not answer before")
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="lightning_hpp-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _STUCK.set()
        raise RuntimeError(f"the job's store did not answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class _BoundedStore:
    """A store client whose every call returns, or raises, within :data:`STORE_OP_S` (:func:`_bounded`)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        seconds = STORE_OP_S + (FIRST_WAIT_S if name == "wait" else 0.0)
        return lambda *args, **kwargs: _bounded(lambda: method(*args, **kwargs), seconds)


class _Job:
    """This rank's line to the job's rendezvous store, once the default process group exists.

    Two client connections: the watcher thread (first errors, heartbeats) uses one, this thread the other.
    """

    def __init__(self) -> None:
        self.store: Any = None
        self.rank = 0
        self.world_size = 1
        self.hosts_store = False
        self.first: dict | None = None  # the job's first error, once known
        self.server: Any = None  # rank 0: the rendezvous store it hosts, kept alive past the process group
        self.heart: liveness.Heartbeat | None = None
        self.timeout_s = 0.0
        self.exit: Callable[[int], None] = os._exit  # how the watcher ends a rank whose main thread is stuck
        self._left = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        hosts_store: bool,
        prefix: str,
        timeout: timedelta,
        peers: list[liveness.Peer],
        store_host: int | None,
    ) -> None:
        op = timedelta(seconds=min(timeout.total_seconds(), STORE_OP_S))

        def client() -> Any:
            return _BoundedStore(dist.PrefixStore(prefix, dist.TCPStore(address, port, is_master=False, timeout=op)))

        self.store, self.rank, self.world_size, self.hosts_store = client(), rank, world_size, hosts_store
        self.server = dist.distributed_c10d._get_default_store() if hosts_store else None
        self.first, self._left, self.timeout_s = None, False, timeout.total_seconds()
        self.heart = liveness.Heartbeat(rank, world_size, peers, store_host)
        self.heart.publish(self.store)  # every rank has a record before any can be diagnosed
        self._stop.clear()
        self._watcher = threading.Thread(
            target=self._watch, args=(client(),), name="lightning_hpp-first-error", daemon=True
        )
        self._watcher.start()

    def _watch(self, store: Any) -> None:
        """Publish this rank's heartbeat and learn the job's first error; then bound the rank's end.

        Looks every :data:`WATCH_SLICE_S` with ``check`` (an answer at once) and sleeps on the stop event in
        between, so that :meth:`stop` ends the thread before the interpreter exits (a daemon thread still
        inside a store call when Python finalizes is killed by a forced unwind through pybind11's frames,
        which aborts the process: "terminate called without an active exception"). A ``wait`` in slices
        instead had torch's store client log two lines per slice that timed out, every half second on
        every rank but rank 0 for the whole run.
        """
        next_beat, changed = 0.0, liveness.progress()
        try:
            while not store.check([_FIRST]):
                # a beat every BEAT_S, and one at once when the rank's role or optimizer step changes
                if time.monotonic() >= next_beat or changed != liveness.progress():
                    changed = liveness.progress()
                    record = self.heart.publish(store)
                    next_beat = time.monotonic() + liveness.BEAT_S
                    if record["waiting"] and record["for_s"] > self.timeout_s + GRACE_S:
                        self._record_hang(store, record)
                if self._stop.wait(WATCH_SLICE_S):
                    return
            self.first = json.loads(store.get(_FIRST)) or None
        except (RuntimeError, ValueError):  # the store did not answer
            # its host stopped or gone ends the job: a main thread that never reaches a collective (a stalled
            # callback) would not learn it; a host that still runs (a starved one) leaves the decision to collectives
            blame = self.heart.diagnose_store_host()
            if blame is None or blame.rank not in blame.gone:
                return
            self.first = blame.record()
            self._end_after_error(None)
            return
        if self.first is not None:
            self._end_after_error(store)
        self.leave()

    def _record_hang(self, store: Any, record: dict) -> None:
        """This rank's main thread has waited on a peer past the timeout (a group without one, or a backend that
        did not raise): record the first error for the job, naming the rank that holds it up."""
        blame = self.heart.diagnose(store, min_busy_s=self.timeout_s / 2)
        first = (
            blame.record()
            if blame is not None
            else {
                "rank": self.rank,
                "error": f"rank {self.rank} waited {record['for_s']:g} s on a peer, past the timeout of "
                f"{self.timeout_s:g} s, while no rank was seen busy: {record['doing']}",
            }
        )
        if store.add(_COUNT, 1) == 1:
            store.set(_FIRST, json.dumps(first))

    def _end_after_error(self, store: Any | None) -> None:
        """Abort the groups and give the main thread :data:`GRACE_S` to end; end the process if it is still inside
        the entry point that was running when the error came (or in :func:`shutdown`). A main thread that left it
        (the error was caught, and the process goes on with other work) is left alone."""
        what = _dist.abort_groups()
        running = _main_frame(Launcher.launch.__code__)
        if self._stop.wait(GRACE_S):
            return
        still = _main_frame(Launcher.launch.__code__)
        if (running is None or still is not running) and _main_frame(shutdown.__code__) is None:
            return
        first = self.first or {}
        doing = liveness.sample_main_thread().doing
        text = (
            f"{_first_words(first)} (rank {self.rank} stopped because its main thread was still {doing} "
            f"{GRACE_S:g} s after that error; process groups: {what})"
        )
        with contextlib.suppress(OSError):
            os.write(2, f"[rank{self.rank}]: {RankFailedError.__module__}.RankFailedError: {text}\n".encode())
        self.leave()
        if self.hosts_store and store is not None:  # the others read the first error from this process's store
            _wait_for_leavers(store, self.world_size - 1 - len(first.get("gone", [])))
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        self.exit(1)

    def blame(self, exc: BaseException) -> dict | None:
        """The first-error record naming the rank that held the job up when ``exc`` broke this rank's collective
        (:meth:`~lightning_hpp.liveness.Heartbeat.diagnose`); ``None`` when every rank waits on a peer."""
        blame = self.heart.diagnose(self.store, min_busy_s=self.timeout_s / 2) if self.heart is not None else None
        return blame.record() if blame is not None else None

    def stop(self) -> None:
        """End the watcher thread (at most one wait slice and a store call later)."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=WATCH_SLICE_S + STORE_OP_S)
            self._watcher = None

    def leave(self) -> None:
        """Tell the rank hosting the store that this rank needs it no more (once)."""
        with self._lock:
            if self._left or self.store is None:
                return
            self._left = True
        with contextlib.suppress(RuntimeError):
            self.store.add(_LEFT, 1)


def _main_frame(code: Any) -> Any:
    """The main thread's innermost frame running ``code`` now, or ``None``."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame


def _wait_for_leavers(store: Any, count: int) -> None:
    """Wait, at most :data:`STORE_GRACE_S`, until ``count`` other ranks said they need the store no more."""
    with contextlib.suppress(RuntimeError):
        deadline = time.monotonic() + STORE_GRACE_S
        while store.add(_LEFT, 0) < count and time.monotonic() < deadline:
            time.sleep(0.02)


def _first_words(first: dict) -> str:
    """The job's first error as every other rank states it."""
    if first.get("blame"):
        return str(first["error"])
    return f"rank {first['rank']} failed first: {first['error']}"


_JOB = _Job()


def init_process_group(
    cluster_environment: Any, backend: str, timeout: timedelta, device: torch.device, world_size: int
) -> None:
    """Create the default process group (collective) and close it again at interpreter exit."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    prefix = "/lightning_hpp"
    if agent_store:
        prefix = f"/lightning_hpp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if agent_store and not dist.is_initialized():
        # torchrun's c10d rendezvous keeps one store across restarts; without a prefix per attempt
        # the restarted ranks read the dead ranks' gloo addresses and fail to connect.
        store = dist.TCPStore(
            cluster_environment.main_address,
            cluster_environment.main_port,
            world_size,
            is_master=False,
            timeout=timeout,
        )
        kwargs["store"] = dist.PrefixStore(prefix, store)
    started = dist.is_initialized()
    _init_dist_connection(cluster_environment, backend, **kwargs)
    _dist.set_timeout(timeout)  # every group made from now on takes it
    if not started:
        rank = dist.get_rank()
        peers = _dist.all_gather_object(liveness.Peer.of_this_process(rank))
        _JOB.start(
            cluster_environment.main_address,
            cluster_environment.main_port,
            rank,
            dist.get_world_size(),
            hosts_store=rank == 0 and not agent_store,
            prefix=f"{prefix}/errors",
            timeout=timeout,
            peers=peers,
            store_host=None if agent_store else 0,
        )
    atexit.register(shutdown)


def first_error(exc: BaseException) -> BaseException:
    """The exception this rank should end with, given the first error of the job.

    The first rank to fail records ``exc`` in the job's store and gets it back unchanged, unless ``exc`` is
    a broken or timed-out collective: then it records the rank that held the job up
    (:meth:`_Job.blame`: a rank that hangs or died) and gets a :class:`RankFailedError` naming it. A later
    rank gets a :class:`RankFailedError` naming the first rank and repeating its exception when its own
    ``exc`` is a broken or timed-out collective, else ``exc`` with the first error as a note. Before the
    process group exists ``exc`` is returned unchanged; when the store does not answer, its host rank is
    named where it is stopped or gone, else ``exc`` is returned unchanged.
    """
    if _JOB.store is None:
        return exc
    first = _JOB.first
    if first is None:
        try:
            if _JOB.store.add(_COUNT, 1) == 1:
                blame = _JOB.blame(exc) if _is_comm_failure(exc) else None
                _JOB.first = blame or {"rank": _JOB.rank, "error": _describe(exc)}
                _JOB.store.set(_FIRST, json.dumps(_JOB.first))
                if blame is None:
                    return exc
            else:
                _JOB.store.wait([_FIRST], timedelta(seconds=FIRST_WAIT_S))
                _JOB.first = json.loads(_JOB.store.get(_FIRST)) or None
            first = _JOB.first
        except (RuntimeError, ValueError):  # the store does not answer: its host is stopped or gone
            blame = _JOB.heart.diagnose_store_host() if _JOB.heart is not None and _is_comm_failure(exc) else None
            if blame is None:
                return exc
            first = blame.record()
    if first is None or (first["rank"] == _JOB.rank and not first.get("blame")):
        return exc
    if _is_comm_failure(exc):
        return RankFailedError(
            f"{_first_words(first)} (rank {_JOB.rank} stopped because a "
            f"collective or pipeline transfer broke: {_describe(exc, 300)})"
        )
    if first["error"] != _describe(exc) and hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"lightning_hpp: {_first_words(first).replace(' failed first', ' had failed first')}")
    return exc


def _describe(exc: BaseException, limit: int = 2000) -> str:
    text = redact(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_comm_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc) for word in _COMM_FAILURES)


def shutdown() -> None:
    """Finish a background checkpoint upload, then close the process groups.

    Process groups left to static destructors can abort the interpreter at exit ("terminate called
    without an active exception") while gloo's threads are still joinable. Until the groups are closed the
    watcher thread still bounds this (an upload whose collectives hang after the job's first error).
    """
    wait_for_pending_save()
    if dist.is_available() and dist.is_initialized() and not _STUCK.is_set():
        dist.destroy_process_group()
    if _JOB.store is None:
        return
    _JOB.stop()
    if _STUCK.is_set():  # a call to the store never returned: its thread would abort the interpreter's finalization
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(1)
    if not _JOB.hosts_store:
        _JOB.leave()
        return
    # The other ranks may still need the store: wake their watchers ("{}": no error) and let them go first.
    with contextlib.suppress(RuntimeError):
        if _JOB.store.add(_COUNT, 1) == 1:
            _JOB.store.set(_FIRST, "{}")
        gone = len((_JOB.first or {}).get("gone", []))
        _wait_for_leavers(_JOB.store, _JOB.world_size - 1 - gone)
    _JOB.store = _JOB.server = None
