"""Measuring what a step costs besides the units, for :class:`~lightning_hpp.planning.profile.Overheads`.

Each measurement is cheap (well under a second on a CPU core) and runs on the rank's own device:

* :func:`schedule_overheads`: torch pipelining's own cost per micro-batch and per step, from a
  one-stage schedule of a trivial module on a one-rank group, run with 1 and with 8 micro-batches;
* :func:`optimizer_ms_per_mb`: an SGD-with-momentum update per MB of parameters (``foreach``);
* :func:`loss_costs`: the step's loss and its backward at two micro-batch sizes (fixed + per sample);
* :func:`p2p_links` (collective): latency and bandwidth of a send/recv on the link between every pair of
  ranks (any pair may become a stage boundary), and :func:`p2p_costs`, the slowest of them: a plan whose
  boundary crosses nodes is not costed at intra-node speed;
* :func:`allreduce_gbps` (collective): the bus bandwidth of an all-reduce over every rank.

Times are taken on the device's clock (:func:`~lightning_hpp._timing.device_clock`): CUDA events on CUDA,
where kernels and NCCL transfers run asynchronously and a host clock would time their launch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_hpp._timing import device_clock, time_ms

_REPEATS = 5
_ROUNDS = 7


def _mean_ms(fn: Callable[[], Any], device: torch.device, repeats: int = _REPEATS, min_s: float = 0.05) -> float:
    fn()  # warm-up
    clock = device_clock(device)
    n, start, t0 = 0, clock.mark(), time.perf_counter()
    while n < repeats or time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    return clock.elapsed_ns([(start, clock.mark())]) / 1e6 / n


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
    """``(latency_ms, GB/s)`` of the slowest link between two ranks of the job (collective over the world).

    Every pair is measured (:func:`p2p_links`): the plan's boundaries are not known yet, and one that crosses
    nodes must not be costed at the speed of two ranks of one node. With one rank, ``(0.0, 0.0)`` (nothing is
    measured; the cluster's link speed applies).
    """
    links = p2p_links(rank, world, device, nbytes, rounds)
    if not links:
        return 0.0, 0.0
    return max(lat for lat, _ in links.values()), min(gbps for _, gbps in links.values())


def p2p_links(
    rank: int, world: int, device: torch.device, nbytes: int = 1 << 22, rounds: int = 5
) -> dict[tuple[int, int], tuple[float, float]]:
    """``{(a, b): (latency_ms, GB/s)}`` of a message between every pair of ranks ``a < b`` (collective over the world).

    The pairs are measured in ``world - 1`` rounds of disjoint pairs (a round-robin tournament): in each round
    every rank ping-pongs a 4-byte and an ``nbytes`` tensor with its partner, timed on the device's clock. The
    lower rank of a pair measures; the table is gathered onto every rank.
    """
    import torch.distributed as dist

    if world == 1:
        return {}
    comm = torch.device("cpu") if dist.get_backend() == "gloo" else device
    mine: dict[tuple[int, int], tuple[float, float]] = {}
    for peer in _partners(rank, world):
        if peer is None:
            continue
        times = []
        for size in (1, nbytes // 4):
            buf = torch.zeros(size, device=comm)
            for _ in range(2):  # warm-up
                _ping(buf, rank, peer)
            times.append(time_ms(lambda: _ping(buf, rank, peer), comm, rounds) / 2)  # one message
        if rank < peer:
            lat, big = times
            mine[(rank, peer)] = (lat, (nbytes / 1e6) / max(big - lat, 1e-6))  # bytes per ms / 1e6 = GB/s
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return {pair: link for part in gathered for pair, link in part.items()}


def _partners(rank: int, world: int) -> list[int | None]:
    """This rank's partner in each round of a round-robin tournament over ``world`` ranks (``None``: a bye)."""
    n = world + world % 2
    seats = list(range(n))
    out: list[int | None] = []
    for _ in range(n - 1):
        i = seats.index(rank)
        peer = seats[n - 1 - i]
        out.append(peer if peer < world else None)
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return out


def _ping(buf: torch.Tensor, rank: int, peer: int) -> None:
    import torch.distributed as dist

    if rank < peer:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)


def allreduce_gbps(
    world: int, device: torch.device, latency_ms: float, nbytes: int = 1 << 22, rounds: int = 3
) -> float:
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
    ms = time_ms(lambda: dist.all_reduce(buf), comm, rounds) - 2 * (world - 1) * latency_ms
    out = torch.tensor([2.0 * (world - 1) / world * nbytes / 1e6 / max(ms, 1e-6)], dtype=torch.float64, device=comm)
    dist.broadcast(out, 0)
    return float(out[0])
