"""Coded-bias guards: systematic skew between ranks or runs that comes from code, not data.

* :mod:`~lightning_hpp.bias.fingerprint` — per-rank environment fingerprints, compared across ranks
  and against a saved run.
* :mod:`~lightning_hpp.bias.samplers` — :class:`DistributedWeightedSampler`, weighted sampling that
  is correct on every rank whether or not Lightning's ``use_distributed_sampler`` is on.
* :mod:`~lightning_hpp.bias.audit` — a data-loading audit that draws indices on every rank and names
  each hazard with its fix and its severity: ``"skew"`` (ranks see the wrong data) or
  ``"reproducibility"`` (a note, acted on only in deterministic runs).
* :mod:`~lightning_hpp.bias.monitor` — :class:`BiasMonitor`, a callback that logs the spread of
  losses and local gradient norms across data-parallel ranks and the ranks' sample overlap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_hpp.bias.audit import (
    REPRODUCIBILITY,
    SEVERITY,
    SKEW,
    Hazard,
    analyze_audit_records,
    audit_dataloader,
    collect_audit_record,
    enforce_audit,
)
from lightning_hpp.bias.determinism import enable_determinism, ensure_hash_seed, worker_init_fn
from lightning_hpp.bias.fingerprint import (
    CodedBiasWarning,
    FingerprintDifference,
    collect_fingerprint,
    compare_fingerprints,
    compare_with_saved,
    enforce,
    gather_fingerprints,
    load_fingerprints,
    save_fingerprints,
)
from lightning_hpp.bias.samplers import DistributedWeightedSampler
from lightning_hpp.errors import BiasConfigError, CodedBiasError, FingerprintMismatchError, SamplerError

if TYPE_CHECKING:
    from lightning_hpp.bias.guard import BiasGuard
    from lightning_hpp.bias.monitor import BiasMonitor


def __getattr__(name: str) -> Any:
    # BiasMonitor needs lightning.pytorch (slow to import); the other guards do not.
    if name == "BiasMonitor":
        from lightning_hpp.bias.monitor import BiasMonitor

        return BiasMonitor
    if name == "BiasGuard":
        from lightning_hpp.bias.guard import BiasGuard

        return BiasGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REPRODUCIBILITY",
    "SEVERITY",
    "SKEW",
    "BiasConfigError",
    "BiasGuard",
    "BiasMonitor",
    "CodedBiasError",
    "CodedBiasWarning",
    "DistributedWeightedSampler",
    "FingerprintDifference",
    "FingerprintMismatchError",
    "Hazard",
    "SamplerError",
    "analyze_audit_records",
    "audit_dataloader",
    "collect_audit_record",
    "collect_fingerprint",
    "compare_fingerprints",
    "compare_with_saved",
    "enable_determinism",
    "enforce",
    "enforce_audit",
    "ensure_hash_seed",
    "gather_fingerprints",
    "load_fingerprints",
    "save_fingerprints",
    "worker_init_fn",
]
