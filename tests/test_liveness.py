"""Naming the rank that holds a job up, without processes of a job: stack samples, diagnoses, the watcher's end.

The multi-process faults (a rank that stalls, is stopped, is killed; storage that does not answer) are in
tests/test_faults.py; here each part is checked alone, on an in-process store and real helper processes.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from lightning_hpp import _dist, launch, liveness
from lightning_hpp.liveness import Heartbeat, Peer


def _in_thread(fn):
    """``fn()`` on a helper thread while the main thread sleeps in this function; returns its result."""
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("out", fn()))
    worker.start()
    while worker.is_alive():
        time.sleep(0.05)  # the main thread's stack while the sample is taken
    return box["out"]


def test_the_main_thread_is_sampled_busy_in_user_code_and_waiting_inside_torch_distributed():
    def sample_later():
        time.sleep(0.2)
        return liveness.sample_main_thread()

    busy = _in_thread(sample_later)
    assert not busy.waiting
    assert busy.doing.startswith("in _in_thread (tests/test_liveness.py:") and "time.sleep(0.05)" in busy.doing, busy
    assert "called from test_the_main_thread_is_sampled_busy" in busy.doing, busy

    # a frame of torch.distributed (a collective's Python frame, a pipeline transfer's wait) is a wait on a peer
    namespace = {"__name__": "torch.distributed.fake_collective", "time": time}
    exec("def wait_for_peer(fn):\n    box = {}\n    t = fn()\n    return t\n", namespace)
    waiting = namespace["wait_for_peer"](lambda: _in_thread(sample_later))
    assert waiting.waiting and waiting.doing.startswith("waiting on a peer in "), waiting


def test_an_activity_label_names_what_the_main_thread_does():
    with liveness.activity("listing 's3://bucket/run'"):
        sample = _in_thread(lambda: (time.sleep(0.1), liveness.sample_main_thread())[1])
    assert sample.doing.startswith("in listing 's3://bucket/run': _in_thread"), sample


def _record(rank: int, beat: int, waiting: bool, doing: str, for_s: float = 12.0, step: int = 3) -> str:
    return json.dumps({"rank": rank, "beat": beat, "role": "before its pipeline was built", "step": step,
                       "doing": doing, "waiting": waiting, "for_s": for_s})


class _Beating:
    """Publishes fabricated heartbeat records into ``store`` every 0.1 s (rank -> (waiting, doing))."""

    def __init__(self, store, records: dict[int, tuple[bool, str]]) -> None:
        self.store, self.records, self.stop = store, records, threading.Event()
        self.beat = 0
        self.publish()
        threading.Thread(target=self._run, daemon=True).start()

    def publish(self) -> None:
        self.beat += 1
        for r, (waiting, doing, *for_s) in self.records.items():
            self.store.set(f"beat/{r}", _record(r, self.beat, waiting, doing, *for_s))

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            self.publish()


def _peers(n: int) -> list[Peer]:
    return [Peer.of_this_process(r) for r in range(n)]


def test_a_busy_rank_is_named_with_what_it_does_while_the_others_wait():
    store = dist.HashStore()
    beating = _Beating(store, {0: (True, "waiting on a peer in all_reduce"), 1: (False, "in on_train_batch_end: sleep"),
                               2: (True, "waiting on a peer in recv")})
    blame = Heartbeat(0, 3, _peers(3), store_host=0).diagnose(store, wait_s=0.3)
    beating.stop.set()
    assert blame.rank == 1 and blame.gone == ()
    assert blame.text.startswith(f"rank 1 (host {socket.gethostname()}, pid "), blame.text
    assert blame.text.endswith("stopped answering at step 3: for 12 s it has been in on_train_batch_end: sleep; the "
                               "other 2 rank(s) waited for it in collectives or pipeline transfers"), blame.text


def test_a_rank_busy_for_less_than_half_the_timeout_is_reacting_to_the_break_and_is_not_named():
    store = dist.HashStore()
    beating = _Beating(store, {0: (True, "waiting"), 1: (False, "in the error path", 1.0), 2: (False, "in strike", 9.0),
                               3: (False, "in teardown", 2.0)})
    blame = Heartbeat(0, 4, _peers(4), store_host=0).diagnose(store, wait_s=0.3, min_busy_s=5.0)
    assert blame.rank == 2, blame
    assert blame.text.endswith("for 9 s it has been in strike; the other 3 rank(s) waited for it in collectives or "
                               "pipeline transfers"), blame.text
    beating.records = {0: (True, "waiting"), 1: (False, "in the error path", 1.0)}
    assert Heartbeat(0, 2, _peers(2), store_host=0).diagnose(store, wait_s=0.3, min_busy_s=5.0) is None
    beating.stop.set()


def test_no_rank_is_named_when_every_rank_waits_on_a_peer():
    store = dist.HashStore()
    beating = _Beating(store, {0: (True, "waiting"), 1: (True, "waiting")})
    assert Heartbeat(0, 2, _peers(2), store_host=0).diagnose(store, wait_s=0.3) is None
    beating.stop.set()


def test_a_stopped_rank_on_this_host_is_named_and_ended_and_a_gone_one_is_named():
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        peers = _peers(3)
        peers[1] = Peer(1, socket.gethostname(), stopped.pid, liveness._proc_stat(stopped.pid)[1])
        peers[2] = Peer(2, socket.gethostname(), gone.pid, "")
        store = dist.HashStore()
        beating = _Beating(store, {0: (True, "waiting"), 1: (True, "waiting in recv"), 2: (False, "in forward")})
        blame = Heartbeat(0, 3, peers, store_host=0).diagnose(store, wait_s=0.3)
        beating.stop.set()
        assert blame.rank == 1, blame
        assert "is stopped (SIGSTOP: its process does not run); rank 0 ended it with SIGKILL" in blame.text, blame.text
        assert "not answering either: rank 2" in blame.text and blame.gone == (1, 2), blame
        assert stopped.wait(timeout=10) == -signal.SIGKILL
    finally:
        if stopped.poll() is None:
            stopped.kill()


def test_a_rank_on_another_host_whose_heartbeat_stopped_is_named():
    store = dist.HashStore()
    beating = _Beating(store, {0: (True, "waiting")})
    store.set("beat/1", _record(1, 7, False, "in forward"))  # published once, then never again
    peers = [Peer.of_this_process(0), Peer(1, "another-host", 4242, "1")]
    blame = Heartbeat(0, 2, peers, store_host=0).diagnose(store, wait_s=0.3)
    beating.stop.set()
    assert blame.rank == 1, blame
    assert "rank 1 (host another-host, pid 4242, before its pipeline was built) stopped answering (its heartbeat " \
           "stopped" in blame.text, blame.text


def test_the_store_host_is_named_when_the_store_does_not_answer():
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        start = liveness._proc_stat(stopped.pid)[1]
        peers = [Peer(0, socket.gethostname(), stopped.pid, start), Peer.of_this_process(1)]
        blame = Heartbeat(1, 2, peers, store_host=0).diagnose_store_host()
        assert blame.rank == 0 and blame.gone == (0,)
        assert "is stopped (SIGSTOP: its process does not run), and the job's store it hosts with it; rank 1 ended " \
               "it with SIGKILL" in blame.text, blame.text
        assert Heartbeat(1, 2, peers, store_host=None).diagnose_store_host() is None  # torchrun's agent hosts it
    finally:
        stopped.kill()


def test_a_store_call_that_never_returns_is_given_up_on(monkeypatch):
    monkeypatch.setattr(launch, "_STUCK", threading.Event())
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the job's store did not answer within 0.2 s"):
        launch._bounded(release.wait, seconds=0.2)
    assert time.monotonic() - start < 2
    with pytest.raises(RuntimeError, match="did not answer before"):  # then every later call fails at once
        launch._bounded(lambda: 1)
    release.set()


def _job_after_error(monkeypatch, frames: list) -> tuple[launch._Job, list, list]:
    """A job whose watcher learnt the first error; ``frames``: the main thread's ``Launcher.launch`` frame when the
    error came and 0.2 s later (the same object: still inside the entry point that failed)."""
    monkeypatch.setattr(launch, "GRACE_S", 0.2)
    aborted, exits = [], []
    monkeypatch.setattr(_dist, "abort_groups", lambda: aborted.append(True) or "nccl: every communicator aborted")
    seen = iter(frames)
    entry = launch.Launcher.launch.__code__
    monkeypatch.setattr(launch, "_main_frame", lambda code: next(seen) if code is entry else None)
    job = launch._Job()
    job.rank, job.world_size, job.exit = 3, 4, exits.append
    job.first = {"rank": 1, "error": "rank 1 (host h, pid 9) stopped answering at step 3: ...", "blame": True}
    job._end_after_error(dist.HashStore())
    return job, aborted, exits


def test_a_main_thread_that_left_the_failed_entry_point_is_left_alone(monkeypatch):
    # a caught error: the process goes on (a next fit), and the watcher does not end it
    _, aborted, exits = _job_after_error(monkeypatch, [object(), object()])
    assert aborted == [True] and exits == []
    _, _, exits = _job_after_error(monkeypatch, [None, object()])
    assert exits == []


def test_the_watcher_aborts_the_groups_and_ends_a_stuck_rank_after_the_first_error(monkeypatch, capfd):
    inside = object()
    _, aborted, exits = _job_after_error(monkeypatch, [inside, inside])
    assert aborted == [True] and exits == [1]
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[rank3]: lightning_hpp.errors.RankFailedError: rank 1 (host h, pid 9) stopped answering at "
                           "step 3: ... (rank 3 stopped because its main thread was still in "), line
    assert line.endswith(" 0.2 s after that error; process groups: nccl: every communicator aborted)"), line


def test_the_first_error_aborts_nccl_groups_and_leaves_gloo_ones_to_their_timeout(monkeypatch):
    calls = []
    monkeypatch.setattr(_dist, "initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: calls.append(group))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert _dist.abort_groups() == "nccl: every communicator aborted" and calls == [None]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert _dist.abort_groups().startswith("gloo: not aborted") and calls == [None]
