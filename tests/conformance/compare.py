"""Comparing what every rank of the pipeline layouts recorded with the reference.

Each check returns a list of problems (``"pp2dp2 rank 1: callback['val_loss'] = 1.2 (reference 1.1)"``) rather
than stopping at the first, so a failing test names every rank and value that differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.conformance import scenarios, scenarios_coverage, scenarios_usage  # noqa: F401 - fill SCENARIOS
from tests.conformance import shape_scenarios  # noqa: F401 - and the scenarios of changing shapes
from tests.conformance.harness import LAYOUTS, SCENARIOS, Layout, replica_of, result_path

REL, ABS = 1e-5, 1e-6
"""Logged values: fp32 on CPU, the same data and steps; only the order of summation differs (micro-batches,
replicas)."""
PARAM_REL, PARAM_ABS = 1e-5, 1e-5
"""Parameters: as values, with 1e-5 absolute for entries near zero (the largest difference seen over every
scenario is 1.8e-7, after 24 steps at lr 0.1). A scenario must not diverge: at lr 0.5 with momentum the
micro-batches' rounding grew to 2.4e-5 in 24 steps."""


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)


@dataclass
class Rank:
    layout: Layout
    rank: int
    result: dict

    @property
    def replica(self) -> int:
        return replica_of(self.layout, self.rank)

    @property
    def where(self) -> str:
        return f"{self.layout.name} rank {self.rank}"


@dataclass
class Outcome:
    """One scenario's results: the reference's and every rank's of every layout it ran on."""

    name: str
    ref: dict
    ranks: list[Rank]

    def layout(self, name: str) -> list[Rank]:
        return [r for r in self.ranks if r.layout.name == name]


def load(root: Path, name: str) -> Outcome:
    """Every result file of scenario ``name``; a run that raised fails here, naming the rank and the error."""
    s = SCENARIOS[name]
    ref = torch.load(result_path(root, name, "ref", 0), weights_only=False)
    assert "error" not in ref, f"{name}: the reference raised\n{ref.get('traceback', ref['error'])}"
    ranks, errors = [], []
    for layout_name in s.layouts:
        layout = LAYOUTS[layout_name]
        for r in range(layout.devices):
            path = result_path(root, name, layout_name, r)
            if not path.exists():
                errors.append(f"{layout_name} rank {r}: no result ({path.name} missing)")
                continue
            result = torch.load(path, weights_only=False)
            if "error" in result:
                errors.append(f"{layout_name} rank {r}: {result['error']}\n{result['traceback'][-1500:]}")
            ranks.append(Rank(layout, r, result))
    assert not errors, f"{name}: " + "\n".join(errors)
    return Outcome(name, ref, ranks)


def report(problems: list[str], limit: int = 40) -> str:
    more = f"\n... and {len(problems) - limit} more" if len(problems) > limit else ""
    return "\n".join(problems[:limit]) + more


