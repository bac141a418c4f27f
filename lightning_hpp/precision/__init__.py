"""Per-stage precision: ``HPPPrecision`` (the Lightning plugin), its modes, the dynamic loss
scaler, the NaN/Inf boundary guard, and the fp8 backends (Transformer Engine or emulation)."""

from lightning_hpp.precision.plugin import HPPPrecision

__all__ = ["HPPPrecision"]
