"""Comparing what a pipeline rank recorded with what one process recorded.

Every function returns a list of problems, each naming the rank (``where``), the value and the reference's
value (``"pp2 rank 0: callback_metrics['val_loss'] = 1.2 (reference 1.1)"``), so that a report lists every
difference at once rather than the first.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_hpp.check.hooks import HookEntry

REL, ABS = 1e-5, 1e-6
"""Values: fp32 on CPU, the same data and steps; only the order of summation differs (micro-batches, replicas)."""


def close(a: float, b: float, rel: float = REL, abs_: float = ABS) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


SCHEDULE_OWNED = {("module", "backward")}
"""Hooks the pipeline schedule does the work of: one process's ``LightningModule.backward`` runs
``loss.backward()``; a pipeline runs every micro-batch's backward inside the schedule (an override is refused)."""


def diff_hooks(where: str, got: list[HookEntry], ref: list[HookEntry], *, local_rank: int = 0, replica: int = 0,
               replicas: int = 1) -> list[str]:
    """The hook calls of a rank against one process's: the same hooks in the same order, with the same arguments.

    As under DDP, ``prepare_data`` runs on each node's local rank 0 only; :data:`SCHEDULE_OWNED` hooks and the
    order of the setup's first loaders (:func:`setup_order`) are a pipeline's own. With several replicas a batch
    argument is
    the replica's share of the reference batch (rows ``replica::replicas``), and what the replica computed from it
    (``outputs``, a loss) is its own: those are compared where there is one replica.
    """
    expected = setup_order(
        [e for e in ref if not (e[1] == "prepare_data" and local_rank != 0) and e[:2] not in SCHEDULE_OWNED]
    )
    names_got = [f"{owner}.{name}" for owner, name, *_ in got]
    names_ref = [f"{owner}.{name}" for owner, name, *_ in expected]
    if names_got != names_ref:
        at = next(
            (i for i, (a, b) in enumerate(zip(names_got, names_ref)) if a != b), min(len(names_got), len(names_ref))
        )
        return [
            f"{where}: hook calls differ from call {at} on: {names_got[at : at + 6]} (reference "
            f"{names_ref[at : at + 6]}); "
            f"{len(names_got)} calls (reference {len(names_ref)})"
        ]
    problems: list[str] = []
    for i, ((owner, name, args, *_), (_, _, ref_args, *_)) in enumerate(zip(got, expected)):
        for arg in sorted(set(args) | set(ref_args)):
            if arg not in args or arg not in ref_args:
                problems.append(
                    f"{where}: call {i} {owner}.{name}: argument {arg!r} only on "
                    f"{'this rank' if arg in args else 'the reference'}"
                )
                continue
            if replicas > 1 and arg in ("outputs", "loss"):
                continue
            want = ref_args[arg]
            if replicas > 1 and arg == "batch":
                want = _rows(want, replica, replicas)
            problems += [
                f"{where}: call {i} {owner}.{name}({arg}{path}): {d}" for path, d in diff_data(args[arg], want)
            ]
    return problems


_RESTORE = {
    ("module", "on_load_checkpoint"),
    ("datamodule", "load_state_dict"),
    ("callback", "on_load_checkpoint"),
    ("callback", "load_state_dict"),
}
_BUILT = {("module", "setup"), ("module", "configure_model"), ("module", "configure_sharded_model")}


def setup_order(log: list[HookEntry]) -> list[HookEntry]:
    """One process's hook calls in the order a pipeline makes them, which differs in two places:

    * a fit resumed from a checkpoint restores it after ``on_fit_start`` (the strategy restores after its setup, as
      Lightning's sharded strategies do: the stages must exist before their part of the checkpoint is read);
    * each entry point's first ``*_dataloader`` call (with the calls it makes) comes right after the module is built
      (``setup``, ``configure_model``): the strategy cuts the model on one batch of it; Lightning then uses those
      loaders, so the hook still runs once.
    """
    out = list(log)
    for fit_start in [e for e in log if e[:2] == ("module", "on_fit_start")]:
        i = next(k for k, e in enumerate(out) if e is fit_start)
        j = i - 1
        while j >= 0 and out[j][:2] not in _RESTORE and out[j][:2] not in _BUILT:
            j -= 1
        end = j + 1
        while j >= 0 and out[j][:2] in _RESTORE:
            j -= 1
        block = out[j + 1 : end]
        if block:
            del out[j + 1 : end]
            at = next(k for k, e in enumerate(out) if e is fit_start)
            out[at + 1 : at + 1] = block
    for built in [e for e in out if e[:2] in _BUILT]:
        i = next(k for k, e in enumerate(out) if e is built)
        if i + 1 < len(out) and out[i + 1][:2] in _BUILT:
            continue
        rest = out[i + 1 : next((k for k in range(i + 1, len(out)) if out[k][:2] in _BUILT), len(out))]
        fitting = any(e[:2] == ("module", "configure_optimizers") for e in rest)  # a fit cuts on a training batch
        j = next(
            (
                i + 1 + k
                for k, e in enumerate(rest)
                if (e[1] == "train_dataloader" if fitting else e[1].endswith("_dataloader"))
            ),
            None,
        )
        if j is not None:
            end = j + 1
            while end < len(out) and len(out[end]) > 3 and out[end][3] > out[j][3]:  # the calls it makes
                end += 1
            block = out[j:end]
            del out[j:end]
            out[i + 1 : i + 1] = block
    return out


def _rows(value: Any, replica: int, replicas: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value[replica::replicas]
    if isinstance(value, dict):
        return {k: _rows(v, replica, replicas) for k, v in value.items()}
    if isinstance(value, list):
        return [_rows(v, replica, replicas) for v in value]
    return value


def diff_data(got: Any, ref: Any, path: str = "") -> list[tuple[str, str]]:
    """``(path, difference)`` for every place two described values (:func:`~lightning_hpp.check.hooks.describe`)
    differ: tensors by shape and values (to :data:`REL` / :data:`ABS`), numbers to the same tolerance, the rest by
    equality."""
    if isinstance(ref, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(ref, torch.Tensor) and isinstance(got, torch.Tensor)):
            return [(path, f"{_short(got)} (reference {_short(ref)})")]
        if got.shape != ref.shape:
            return [(path, f"shape {tuple(got.shape)} (reference {tuple(ref.shape)})")]
        if got.is_floating_point() or ref.is_floating_point():
            if not torch.allclose(got.double(), ref.double(), rtol=REL, atol=ABS, equal_nan=True):
                err = (got.double() - ref.double()).abs().max().item()
                return [(path, f"values differ by up to {err:.3g}")]
            return []
        return [] if torch.equal(got, ref) else [(path, "values differ")]
    if isinstance(ref, dict) and isinstance(got, dict):
        keys = [] if sorted(got) == sorted(ref) else [(path, f"keys {sorted(got)} (reference {sorted(ref)})")]
        return keys + [d for k in sorted(set(ref) & set(got)) for d in diff_data(got[k], ref[k], f"{path}[{k!r}]")]
    if isinstance(ref, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(got) != len(ref):
            return [(path, f"{len(got)} entries (reference {len(ref)})")]
        return [d for i, (a, b) in enumerate(zip(got, ref)) for d in diff_data(a, b, f"{path}[{i}]")]
    if isinstance(ref, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return [] if close(float(got), ref) else [(path, f"{got!r} (reference {ref!r})")]
    return [] if got == ref else [(path, f"{_short(got)} (reference {_short(ref)})")]


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
