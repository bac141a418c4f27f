"""The user's optimizers over one rank's stages.

``configure_optimizers`` runs on every rank with the parameters that rank's stages hold (the others are
:class:`~lightning_hpp.model.units.RemoteUnit` stand-ins). A rank whose stages have nothing to train — a
frozen backbone (``requires_grad_(False)`` and an optimizer over the trainable parameters), adapters that live
in other stages — builds its optimizer over an empty list, which torch refuses ("optimizer got an empty
parameter list"); one process never does. Inside :func:`stage_local_optimizers` such an optimizer gets one
empty parameter group instead: it steps nothing, keeps its hyperparameters (schedulers and checkpoints see the
same groups' settings as on every other rank), and a later ``add_param_group`` (Lightning's
``BackboneFinetuning`` unfreezing) adds to it as it would in one process. Param groups that are empty on
this rank are kept as torch keeps them, so every rank's optimizer has the same groups in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def stage_local_optimizers() -> Iterator[None]:
    """Let optimizers built inside the context start from an empty parameter list (see the module docstring)."""
    init = torch.optim.Optimizer.__init__

    def __init__(self: torch.optim.Optimizer, params: Any, defaults: dict[str, Any]) -> None:
        if not isinstance(params, torch.Tensor):
            params = list(params)
            if not params:
                params = [{"params": []}]
        init(self, params, defaults)

    torch.optim.Optimizer.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign]
