"""The one observer of torch's pipeline transfers: listeners added and removed in any order each see every
transfer once, and torch's functions come back when the last one goes (two stacked patches once recursed)."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed.pipelining.schedules as schedules

from lightning_hpp.pipeline import transfers
from lightning_hpp.telemetry import recorder, watch


class _Work:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.waited = fail, 0

    def wait(self) -> None:
        self.waited += 1
        if self.fail:
            raise RuntimeError("peer gone")


class _Seen(transfers.TransferListener):
    def __init__(self) -> None:
        self.posted_ops, self.waits = [], []

    def posted(self, ops, works, t0_ns, t1_ns):
        assert t0_ns <= t1_ns
        self.posted_ops.extend(ops)

    def waiting(self, work):
        return id(work)

    def waited(self, work, token, error):
        assert token == id(work)
        self.waits.append((work, None if error is None else str(error)))


@pytest.fixture
def fake_torch(monkeypatch):
    """torch's two functions replaced by ones that post nothing and wait on the given works."""
    def batch(ops, desc=None):
        return [_Work(fail=op == "bad") for op in ops]

    def wait(works):
        for w in works:
            w.wait()

    monkeypatch.setattr(schedules, "_batch_p2p", batch)
    monkeypatch.setattr(schedules, "_wait_batch_p2p", wait)
    yield batch, wait
    assert transfers.listeners() == ()


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_listeners_added_and_removed_in_any_order_each_see_every_transfer_once(fake_torch, order):
    batch, wait = fake_torch
    seen = [_Seen() for _ in range(3)]
    for i in order:
        transfers.add_listener(seen[i])
    transfers.add_listener(seen[order[0]])  # twice: still once
    transfers.remove_listener(seen[order[1]])
    transfers.add_listener(seen[order[1]])  # removed and added again between the others (stacked patches recursed here)
    works = schedules._batch_p2p(["a", "b"])
    schedules._wait_batch_p2p(works)
    for s in seen:
        assert s.posted_ops == ["a", "b"]
        assert [w for w, _ in s.waits] == works and all(e is None for _, e in s.waits)
    assert [w.waited for w in works] == [1, 1]
    for i in reversed(order):
        transfers.remove_listener(seen[i])
    assert schedules._batch_p2p is batch and schedules._wait_batch_p2p is wait


def test_a_failed_wait_reaches_every_listener_and_is_raised(fake_torch):
    seen = [_Seen(), _Seen()]
    for s in seen:
        transfers.add_listener(s)
    works = schedules._batch_p2p(["bad"])
    with pytest.raises(RuntimeError, match="peer gone"):
        schedules._wait_batch_p2p(works)
    assert all(s.waits == [(works[0], "peer gone")] for s in seen)
    for s in seen:
        transfers.remove_listener(s)


def test_telemetry_and_the_watch_listen_through_the_one_observer(fake_torch):
    batch, _ = fake_torch
    recorder._install_p2p_hooks()
    watch._install_p2p_hooks()
    recorder._install_p2p_hooks()  # the order they were installed in no longer matters
    assert set(map(type, transfers.listeners())) == {type(recorder._LISTENER), type(watch._LISTENER)}
    assert schedules._batch_p2p is transfers._batch_p2p
    recorder._remove_p2p_hooks()
    watch._remove_p2p_hooks()
    assert schedules._batch_p2p is batch
