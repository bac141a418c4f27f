"""Several bad setups tried in turn by the same rank processes (one launch instead of one per case).

Every rank runs each case's ``fit`` itself and records what it ended with in
``<folder>/refusal_rank{r}.json``: ``error`` (``"module.Type: message"``, or ``None``), ``seconds``
(from the start of the case to its end) and ``global_step``. Then it waits, without any collective,
until every rank has written its record for the case (:func:`_wait_for_peers`): a rank left waiting
in a collective by a case never writes it, so its peers stop there (instead of pairing that
collective with the next case's) and the job exits with status 3, leaving
``<folder>/stuck_rank{r}.txt``.

A rank one of whose cases raised exits with status 1 (:func:`exit_status`), as the job of that case
alone would have ended.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEER_TIMEOUT_S = 90.0
"""How long a rank waits for its peers' records of a case before it stops the job.

A case's ``seconds`` tell a rank that failed at once from one that waited in a collective until the
process group's timeout (and then failed with an error naming the first rank's): give the jobs a
timeout well above the bound the test puts on ``seconds`` (:data:`COLLECTIVE_TIMEOUT_S`, :data:`BOUND_S`).
The first case of a job includes the launch of the other ranks (rank 0 waits for their imports)."""

COLLECTIVE_TIMEOUT_S = 300
"""The ``HPPStrategy(timeout=...)`` of the jobs of bad setups."""

BOUND_S = 150.0
"""A case that took longer than this has waited for something (far below :data:`COLLECTIVE_TIMEOUT_S`)."""


def describe(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"


def try_case(folder: str | Path, world_size: int, run: Callable[[], Any], trainer: Any = None) -> dict:
    """Call ``run()`` (a ``trainer.fit(...)``) and record how it ended on this rank."""
    start = time.monotonic()
    error = None
    try:
        run()
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        error = exc
    # LOCAL_RANK: Lightning sets it in every rank's environment (rank 0's too) when it launches them
    rank = int(trainer.global_rank) if trainer is not None else int(os.environ.get("LOCAL_RANK", "0"))
    record = {
        "rank": rank,
        "error": None if error is None else describe(error),
        "seconds": time.monotonic() - start,
        "global_step": None if trainer is None else int(trainer.global_step),
    }
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".refusal_rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(folder, f"refusal_rank{rank}.json"))
    _wait_for_peers(str(folder), rank, world_size)
    return record


def read(folder: str | Path, world_size: int) -> list[dict]:
    """Every rank's record of one case (fails if a rank was left waiting, or wrote none)."""
    stuck = sorted(Path(folder).glob("stuck_rank*.txt"))
    assert not stuck, [p.read_text() for p in stuck]
    return [json.loads((Path(folder) / f"refusal_rank{r}.json").read_text()) for r in range(world_size)]


def exit_status(records: list[dict]) -> int:
    """1 when one of this rank's cases raised, as the job of that case alone would have ended; else 0."""
    return 1 if any(r["error"] is not None for r in records) else 0


def _wait_for_peers(folder: str, rank: int, world_size: int) -> None:
    deadline = time.monotonic() + PEER_TIMEOUT_S
    while True:
        missing = [r for r in range(world_size) if not os.path.exists(os.path.join(folder, f"refusal_rank{r}.json"))]
        if not missing:
            return
        if time.monotonic() > deadline:
            with open(os.path.join(folder, f"stuck_rank{rank}.txt"), "w") as f:
                f.write(f"rank {rank}: ranks {missing} did not finish this case within {PEER_TIMEOUT_S}s")
            os._exit(3)
        time.sleep(0.05)
