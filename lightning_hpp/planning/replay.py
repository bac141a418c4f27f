"""A schedule's action order as a program the planner replays for many cuts at once.

:class:`Program` holds one schedule's per-rank compute order (torch's own, from
:func:`lightning_hpp.pipeline.orders.schedule_actions`) in topological order, with each action's
predecessor on its rank and the actions it waits for. :meth:`Program.makespan` replays it for a
batch of candidates at once: ``finish(a) = max(finish(previous on its rank), finish(what it waits
for)) + cost(a)``, over the walk of :func:`lightning_hpp.pipeline.orders.walk_orders`, the same walk
:func:`lightning_hpp.telemetry.model.simulate` replays action by action (with the messages' cost folded
into the sending action; another rank waits for what the first action of an overlapped pair makes until
the pair's last action, as torch sends it then: ``Act.held``). :meth:`Program.peak_memory` is the peak,
over a rank's order, of the activations its stages hold for micro-batches whose backward has not
finished: a stage's forward stashes them and its ``B`` (or ``W`` where the backward is split in two)
frees them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

from lightning_hpp.pipeline.orders import schedule_actions, walk_orders
from lightning_hpp.pipeline.schedules import SCHEDULES

KINDS = ("F", "B", "I", "W")
"""Action kinds, in the order of the cost tables :meth:`Program.makespan` takes."""


@dataclass(frozen=True)
class Program:
    """One schedule with ``pp`` ranks, ``n_stages`` stages and ``m`` micro-batches, ready to replay.

    Attributes:
        schedule: The schedule's name.
        pp, n_stages, m: Ranks, stages, micro-batches.
        rank_of: ``rank_of[s]``: the pipeline rank (position) holding stage ``s``.
        kind, stage, rank: Per action (topological order): its kind (index in :data:`KINDS`), stage, rank.
        prev: The action before it on its rank (``-1`` for the first).
        waits: The actions it waits for, ``-1`` where fewer than two.
        holds: ``holds[r]``: ``(T, n_stages)`` micro-batches whose activations each stage keeps, after
            every forward of rank ``r``.
        split_backward: Whether the backward runs as ``I`` then ``W``.
    """

    schedule: str
    pp: int
    n_stages: int
    m: int
    rank_of: tuple[int, ...]
    kind: np.ndarray
    stage: np.ndarray
    rank: np.ndarray
    prev: np.ndarray
    waits: np.ndarray
    holds: tuple[np.ndarray, ...]
    split_backward: bool

    @property
    def stages_per_rank(self) -> int:
        return self.n_stages // self.pp

    def stages_of(self, r: int) -> list[int]:
        return [s for s, q in enumerate(self.rank_of) if q == r]

    def cross_out(self) -> np.ndarray:
        """Per stage: whether its output goes to another rank (the last stage's goes nowhere)."""
        return np.array(
            [s + 1 < self.n_stages and self.rank_of[s + 1] != self.rank_of[s] for s in range(self.n_stages)]
        )

    def cross_in(self) -> np.ndarray:
        """Per stage: whether its input comes from another rank (so its input gradient goes back)."""
        return np.array([s > 0 and self.rank_of[s - 1] != self.rank_of[s] for s in range(self.n_stages)])

    def finish_times(self, costs: np.ndarray) -> np.ndarray:
        """``(C, actions)`` finish times for ``costs`` of shape ``(C, 4, n_stages)`` (``[:, KINDS.index(k), s]``)."""
        c = costs[:, self.kind, self.stage]  # (C, A)
        done = np.zeros_like(c)
        zero = np.zeros(c.shape[0])
        for a in range(c.shape[1]):
            p = self.prev[a]
            t = done[:, p] if p >= 0 else zero
            for w in self.waits[a]:
                if w >= 0:
                    t = np.maximum(t, done[:, w])
            done[:, a] = t + c[:, a]
        return done

    def makespan(self, costs: np.ndarray) -> np.ndarray:
        """The step's pipeline time for each candidate: the last action's finish."""
        return self.finish_times(costs).max(axis=1)

    def bubble(self, costs: np.ndarray) -> np.ndarray:
        """Mean over ranks of the idle share of the makespan (as ``Simulation.bubble``)."""
        c = costs[:, self.kind, self.stage]
        span = self.makespan(costs)
        busy = np.stack([c[:, self.rank == r].sum(axis=1) for r in range(self.pp)], axis=1)
        return np.where(span > 0, 1 - busy.mean(axis=1) / np.where(span > 0, span, 1), 0.0)

    def peak_memory(self, stash: np.ndarray) -> np.ndarray:
        """``(C, pp)``: each rank's peak of held activations, for ``stash`` bytes per micro-batch, ``(C, n_stages)``."""
        return np.stack([(stash @ h.T).max(axis=1) if len(h) else np.zeros(stash.shape[0]) for h in self.holds], axis=1)

    def in_flight(self) -> list[int]:
        """Per stage: the most micro-batches whose activations it holds at once."""
        out = [0] * self.n_stages
        for h in self.holds:
            if len(h):
                for s, v in enumerate(h.max(axis=0)):
                    out[s] = max(out[s], int(v))
        return out


def rank_of_stages(schedule: str, pp: int, n_stages: int) -> tuple[int, ...]:
    """The position holding each stage: stage ``s`` on ``s mod pp`` (loop), or the V's two legs."""
    mapping = generate_stage_to_rank_mapping(pp, n_stages, style=SCHEDULES[schedule].style)
    return tuple(mapping[s] for s in range(n_stages))


@functools.lru_cache(maxsize=512)
def program(schedule: str, pp: int, n_stages: int, m: int) -> Program:
    """The :class:`Program` of a schedule (cached; raises what ``schedule_actions`` raises)."""
    rank_of = rank_of_stages(schedule, pp, n_stages) if SCHEDULES[schedule].multi else tuple(range(n_stages))
    by_rank = schedule_actions(schedule, pp, m, n_stages)
    orders = {rank_of[acts[0].stage] if acts else r: acts for r, acts in by_rank.items()}
    split = any(a.kind == "W" for acts in orders.values() for a in acts)

    def deadlock(stuck: dict[int, str]) -> RuntimeError:
        return RuntimeError(f"The order of {schedule!r} (pp={pp}, {n_stages} stages, m={m}) deadlocks at {stuck}.")

    steps = walk_orders(orders, n_stages, deadlock)
    kind = [KINDS.index(s.act.kind) for s in steps]
    stage = [s.act.stage for s in steps]
    rank = [s.rank for s in steps]
    prev = [s.prev for s in steps]
    waits = [list(s.waits) + [-1] * (2 - len(s.waits)) for s in steps]
    holds = []
    for r in sorted(orders):
        count = np.zeros(n_stages)
        rows = []
        for a in orders[r]:
            if a.kind == "F":
                count[a.stage] += 1
                rows.append(count.copy())
            elif a.kind in ("B", "W"):  # a whole backward, or the weight half after its I
                count[a.stage] -= 1
        holds.append(np.array(rows).reshape(-1, n_stages))
    return Program(
        schedule,
        pp,
        n_stages,
        m,
        rank_of,
        np.array(kind),
        np.array(stage),
        np.array(rank),
        np.array(prev),
        np.array(waits).reshape(-1, 2),
        tuple(holds),
        split,
    )
