"""Device-synchronised timing: CUDA events where the device is CUDA, chosen by device type (no GPU needed to see
the choice; scripts/gpu_check.sh times real kernels), and the calibration's every-pair link measurement."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from lightning_hpp._timing import CudaEventClock, HostClock, device_clock, time_ms
from lightning_hpp.planning.calibrate import _partners
from lightning_hpp.telemetry.watch import _remove_p2p_hooks, _StepTimer


def test_the_clock_is_chosen_by_the_device_type():
    assert isinstance(device_clock(torch.device("cuda", 0)), CudaEventClock)
    assert isinstance(device_clock("cuda"), CudaEventClock)
    assert isinstance(device_clock("cpu"), HostClock)
    assert time_ms(lambda: time.sleep(0.01), "cpu", 3) >= 10


def _schedule(device: str) -> SimpleNamespace:
    stage = SimpleNamespace(device=torch.device(device), forward_one_chunk=lambda *a, **k: time.sleep(0.01),
                            backward_one_chunk=lambda *a, **k: None, backward_weight_one_chunk=lambda *a, **k: None)
    return SimpleNamespace(_has_backward=True, _stage=stage, step=lambda: stage.forward_one_chunk(0))


@pytest.mark.parametrize("device, clock", [("cuda", CudaEventClock), ("cpu", HostClock)])
def test_the_straggler_watch_times_a_stage_on_its_device_clock(device, clock):
    timer = _StepTimer(0, str, None)
    schedule = _schedule(device)
    timer.instrument(schedule)
    _remove_p2p_hooks()  # instrument() hooked torch's transfers for the watch; no watch runs here
    assert isinstance(timer.clock, clock)
    if device == "cpu":
        schedule.step()
        compute_ns, wait_ns, peer = timer.fresh_times
        assert compute_ns >= 10_000_000 and (wait_ns, peer) == (0, None)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_the_calibration_pairs_every_two_ranks_once_in_disjoint_rounds(world):
    rounds = list(zip(*[_partners(r, world) for r in range(world)]))
    pairs = set()
    for partner in rounds:
        for r, peer in enumerate(partner):
            if peer is not None:
                assert partner[peer] == r  # both sides of a link meet in the same round
                pairs.add((min(r, peer), max(r, peer)))
    assert pairs == {(a, b) for a in range(world) for b in range(a + 1, world)}
    assert len(rounds) == world - 1 + world % 2
