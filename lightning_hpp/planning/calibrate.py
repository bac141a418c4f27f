"""Measuring what a step costs besides the units, for :class:`~lightning_hpp.planning.profile.Overheads`.

Each measurement is cheap (well under a second on a CPU core) and runs on the rank's own device:

* :func:`schedule_overheads`: torch pipelining's own cost per micro-batch and per step, from a
  one-stage schedule of a trivial module on a one-rank group, run with 1 and with 8 micro-batches;
* :func:`optimizer_ms_per_mb`: an SGD-with-momentum update per MB of parameters (``foreach``);
* :func:`loss_costs`: the step's loss and its backward at two micro-batch sizes (fixed + per sample);
* :func:`p2p_costs` (collective): latency and bandwidth of a send/recv between ranks 0 and 1;
* :func:`allreduce_gbps` (collective): the bus bandwidth of an all-reduce over every rank.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_REPEATS = 5
_ROUNDS = 7


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_ms(fn: Callable[[], Any], device: torch.device, repeats: int = _REPEATS, min_s: float = 0.05) -> float:
    fn()  # warm-up
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while n < repeats or time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / n


def schedule_overheads(device: torch.device, group: Any) -> tuple[float, float]:
    """``(per micro-batch, per step)`` milliseconds of torch pipelining's GPipe on a one-rank ``group``."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out.sum()

    steps = {}
    for m in (1, 8):
        stage = PipelineStage(nn.Linear(1, 1).to(device), 0, 1, device, group=group)
        sched = ScheduleGPipe(stage, m, loss_fn=loss_fn)
        steps[m] = functools.partial(sched.step, torch.ones(m, 1, device=device), target=torch.zeros(m, device=device))
    # the two sizes alternate over rounds and each keeps its fastest round: a burst of load on a shared
    # machine lengthens some rounds of one size, never all of them, and would otherwise tip the line
    # (a slower 8 micro-batch round alone makes the per-step part 0)
    times = {1: float("inf"), 8: float("inf")}
    for _ in range(_ROUNDS):
        for m in (1, 8):
            times[m] = min(times[m], _mean_ms(steps[m], device, min_s=0.01))
    per_mb = max(0.0, (times[8] - times[1]) / 7)
    return per_mb, max(0.0, times[1] - per_mb)


def optimizer_ms_per_mb(device: torch.device, numel: int = 1 << 20) -> float:
    """Milliseconds per MB of fp32 parameters of an SGD-with-momentum update (foreach), on ``device``."""
    params = [torch.zeros(numel // 4, device=device, requires_grad=True) for _ in range(4)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    ms = _mean_ms(opt.step, device)
    return ms / (numel * 4 / 1e6)


def loss_costs(
    probe: Callable[[int], Callable[[], Any]], small: int, big: int, device: torch.device
) -> tuple[float, float]:
    """``(loss_ms at big, fixed part)`` of the step's loss and its backward.

    Args:
        probe: ``probe(b)`` returns a callable that runs the loss (and its backward) once on a
            micro-batch of ``b`` samples.
        small, big: The two micro-batch sizes.
    """
    t_big = _mean_ms(probe(big), device)
    if small == big:
        return t_big, 0.0
    t_small = _mean_ms(probe(small), device)
    per_sample = max(0.0, (t_big - t_small) / (big - small))
    return t_big, min(t_big, max(0.0, t_big - per_sample * big))


def p2p_costs(
    rank: int, world: int, device: torch.device, nbytes: int = 1 << 22, rounds: int = 5
) -> tuple[float, float]:
    """``(latency_ms, GB/s)`` of one message between ranks 0 and 1 (collective over the world).

    Ranks 0 and 1 ping-pong a 4-byte and an ``nbytes`` tensor; the result is broadcast from rank 0.
    With one rank, ``(0.0, 0.0)`` (nothing is measured; the cluster's link speed applies).
    """
    import torch.distributed as dist

    comm = torch.device("cpu") if world == 1 or dist.get_backend() == "gloo" else device
    out = torch.zeros(2, dtype=torch.float64, device=comm)
    if world > 1 and rank in (0, 1):
        peer = 1 - rank
        times = []
        for size in (1, nbytes // 4):
            buf = torch.zeros(size, device=comm)
            for _ in range(2):  # warm-up
                _ping(buf, rank, peer)
            t0 = time.perf_counter()
            for _ in range(rounds):
                _ping(buf, rank, peer)
            times.append((time.perf_counter() - t0) * 1e3 / (2 * rounds))  # one message
        lat, big = times
        out[0] = lat
        out[1] = (nbytes / 1e6) / max(big - lat, 1e-6)  # bytes per ms / 1e6 = GB/s
    if world > 1:
        dist.broadcast(out, 0)
    return float(out[0]), float(out[1])


def _ping(buf: torch.Tensor, rank: int, peer: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)


def allreduce_gbps(world: int, device: torch.device, latency_ms: float, nbytes: int = 1 << 22, rounds: int = 3) -> float:
    """Bus bandwidth in GB/s of an all-reduce of ``nbytes`` over every rank (collective; 0.0 with one rank).

    Bus bandwidth as data parallelism's cost model uses it: ``2 (w - 1) / w * nbytes`` over the time,
    less the ring's ``2 (w - 1)`` message latencies. Every rank returns rank 0's figure.
    """
    import torch.distributed as dist

    if world == 1:
        return 0.0
    comm = torch.device("cpu") if dist.get_backend() == "gloo" else device
    buf = torch.zeros(nbytes // 4, device=comm)
    dist.all_reduce(buf)  # warm-up
    _sync(comm)
    t0 = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(buf)
    _sync(comm)
    ms = (time.perf_counter() - t0) * 1e3 / rounds - 2 * (world - 1) * latency_ms
    out = torch.tensor([2.0 * (world - 1) / world * nbytes / 1e6 / max(ms, 1e-6)], dtype=torch.float64, device=comm)
    dist.broadcast(out, 0)
    return float(out[0])
