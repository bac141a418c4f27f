"""Reading what the ranks of a job saved: ``<out>/rank{r}.pt`` per rank, and the union of their stages."""

from __future__ import annotations

from pathlib import Path

import torch


def load_rank(out_dir: str | Path, rank: int) -> dict:
    """What rank ``rank`` saved into ``out_dir`` (``rank{rank}.pt``)."""
    return torch.load(Path(out_dir) / f"rank{rank}.pt")


def merged_state(out_dir: str | Path, ranks: list[int]) -> dict[str, torch.Tensor]:
    """The union of what the given ranks saved (their stages' parameters).

    A name several ranks hold (data-parallel replicas of a stage, a tied weight on two stages) must hold
    the same values on each of them (1e-6): every copy is compared, not only the last rank's."""
    state: dict[str, torch.Tensor] = {}
    holder: dict[str, int] = {}
    for r in ranks:
        for name, value in load_rank(out_dir, r)["state"].items():
            if name in state:
                torch.testing.assert_close(
                    value, state[name], rtol=1e-6, atol=1e-6,
                    msg=lambda m, n=name, a=holder[name], b=r: f"{n} differs between rank {a} and rank {b}: {m}")
            else:
                state[name], holder[name] = value, r
    return state


def rank_results(out_dir: str | Path, ranks: int) -> list[dict]:
    """The JSON results ``rank{r}.json`` of ranks ``0 .. ranks - 1`` in ``out_dir``, in rank order."""
    import json

    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(ranks)]