# ---------------------------------------------------------------------------------------------- pieces
def diff_values(where: str, what: str, got: dict, ref: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """Same keys, values equal to the tolerance (keys starting with one of ``skip`` left out)."""
    keep = lambda k: not any(k.startswith(s) for s in skip)  # noqa: E731
    got = {k: v for k, v in got.items() if keep(k)}
    ref = {k: v for k, v in ref.items() if keep(k)}
    problems = []
    if sorted(got) != sorted(ref):
        problems.append(f"{where}: {what} keys {sorted(got)} (reference {sorted(ref)})")
    for k in sorted(set(got) & set(ref)):
        if not close(got[k], ref[k]):
            problems.append(f"{where}: {what}[{k!r}] = {got[k]:.7g} (reference {ref[k]:.7g})")
    return problems


def diff_state(where: str, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    """Every tensor this rank holds equals the reference's tensor of the same name."""
    problems = []
    for k, v in sorted(got.items()):
        if k not in ref:
            problems.append(f"{where}: holds {k!r}, which the reference has not")
        elif v.shape != ref[k].shape or not torch.allclose(v.float(), ref[k].float(), rtol=PARAM_REL, atol=PARAM_ABS):
            err = (v.float() - ref[k].float()).abs().max().item() if v.shape == ref[k].shape else float("nan")
            problems.append(f"{where}: parameter {k!r} differs by up to {err:.3g}")
    return problems


def diff_held(outcome: Outcome, layout: str) -> list[str]:
    """The ranks of each replica hold, together, every tensor of the reference's module."""
    problems, ref = [], set(outcome.ref["state"])
    ranks = outcome.layout(layout)
    for replica in sorted({r.replica for r in ranks}):
        held = set().union(*(r.result["state"] for r in ranks if r.replica == replica))
        if held != ref:
            problems.append(f"{layout} replica {replica}: ranks hold {sorted(held)} (reference {sorted(ref)})")
    return problems


def diff_list(where: str, what: str, got: list, ref: list) -> list[str]:
    if len(got) != len(ref):
        return [f"{where}: {len(got)} {what} (reference {len(ref)})"]
    return [f"{where}: {what}[{i}] = {g} (reference {e})" for i, (g, e) in enumerate(zip(got, ref)) if not _equal(g, e)]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return close(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return sorted(a) == sorted(b) and all(_equal(a[k], b[k]) for k in a)
    return a == b


def diff_steps(where: str, got: list[dict], ref: list[dict], *, losses: bool, skip: tuple[str, ...] = ()) -> list[str]:
    """Per training batch: position, ``callback_metrics``, learning rates and (``losses``) the loss handed to
    ``on_train_batch_end``."""
    if len(got) != len(ref):
        return [f"{where}: {len(got)} training batches (reference {len(ref)}; global steps "
                f"{[s['global_step'] for s in got]} vs {[s['global_step'] for s in ref]})"]
    problems = []
    for i, (g, e) in enumerate(zip(got, ref)):
        at = f"{where} batch {i}"
        for key in ("global_step", "epoch", "batch_idx"):
            if g[key] != e[key]:
                problems.append(f"{at}: {key} {g[key]} (reference {e[key]})")
        problems += diff_values(at, "callback_metrics", g["callback"], e["callback"], skip)
        problems += diff_list(at, "lr", g["lr"], e["lr"])
        if losses and not close(g["loss"], e["loss"]):
            problems.append(f"{at}: loss {g['loss']:.7g} (reference {e['loss']:.7g})")
    return problems


def diff_validations(where: str, got: list[dict], ref: list[dict], skip: tuple[str, ...] = ()) -> list[str]:
    if len(got) != len(ref):
        return [f"{where}: validation ran at {[(v['epoch'], v['global_step']) for v in got]} (epoch, step) "
                f"(reference {[(v['epoch'], v['global_step']) for v in ref]})"]
    problems = []
    for i, (g, e) in enumerate(zip(got, ref)):
        at = f"{where} validation {i}"
        for key in ("global_step", "epoch", "fn"):
            if g[key] != e[key]:
                problems.append(f"{at}: {key} {g[key]} (reference {e[key]})")
        problems += diff_values(at, "callback_metrics", g["callback"], e["callback"], skip)
    return problems


def diff_logger(where: str, got: list, ref: list, skip: tuple[str, ...] = ()) -> list[str]:
    if [s for s, _ in got] != [s for s, _ in ref]:
        return [f"{where}: the logger got steps {[s for s, _ in got]} (reference {[s for s, _ in ref]})"]
    problems = []
    for i, ((step, g), (_, e)) in enumerate(zip(got, ref)):
        problems += diff_values(f"{where} log_metrics call {i} (step {step})", "metrics", g, e, skip)
    return problems


def diff_run(got: dict, ref: dict, where: str, layout: Layout, skip: tuple[str, ...] = ()) -> list[str]:
    """Everything :func:`tests.conformance.harness.snapshot` records, against the reference. With dp > 1 the loss
    ``on_train_batch_end`` receives is the replica's own (as under DDP) and is left to the scenarios that probe it;
    names starting with one of ``skip`` are left out (values a replica logs for itself)."""
    problems = []
    for key in ("global_step", "epoch", "should_stop"):
        if got[key] != ref[key]:
            problems.append(f"{where}: {key} {got[key]} (reference {ref[key]})")
    for key, what in (("callback", "callback_metrics"), ("logged", "logged_metrics"),
                      ("progress", "progress_bar_metrics")):
        problems += diff_values(where, what, got[key], ref[key], skip)
    problems += diff_state(where, got["state"], ref["state"])
    problems += diff_list(where, "lr", got["lr"], ref["lr"])
    problems += diff_steps(where, got["steps"], ref["steps"], losses=layout.dp == 1, skip=skip)
    problems += diff_validations(where, got["validations"], ref["validations"], skip)
    problems += diff_list(where, "epoch ends (epoch, step, lr)",
                          [(e["epoch"], e["global_step"], e["lr"]) for e in got["epochs"]],
                          [(e["epoch"], e["global_step"], e["lr"]) for e in ref["epochs"]])
    problems += diff_logger(where, got["logger"], ref["logger"], skip)
    return problems


def diff_all(outcome: Outcome, ref: dict | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """:func:`diff_run` on every rank of every layout, and the replicas' stages together hold the whole module."""
    ref = outcome.ref if ref is None else ref
    problems = []
    for r in outcome.ranks:
        problems += diff_run(r.result, ref, r.where, r.layout, skip)
    for layout in sorted({r.layout.name for r in outcome.ranks}):
        problems += diff_held(outcome, layout)
    return problems


def diff_resumed(outcome: Outcome) -> list[str]:
    """A resumed run (the second of two fits) against the reference run without interruption: its end state whole,
    its first fit step by step, and each step, validation and log call of the resumed fit against the reference's at
    the same global step. Per step, ``callback_metrics`` leave out the validation values: a resumed Trainer holds none
    until it validates, as under Lightning's own resume (``ref["lightning_resumed"]``)."""
    ref, problems = outcome.ref, []
    for r in outcome.ranks:
        got, where, losses = r.result, r.where, r.layout.dp == 1
        first = got["start_step"]  # the checkpoint's step
        problems += diff_steps(f"{where} (first fit)", got["first"]["steps"],
                               ref["steps"][: len(got["first"]["steps"])],
                               losses=losses)
        for key in ("global_step", "epoch", "should_stop"):
            if got[key] != ref[key]:
                problems.append(f"{where}: {key} {got[key]} (reference {ref[key]})")
        for key, what in (("callback", "callback_metrics"), ("logged", "logged_metrics"),
                          ("progress", "progress_bar_metrics")):
            problems += diff_values(where, what, got[key], ref[key])
        problems += diff_state(where, got["state"], ref["state"])
        problems += diff_list(where, "lr", got["lr"], ref["lr"])
        problems += diff_steps(where, got["steps"], [s for s in ref["steps"] if s["global_step"] > first],
                               losses=losses,
                               skip=("val_",))
        problems += diff_validations(where, got["validations"],
                                     [v for v in ref["validations"] if v["global_step"] > first])
        problems += diff_logger(where, got["logger"], [x for x in ref["logger"] if x[0] >= first])
    for layout in sorted({r.layout.name for r in outcome.ranks}):
        problems += diff_held(outcome, layout)
    return problems


def diff_metric_lists(where: str, what: str, got: list[dict], ref: list[dict]) -> list[str]:
    """What ``trainer.validate`` / ``trainer.test`` return: one dict per dataloader."""
    if len(got) != len(ref):
        return [f"{where}: {what} returned {len(got)} dicts (reference {len(ref)})"]
    return [p for i, (g, e) in enumerate(zip(got, ref)) for p in diff_values(where, f"{what}[{i}]", g, e)]
