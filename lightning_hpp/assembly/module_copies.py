"""Copies of the LightningModule that callbacks take before the cut.

Lightning's weight-averaging callbacks (``StochasticWeightAveraging``, ``WeightAveraging``,
``EMAWeightAveraging``) copy the whole module in their ``setup`` hook, which Lightning calls before the strategy
cuts the module; their averages then pair the copy's parameters with the module's, which each rank holds only
for its stages. :func:`align_module_copies` makes every such copy hold what this rank's module holds, so the
averages are taken stage by stage, on every rank, as one process takes them over the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_hpp.model.units import hold_as


def module_copies(callbacks: Sequence[Any], module: nn.Module) -> list[nn.Module]:
    """The copies of ``module`` (same class, another object) the callbacks hold as attributes, directly or inside
    a wrapper module (torch's ``AveragedModel`` keeps it as ``.module``)."""
    found: list[nn.Module] = []
    for cb in callbacks:
        for value in vars(cb).values():
            if not isinstance(value, nn.Module) or value is module:
                continue
            inner = value if type(value) is type(module) else getattr(value, "module", None)
            if type(inner) is type(module) and inner is not module:
                found.append(inner)
    return found


def align_module_copies(callbacks: Sequence[Any], module: nn.Module) -> int:
    """Cut every copy of ``module`` the callbacks hold as ``module`` is cut (:func:`~lightning_hpp.model.units.hold_as`);
    returns how many there were."""
    copies = module_copies(callbacks, module)
    for copy in copies:
        hold_as(copy, module)
    return len(copies)
