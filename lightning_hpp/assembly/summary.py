"""Lightning's model summary of the whole model, on a rank that holds some of its stages.

``ModelSummary`` / ``RichModelSummary`` (on by default: ``Trainer(enable_model_summary=True)``) summarise the
LightningModule at the start of ``fit``, where each rank holds only its stages: rank 0 would print the first
stage's parameters as the model's. :func:`summarise_whole_models` makes every such callback summarise the whole
model: each rank describes the layers and parameters it holds, the pipeline's ranks gather what the others hold
(every rank runs the hook, so the gather is collective), and the table is the one one process prints — the same
layers in the same order, their types, parameter counts and modes, the totals (a tied weight counted once, as one
process counts it) and the size. Input and output sizes and FLOPs, which Lightning takes from a forward of
``example_input_array`` through the whole model, are not taken: the columns are left out, as without one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_hpp._dist import all_gather_object
from lightning_hpp.model.units import RemoteUnit

_LEFTOVER, _NA = "Other params", "n/a"


class WholeModelSummary:
    """What ``ModelSummary.on_fit_start`` reads of Lightning's summary object, for the whole model."""

    def __init__(self, data: list[tuple[str, list[str]]], total: int, trainable: int, megabytes: float,
                 modes: dict[str, int]) -> None:
        self._data = data
        self.total_parameters = total
        self.trainable_parameters = trainable
        self.model_size = megabytes
        self.total_training_modes = modes
        self.total_flops = 0

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self._data


def summarise_whole_models(callbacks: Sequence[Any], group: Any, aliases: dict[str, list[str]]) -> None:
    """Make every ``ModelSummary`` among ``callbacks`` summarise the whole model (collective over ``group``, this
    rank's pipeline, when the hook runs); ``aliases``: every name of each weight several stages share."""
    from lightning.pytorch.callbacks import ModelSummary

    for cb in callbacks:
        if isinstance(cb, ModelSummary):
            cb._summary = functools.partial(_whole, cb, group, aliases)  # type: ignore[method-assign]


def _whole(
    callback: Any, group: Any, aliases: dict[str, list[str]], trainer: Any, module: nn.Module
) -> WholeModelSummary:
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

    canonical = {a: names[0] for names in aliases.values() for a in names}
    parts = all_gather_object(_describe(module, callback._max_depth, canonical), group=group)
    layers: dict[str, dict] = {}
    params: dict[str, tuple[int, bool]] = {}
    modes: dict[str, bool] = {}
    for part in parts:
        for name, kind, numels, training in part["layers"]:
            layer = layers.setdefault(name, {"type": None, "numels": {}, "training": training})
            layer["numels"].update(numels)
            if kind is not None and layer["type"] is None:
                layer["type"], layer["training"] = kind, training
        params.update(part["params"])
        modes.update(part["modes"])
    # one process's order (depth first): by each layer's path of child positions, the same on every rank
    paths = {name: path for part in parts for name, path in part["order"]}
    names = sorted(layers, key=lambda n: paths[n])
    counts = [sum(layers[n]["numels"].values()) for n in names]
    total = sum(numel for numel, _ in params.values())
    data = [
        (" ", [str(i) for i in range(len(names))]),
        ("Name", names),
        ("Type", [layers[n]["type"] or RemoteUnit.__name__ for n in names]),
        ("Params", [get_human_readable_count(c) for c in counts]),
        ("Mode", ["train" if layers[n]["training"] else "eval" for n in names]),
        ("FLOPs", [get_human_readable_count(0)] * len(names)),
    ]
    if total - sum(counts) > 0:
        for (_, column), extra in zip(
            data, [" ", _LEFTOVER, _NA, get_human_readable_count(total - sum(counts)), _NA, _NA]
        ):
            column.append(extra)
    bits = {"16": 16, "bf16": 16, "16-true": 16, "bf16-true": 16, "64": 64, "64-true": 64}.get(
        str(trainer.precision), 32
    )
    modes_list = list(modes.values())
    return WholeModelSummary(
        data,
        total,
        sum(numel for numel, grad in params.values() if grad),
        total * bits / 8 * 1e-6,
        {"train": modes_list.count(True), "eval": modes_list.count(False)},
    )


def _describe(module: nn.Module, max_depth: int, canonical: dict[str, str]) -> dict[str, Any]:
    """What this rank holds, as one process's summary counts it: the layers Lightning lists (their names in order,
    their types where held here, their parameters by name), every parameter and every module's mode."""
    if max_depth == 0:
        mods: list[tuple[str, nn.Module]] = []
    elif max_depth == 1:
        mods = list(module.named_children())
    else:
        mods = [(n, m) for n, m in list(module.named_modules())[1:] if max_depth < 0 or n.count(".") < max_depth]
    remote = {n for n, m in module.named_modules() if isinstance(m, RemoteUnit)}

    def held(name: str) -> bool:
        return not any(name == r or name.startswith(r + ".") for r in remote)

    layers = []
    for name, m in mods:
        numels = {canonical.get(f"{name}.{p}", f"{name}.{p}"): t.numel() for p, t in m.named_parameters()}
        layers.append((name, type(m).__name__ if held(name) else None, numels, m.training))
    params = {canonical.get(n, n): (t.numel(), t.requires_grad) for n, t in module.named_parameters()}
    modes = {n: m.training for n, m in list(module.named_modules())[1:] if held(n)}
    return {"order": [(n, _path(module, n)) for n, _ in mods], "layers": layers, "params": params, "modes": modes}


def _path(root: nn.Module, name: str) -> tuple[int, ...]:
    """The positions among their siblings of the modules from ``root`` down to ``name``."""
    path, module = [], root
    for part in name.split("."):
        path.append(list(module._modules).index(part))
        module = module._modules[part]
    return tuple(path)
