"""Stages placed on a device other than the CPU, to check on the CPU what a GPU would refuse.

:func:`place_and_run` cuts a model as HPPStrategy does (either frontend, or the meta-device path of a big
model, traced on fake-tensor stand-ins), moves it, its stages and one micro-batch onto the ``meta``
device (shapes, dtypes and devices without storage, so no GPU is needed; or onto a real GPU where one
is), applies a stage precision's cast, and runs every stage's forward and the backward through them. It
returns every tensor that is not where its stage is: a parameter, buffer or gradient of a stage, a
stage's input or output, and any op that mixes devices ("Tensor on device cpu is not on the expected
device meta"), which is what a GPU raises as well.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from lightning_hpp.model.frontend import cut_model
from lightning_hpp.model.materialize import fake_parameters, has_meta_parameters, materialize
from lightning_hpp.pipeline.stage import StageModule
from lightning_hpp.planning.plan import StagePlan


def place_and_run(module: nn.Module, plan: StagePlan, example: tuple[tuple, dict], *, frontend: str = "auto",
                  device: str = "meta", param_dtype: dict[int, torch.dtype] | None = None) -> tuple[str, list[str]]:
    """Cut ``module`` by ``plan`` with ``example`` (the ``(args, kwargs)`` of its call), place everything on
    ``device`` (``meta``, or a real GPU), cast stage ``k`` to ``param_dtype[k]`` as its precision does, run forward
    and backward.

    Returns ``(frontend used, problems)``: ``problems`` is empty when every tensor was on the stage's device."""
    dev = torch.device(device)
    meta = has_meta_parameters(module)
    if meta:  # as the strategy does: trace on the rank's device with stand-ins, then materialize this rank's share
        with fake_parameters(module, dev) as mode:
            with mode:
                traced_example = _to(example, dev)
            cut = cut_model(module, plan, traced_example, frontend=frontend, modes=("train", "eval"))
    else:
        cut = cut_model(module, plan, example, frontend=frontend, modes=("train", "eval"))
    example = _to(example, dev)
    problems: list[str] = []
    bodies = [b for m in ("train", "eval") for bs in cut.bodies[m] for b in bs]
    if meta:
        materialize(module, dev, seed=0)
    module.to(dev)  # as the strategy does
    for body in bodies:
        if hasattr(body, "place"):
            body.place(dev)
    stages = [StageModule(s.modules, cut.bodies["train"][k], k, spread=cut.spread[k], captured=cut.frontend == "traced")
              for k, s in enumerate(cut.plan.stages)]
    for k, sm in enumerate(stages):
        dtype = (param_dtype or {}).get(k)
        if dtype is not None:
            sm.to(dtype)
            sm.input_dtype = dtype
    args, kwargs = example
    x: Any = cut.flatten(args, kwargs) if cut.flatten is not None else (args[0] if len(args) == 1 else tuple(args))
    for k, sm in enumerate(stages):
        problems += _misplaced(f"stage {k} input", x, dev)
        problems += _misplaced_state(k, sm, dev)
        try:
            x = sm(*x) if isinstance(x, tuple) else sm(x)
        except Exception as err:  # noqa: BLE001 - every failure is a finding, reported with its stage
            problems.append(f"stage {k} forward: {type(err).__name__}: {str(err).splitlines()[0]}")
            return cut.frontend, problems
        problems += _misplaced(f"stage {k} output", x, dev)
    loss = sum(t.float().sum() for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.is_floating_point())
    try:
        loss.backward()
    except Exception as err:  # noqa: BLE001
        problems.append(f"backward: {type(err).__name__}: {str(err).splitlines()[0]}")
    for k, sm in enumerate(stages):
        problems += [f"stage {k} gradient of {n} on {p.grad.device}" for n, p in sm.named_parameters()
                     if p.grad is not None and not _on(p.grad, dev)]
    return cut.frontend, problems


def _to(tree: Any, dev: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, tree)


def _on(t: torch.Tensor, dev: torch.device) -> bool:
    return t.device.type == dev.type


def _misplaced(what: str, tree: Any, dev: torch.device) -> list[str]:
    return [f"{what} {i} on {t.device}" for i, t in enumerate(pytree.tree_leaves(tree))
            if isinstance(t, torch.Tensor) and not _on(t, dev)]


def _misplaced_state(k: int, sm: nn.Module, dev: torch.device) -> list[str]:
    tensors = [*sm.named_parameters(remove_duplicate=False), *sm.named_buffers(remove_duplicate=False)]
    return [f"stage {k} tensor {n} on {t.device}" for n, t in tensors if t is not None and not _on(t, dev)]
