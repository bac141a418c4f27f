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
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
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

from lightning_hpp.checkpoint.s3 import redact
from lightning_hpp.checkpoint.sharded import wait_for_pending_save
from lightning_hpp.errors import PlanError, RankFailedError
from lightning_hpp.validation import is_number

STORE_GRACE_S = 30.0
"""The longest that the rank hosting the store stays up after an error for the others to read it."""
WATCH_SLICE_S = 0.2
"""How often a rank's first-error watcher looks for the job's first error in the store."""

_FIRST = "first_error"
_COUNT = "errors"
_LEFT = "left"
_COMM_FAILURES = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out", "gloo", "NCCL")


BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
"""The ``torch.distributed`` backends ``HPPStrategy(process_group_backend=...)`` accepts."""


def check_backend(value: Any) -> str | None:
    """``HPPStrategy(process_group_backend=...)``: a backend name or ``None`` (gloo on CPU, nccl on CUDA)."""
    if value is not None and value not in BACKENDS:
        raise PlanError(f"`HPPStrategy(process_group_backend={value!r})` is not a torch.distributed backend; use one of "
                        f"{', '.join(map(repr, BACKENDS))} or None (gloo on CPU, nccl on CUDA).")
    return value


def check_timeout(value: Any) -> timedelta:
    """``HPPStrategy(timeout=...)`` as a ``timedelta``: a positive one, or a positive number of seconds."""
    if isinstance(value, timedelta) and value.total_seconds() > 0:
        return value
    if is_number(value) and value > 0:
        return timedelta(seconds=float(value))
    raise PlanError(f"`HPPStrategy(timeout={value!r})`: use a positive number of seconds or a `datetime.timedelta`, "
                    f"e.g. `timeout=600`.")


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


class _Job:
    """This rank's line to the job's rendezvous store, once the default process group exists.

    Two client connections: the watcher thread blocks in ``wait`` on one, this thread uses the other.
    """

    def __init__(self) -> None:
        self.store: Any = None
        self.rank = 0
        self.world_size = 1
        self.hosts_store = False
        self.first: dict | None = None  # the job's first error, once known
        self.server: Any = None  # rank 0: the rendezvous store it hosts, kept alive past the process group
        self._left = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(
        self, address: str, port: int, rank: int, world_size: int, hosts_store: bool, prefix: str, timeout: timedelta
    ) -> None:
        def client() -> Any:
            return dist.PrefixStore(prefix, dist.TCPStore(address, port, is_master=False, timeout=timeout))

        self.store, self.rank, self.world_size, self.hosts_store = client(), rank, world_size, hosts_store
        self.server = dist.distributed_c10d._get_default_store() if hosts_store else None
        self.first, self._left = None, False
        self._stop.clear()
        if not hosts_store:
            self._watcher = threading.Thread(
                target=self._watch, args=(client(),), name="lightning_hpp-first-error", daemon=True
            )
            self._watcher.start()

    def _watch(self, store: Any) -> None:
        """Learn the first error while the rank hosting the store is still up (it waits for this).

        Looks every :data:`WATCH_SLICE_S` with ``check`` (an answer at once) and sleeps on the stop event in
        between, so that :meth:`stop` ends the thread before the interpreter exits (a daemon thread still
        inside a store call when Python finalizes is killed by a forced unwind through pybind11's frames,
        which aborts the process: "terminate called without an active exception"). A ``wait`` in slices
        instead had torch's store client log two lines per slice that timed out, every half second on
        every rank but rank 0 for the whole run.
        """
        try:
            while not store.check([_FIRST]):
                if self._stop.wait(WATCH_SLICE_S):
                    return
            self.first = json.loads(store.get(_FIRST)) or None
        except (RuntimeError, ValueError):  # the store's host is gone: nothing left to learn
            return
        self.leave()

    def stop(self) -> None:
        """End the watcher thread (at most one wait slice and a store call later)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=WATCH_SLICE_S + 5.0)
            self._watcher = None

    def leave(self) -> None:
        """Tell the rank hosting the store that this rank needs it no more (once)."""
        with self._lock:
            if self._left or self.store is None:
                return
            self._left = True
        with contextlib.suppress(RuntimeError):
            self.store.add(_LEFT, 1)


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
    if not started:
        rank = dist.get_rank()
        _JOB.start(
            cluster_environment.main_address,
            cluster_environment.main_port,
            rank,
            dist.get_world_size(),
            hosts_store=rank == 0 and not agent_store,
            prefix=f"{prefix}/errors",
            timeout=timeout,
        )
    atexit.register(shutdown)


def first_error(exc: BaseException) -> BaseException:
    """The exception this rank should end with, given the first error of the job.

    The first rank to fail records ``exc`` in the job's store and gets it back unchanged. A later
    rank gets a :class:`RankFailedError` naming the first rank and repeating its exception when its
    own ``exc`` is a broken or timed-out collective, else ``exc`` with the first error as a note.
    Before the process group exists, or when the store is gone, ``exc`` is returned unchanged.
    """
    if _JOB.store is None:
        return exc
    first = _JOB.first
    if first is None:
        try:
            if _JOB.store.add(_COUNT, 1) == 1:
                _JOB.first = {"rank": _JOB.rank, "error": _describe(exc)}
                _JOB.store.set(_FIRST, json.dumps(_JOB.first))
                return exc
            _JOB.store.wait([_FIRST], timedelta(seconds=10))
            first = _JOB.first = json.loads(_JOB.store.get(_FIRST)) or None
        except (RuntimeError, ValueError):  # the store's host is gone (killed): nothing to read
            return exc
    if first is None or first["rank"] == _JOB.rank:
        return exc
    if _is_comm_failure(exc):
        return RankFailedError(
            f"rank {first['rank']} failed first: {first['error']} (rank {_JOB.rank} stopped because a "
            f"collective or pipeline transfer broke: {_describe(exc, 300)})"
        )
    if first["error"] != _describe(exc) and hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"lightning_hpp: rank {first['rank']} had failed first: {first['error']}")
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
    without an active exception") while gloo's threads are still joinable.
    """
    wait_for_pending_save()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if _JOB.store is None:
        return
    if not _JOB.hosts_store:
        _JOB.leave()
        _JOB.stop()
        return
    # The other ranks may still need the store: wake their watchers ("{}": no error) and let them go first.
    with contextlib.suppress(RuntimeError):
        if _JOB.store.add(_COUNT, 1) == 1:
            _JOB.store.set(_FIRST, "{}")
        deadline = time.monotonic() + STORE_GRACE_S
        while _JOB.store.add(_LEFT, 0) < _JOB.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    _JOB.store = _JOB.server = None
