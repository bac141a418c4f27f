"""One job's coded-bias controls under the pipeline strategy: :class:`BiasControls`.

It takes :class:`~lightning_hpp.options.BiasOptions` whole and holds what the strategy's hooks need:
the hash seed fixed for the ranks before they are launched, deterministic algorithms in every rank,
the fingerprint/audit guard attached to the Trainer, and the per-replica dataloader worker seeds.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from lightning_hpp.bias.determinism import (
    WorkerSeeder,
    determinism_seed,
    enable_determinism,
    ensure_hash_seed,
    worker_init_fn,
)
from lightning_hpp.bias.guard import BiasGuard

if TYPE_CHECKING:
    from lightning_hpp.options import BiasOptions


class BiasControls:
    """Determinism and the coded-bias guard for one strategy.

    Args:
        options: The strategy's ``BiasOptions``.
    """

    def __init__(self, options: BiasOptions) -> None:
        self.options = options
        self.deterministic = options.deterministic
        self._guard = BiasGuard(fingerprint=options.fingerprint, audit=options.audit)
        self.active_guard: BiasGuard | None = None
        if self.deterministic:
            ensure_hash_seed(self.seed)  # before Lightning launches the other ranks

    @property
    def seed(self) -> int:
        """``BiasOptions.seed``, else ``PL_GLOBAL_SEED`` (``seed_everything``), else 0."""
        return self.options.seed if self.options.seed is not None else determinism_seed()

    def before_launch(self) -> None:
        """In the launching process: ``Trainer(deterministic=True)`` has set torch's flag by now; fix the
        hash seed the launched ranks start with."""
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            self.deterministic = True
        if self.deterministic:
            ensure_hash_seed(self.seed)

    def setup_environment(self, trainer: Any) -> None:
        """In every rank, before its process group: deterministic algorithms, the guard callback."""
        if self.deterministic:
            enable_determinism(self.seed)
        if self.options.fingerprint != "off" or self.options.audit != "off":
            self.active_guard = self._guard.attach(trainer)

    def worker_init(self, replica: int) -> WorkerSeeder | None:
        """The dataloader ``worker_init_fn`` for ``replica`` (``None``: leave Lightning's seeding)."""
        if self.deterministic or int(os.environ.get("PL_SEED_WORKERS", 0)):
            return worker_init_fn(self.seed, replica)
        return None

    def checkpoint_metadata(self) -> Any:
        """The fingerprints a checkpoint carries (``None`` with the guard off)."""
        return self.active_guard.checkpoint_metadata() if self.active_guard is not None else None
