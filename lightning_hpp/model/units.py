"""Pipeline units of a LightningModule.

The units are the module's top-level children in registration order; an ``nn.Sequential`` or
``nn.ModuleList`` child is expanded into its items (``blocks.0``, ``blocks.1``, ...), so a model
can be cut between any two blocks. Loss modules and torchmetrics metrics are not units: they hold
no pipeline computation and stay on every rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_hpp.errors import PlanError


def _is_excluded(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.loss._Loss):
        return True
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:  # pragma: no cover - torchmetrics ships with lightning
        return False
    return isinstance(module, (Metric, MetricCollection))


def find_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pipeline units of ``module`` in registration order.

    Raises:
        PlanError: when the module has no units, or registers parameters directly on itself
            (such parameters belong to no unit, so no stage could own them).
    """
    direct = [n for n, _ in module.named_parameters(recurse=False)]
    if direct:
        raise PlanError(
            f"`{type(module).__name__}` registers parameters {direct} directly on itself; pipeline "
            f"stages are made of child modules, so move them into a submodule (e.g. an `nn.Module` "
            f"that holds the parameter and applies it in its `forward`)."
        )
    units: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        if _is_excluded(child):
            continue
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            for item_name, item in child.named_children():
                units.append((f"{name}.{item_name}", item))
        else:
            units.append((name, child))
    if not units:
        raise PlanError(
            f"`{type(module).__name__}` has no child modules to cut into stages; define the layers as "
            f"attributes (e.g. `self.encoder = ...`) in `__init__`."
        )
    return units


def replace_unit(module: nn.Module, name: str, new: nn.Module) -> None:
    """Replace unit ``name`` (``"encoder"`` or ``"blocks.3"``) inside ``module``."""
    parent_name, _, leaf = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    if isinstance(parent, (nn.Sequential, nn.ModuleList)):
        parent[int(leaf)] = new
    else:
        setattr(parent, leaf, new)


class RemoteUnit(nn.Module):
    """Stands in for a unit that lives on another rank."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.unit_name = name
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Unit {self.unit_name!r} belongs to pipeline stage {self.stage}, which runs on another rank; it "
            f"cannot be called here. Under HPPStrategy call `self(...)` only inside the Lightning steps."
        )


def keep_stages(module: nn.Module, stage_units: list[list[str]], held: list[int]) -> None:
    """Replace every unit of a stage not in ``held`` by a :class:`RemoteUnit` (in place), so this
    rank keeps only its own stages' parameters."""
    for k, names in enumerate(stage_units):
        if k not in held:
            for name in names:
                replace_unit(module, name, RemoteUnit(name, k))


def keep_tensors(module: nn.Module, keep: set[int], stage_of: dict[int, int]) -> None:
    """Drop from ``module`` (in place) every parameter and buffer whose ``id`` is not in ``keep``.

    A submodule none of whose tensors is kept becomes a :class:`RemoteUnit`; a kept module's own
    parameter or buffer that is not kept is unregistered (set to ``None``, so ``state_dict`` and the
    optimizer never see it). Used by the traced frontend, whose stages are sets of tensors rather
    than whole units; ``stage_of`` names the stage that holds a tensor, for the stand-in's message.
    """

    def visit(name: str, mod: nn.Module) -> None:
        tensors = [*mod.parameters(), *mod.buffers()]
        if name and tensors and not any(id(t) in keep for t in tensors):
            replace_unit(module, name, RemoteUnit(name, stage_of.get(id(tensors[0]), -1)))
            return
        for registry in (mod._parameters, mod._buffers):
            for key, t in list(registry.items()):
                if t is not None and id(t) not in keep:
                    registry[key] = None
        for child_name, child in list(mod.named_children()):
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)


def hold_as(copy: nn.Module, cut: nn.Module) -> None:
    """Make ``copy`` (a copy of a module taken before it was cut: ``deepcopy(pl_module)``) hold what ``cut`` holds
    now: the units ``cut`` replaced by a :class:`RemoteUnit` replaced in ``copy`` too, and each parameter or buffer
    ``cut`` unregistered unregistered in ``copy``. Their parameters then pair up in order, as ``zip(a.parameters(),
    b.parameters())`` expects (weight averaging)."""
    for name, sub in list(cut.named_modules()):
        if isinstance(sub, RemoteUnit):
            replace_unit(copy, name, RemoteUnit(sub.unit_name, sub.stage))
    copies = dict(copy.named_modules())
    for name, sub in cut.named_modules():
        mine = copies.get(name)
        if mine is None or isinstance(sub, RemoteUnit):
            continue
        for registry, theirs in ((mine._parameters, sub._parameters), (mine._buffers, sub._buffers)):
            for key in [k for k, t in registry.items() if t is not None and theirs.get(k) is None]:
                registry[key] = None
