"""Sequence lengths that change from batch to batch (``main.py --lengths``): the LM under HPPStrategy on batches of
one length and on batches whose length is drawn anew each step, and what a new length costs.

Rows (1F1B, ``--m`` micro-batches, the LM's global batch, the sequential and the traced frontend):

* ``fixed max``: every batch ``seq`` tokens long (padding every batch to the longest: what a pipeline that fixes
  shapes at the first step needs);
* ``fixed mean``: every batch the mean length of the variable run, ``5 seq / 8`` (the same tokens per step, on
  average, as the variable run);
* ``variable``: each batch's length uniform in ``[seq / 4, seq]``, the same on every rank of a pipeline (drawn from
  the batch's first sample index), as a collate that pads each batch to its own longest gives.

Per row: the median step time, tokens per second (each step's own tokens), how many steps met a length new to the
pipeline (handed over in band, :mod:`lightning_hpp.pipeline.shapes`), the median step time of those steps and of
the others, the host time the hand-over took on the slowest rank and the receive storage it allocated
(``PipelineTelemetry``'s ``shape_ms``, ``shape_alloc_mb``), and the traced frontend's captures: ``torch.export``
calls at setup (one per mode) and their time. ``capture_costs`` measures what re-capturing per new length would
cost instead: one static ``torch.export`` of the LM per length, against the one capture with free lengths.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

LENGTH_MODES = ("fixed max", "fixed mean", "variable")


def length_configs(m: int, schedule: str = "1f1b") -> list[dict[str, Any]]:
    return [{"kind": "lengths", "schedule": schedule, "m": m, "lengths": mode, "frontend": frontend}
            for frontend in ("sequential", "traced") for mode in LENGTH_MODES]


def bounds(seq: int) -> tuple[int, int]:
    """The variable run's lengths, inclusive: a quarter of the maximum to the maximum."""
    return max(2, seq // 4), seq


def mean_length(seq: int) -> int:
    lo, hi = bounds(seq)
    return round((lo + hi) / 2)


class Indexed:
    """The LM's token dataset, each sample with its index (the collate draws the batch's length from it)."""

    def __init__(self, tensors: tuple[Any, Any]) -> None:
        self.x, self.y = tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, Any, Any]:
        return i, self.x[i], self.y[i]


class Cut:
    """Collate: the samples stacked and cut to the batch's length (fixed, or drawn from the batch's first index)."""

    def __init__(self, mode: str, seq: int) -> None:
        self.mode, self.seq = mode, seq

    def length(self, first: int) -> int:
        import torch

        if self.mode == "fixed max":
            return self.seq
        if self.mode == "fixed mean":
            return mean_length(self.seq)
        lo, hi = bounds(self.seq)
        return int(torch.randint(lo, hi + 1, (1,), generator=torch.Generator().manual_seed(first)))

    def __call__(self, items: list[tuple[int, Any, Any]]) -> tuple[Any, Any]:
        import torch

        n = self.length(min(i for i, _, _ in items))
        return torch.stack([x[:n] for _, x, _ in items]), torch.stack([y[:n] for _, _, y in items])


def merge_lengths(per_rank: list[list[dict[str, Any]]], batch: int, warmup: int) -> list[dict[str, Any]]:
    """One row per lengths configuration: each step's time is the slowest rank's."""
    rows = []
    for results in zip(*per_rank):
        cfg = results[0]["cfg"]
        if cfg["kind"] != "lengths":
            continue
        steps = [max(ts) for ts in zip(*(r["times"] for r in results))][warmup:]
        lengths = results[0]["lengths"][warmup:]
        shapes = results[0]["shapes"][warmup:]  # the same on every rank: the telemetry's exchange
        new = [t for t, s in zip(steps, shapes) if s[0]]
        seen = [t for t, s in zip(steps, shapes) if not s[0]]
        rows.append({
            "label": f"{cfg['frontend']} {cfg['lengths']}", "cfg": cfg,
            "step_ms": statistics.median(steps) * 1e3,
            "tokens_s": batch * sum(lengths) / sum(steps),
            "mean_length": statistics.fmean(lengths), "distinct": len(set(lengths)),
            "new_steps": len(new),
            "new_ms": statistics.median(new) * 1e3 if new else None,
            "seen_ms": statistics.median(seen) * 1e3 if seen else None,
            "shape_ms": statistics.median(s[1] for s in shapes if s[0]) if new else 0.0,
            "alloc_mb": sum(s[2] for s in shapes),
            "captures": len(results[0]["captures"]), "capture_s": sum(results[0]["captures"]),
        })
    return rows


def capture_costs(size: Any, lengths: list[int], m: int) -> dict[str, Any]:
    """What the traced frontend pays for lengths, in this process: ``torch.export`` of the LM on one micro-batch
    with free dimensions (``Dim.AUTO``: the one capture that runs every length), against a static capture at each
    length (what a cache of per-length captures would pay at every new length); the medians of each."""
    import torch
    from models import build
    from torch.export import Dim

    model = build("lm", size)
    free, static = [], []
    for n in lengths:
        x = torch.randint(0, size.vocab, (size.batch // m, n))
        t0 = time.perf_counter()
        torch.export.export(model, (x,), dynamic_shapes={"x": {0: Dim.AUTO, 1: Dim.AUTO}})
        free.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.export.export(model, (x,))  # no dynamic dimension: a capture per length
        static.append(time.perf_counter() - t0)
    return {"free_s": statistics.median(free), "static_s": statistics.median(static), "lengths": lengths}


def lengths_table(rows: list[dict[str, Any]], costs: dict[str, Any] | None) -> str:
    header = ("| LM, 1f1b | step ms (median) | tokens/s | mean length (distinct) | steps with a new length | "
              "median ms: new / seen | hand-over ms per new length | receive MB allocated | captures (s) |")
    lines = [header, "|---|---:|---:|---|---:|---|---:|---:|---|"]
    for r in rows:
        new_seen = (f"{r['new_ms']:.0f} / {r['seen_ms']:.0f}" if r["new_ms"] is not None and r["seen_ms"] is not None
                    else "")
        lines.append(
            f"| {r['label']} | {r['step_ms']:.0f} | {r['tokens_s']:.0f} | {r['mean_length']:.1f} ({r['distinct']}) | "
            f"{r['new_steps']} | {new_seen} | {r['shape_ms']:.2f} | {r['alloc_mb']:.2f} | "
            f"{r['captures']} ({r['capture_s']:.1f}) |")
    if costs:
        note = (f"`torch.export` of the LM on one micro-batch, in one process (medians over lengths "
                f"{costs['lengths']}): with free lengths {costs['free_s']:.2f} s, once; static {costs['static_s']:.2f} "
                f"s, at every new length under a per-length capture cache.")
        lines += ["", note]
    return "\n".join(lines)
