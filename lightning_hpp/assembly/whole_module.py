"""Lightning's callbacks that act on the whole LightningModule, on a rank that holds some of its stages.

**Copies taken before the cut.** Lightning's weight-averaging callbacks (``StochasticWeightAveraging``,
``WeightAveraging``,
``EMAWeightAveraging``) copy the whole module in their ``setup`` hook, which Lightning calls before the strategy
cuts the module; their averages then pair the copy's parameters with the module's, which each rank holds only
for its stages. :func:`align_module_copies` makes every such copy hold what this rank's module holds, so the
averages are taken stage by stage, on every rank, as one process takes them over the whole model.

**Param groups added for modules of other ranks.** ``BaseFinetuning.unfreeze_and_add_param_group`` (what
``BackboneFinetuning`` and users' fine-tuning callbacks call to unfreeze a backbone) adds a param group only
where the modules have parameters, so a rank that does not hold them adds none, and the optimizer's groups
then differ between ranks: ``param_groups[-1]``, which the callback later sets the backbone's learning rate
on, is another group there. :func:`keep_param_groups_aligned` makes it add the same group, empty, on such a
rank, so every rank's optimizer keeps the groups one process has, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_hpp.model.units import RemoteUnit, hold_as


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
    """Cut every copy of ``module`` the callbacks hold as ``module`` is cut
    (:func:`~lightning_hpp.model.units.hold_as`);
    returns how many there were."""
    copies = module_copies(callbacks, module)
    for copy in copies:
        hold_as(copy, module)
    return len(copies)


def keep_param_groups_aligned() -> None:
    """Make Lightning's ``BaseFinetuning.unfreeze_and_add_param_group`` add its group, empty, on a rank that holds
    none of the modules it unfreezes (see the module docstring); it is unchanged for modules held whole. Installed
    once per process."""
    from lightning.pytorch.callbacks.finetuning import BaseFinetuning

    original = BaseFinetuning.unfreeze_and_add_param_group
    if getattr(original, "_hpp_aligned", False):
        return

    def unfreeze_and_add_param_group(
        modules: Any, optimizer: Any, lr: float | None = None, initial_denom_lr: float = 10.0, train_bn: bool = True
    ) -> None:
        groups = len(optimizer.param_groups)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)  # as the original reads it, before
        original(modules, optimizer, lr, initial_denom_lr, train_bn)
        if len(optimizer.param_groups) == groups and _holds_remote(modules):
            optimizer.add_param_group({"params": [], "lr": params_lr / (initial_denom_lr if lr is None else 1.0)})

    unfreeze_and_add_param_group._hpp_aligned = True  # type: ignore[attr-defined]
    BaseFinetuning.unfreeze_and_add_param_group = staticmethod(unfreeze_and_add_param_group)  # type: ignore[assignment]


def _holds_remote(modules: Any) -> bool:
    """Whether ``modules`` (a module or an iterable of them, nested) include a unit held by another rank."""
    if isinstance(modules, nn.Module):
        return any(isinstance(m, RemoteUnit) for m in modules.modules())
    try:
        return any(_holds_remote(m) for m in modules)
    except TypeError:
        return False


def adapt_callbacks(callbacks: Sequence[Any], pipeline: Any) -> None:
    """Make Lightning's callbacks that act on the whole module act on it across the pipeline's ranks: weight
    averaging's copies cut as the module is, fine-tuning's param groups the same on every rank, prediction writers
    writing once per replica, model summaries of the whole model."""
    from lightning_hpp.assembly.summary import summarise_whole_models
    from lightning_hpp.assembly.writers import write_once_per_replica

    align_module_copies(callbacks, pipeline.module)
    keep_param_groups_aligned()
    write_once_per_replica(callbacks, writes=pipeline.mesh.position == 0)
    if pipeline.mesh.pp > 1:
        summarise_whole_models(callbacks, pipeline.mesh.pp_group, pipeline.aliases)
