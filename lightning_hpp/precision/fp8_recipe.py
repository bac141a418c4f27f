"""fp8's formats and how its per-tensor scales are chosen (:class:`FP8Recipe`, Transformer Engine's recipes).

Scaling follows Transformer Engine's recipes: ``"current"`` takes the scale from the tensor being cast
(``scale = fp8_max / amax``); ``"delayed"`` takes it from an amax history of the previous calls (``max`` or
``most_recent`` over ``amax_history_len`` entries), then records the current amax. In both, ``scale`` is
divided by ``2 ** margin``.
"""

from __future__ import annotations

import dataclasses

import torch

from lightning_hpp.errors import FP8Error
from lightning_hpp.validation import check_choice, check_int

E4M3 = torch.float8_e4m3fn
"""Forward format (activations and weights): 4 exponent bits, 3 mantissa bits, max 448."""
E5M2 = torch.float8_e5m2
"""Backward format (gradients): 5 exponent bits, 2 mantissa bits, max 57344."""
E4M3_MAX = float(torch.finfo(E4M3).max)
E5M2_MAX = float(torch.finfo(E5M2).max)

BACKENDS = ("te", "emulate")
"""Values of ``fp8_backend``."""
SCALINGS = ("delayed", "current")
"""Transformer Engine scaling recipes: ``DelayedScaling`` and ``Float8CurrentScaling``."""
MIN_CAPABILITY = (8, 9)
"""Smallest CUDA compute capability with fp8 tensor cores (Ada; Hopper is 9.0)."""
FP8_ALIGNMENT = 16
"""fp8 GEMMs need both weight dimensions divisible by this; other layers stay unconverted."""

# Columns of an EmulatedFP8Linear's amax history, one per quantized tensor (TE's layout).
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
SLOT_FORMAT = {INPUT: E4M3, WEIGHT: E4M3, GRAD_OUTPUT: E5M2}


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
    """How per-tensor fp8 scales are chosen (Transformer Engine's recipe, in its own words).

    Attributes:
        scaling: ``"delayed"`` (TE ``DelayedScaling``: scale from the amax history of previous
            calls) or ``"current"`` (TE ``Float8CurrentScaling``: scale from the tensor itself).
        margin: The scale is divided by ``2 ** margin`` (headroom against growth between calls).
            Delayed scaling only, as in Transformer Engine.
        amax_history_len: Number of past amaxes kept per tensor for delayed scaling.
        amax_compute_algo: ``"max"`` (largest amax in the history) or ``"most_recent"``.
    """

    scaling: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        check_choice(self.scaling, "FP8Recipe(scaling=...)", SCALINGS, error=FP8Error,
                     hint="They are Transformer Engine's DelayedScaling and Float8CurrentScaling.")
        check_int(
            self.margin, "FP8Recipe(margin=...)", minimum=0, error=FP8Error, hint="The scale is divided by 2**margin."
        )
        if self.scaling == "current" and self.margin != 0:
            raise FP8Error(
                f"fp8 recipe margin is {self.margin!r} with scaling='current'; Transformer Engine's current "
                f"scaling has no margin. Use margin=0, or scaling='delayed'."
            )
        check_int(self.amax_history_len, "FP8Recipe(amax_history_len=...)", error=FP8Error)
        check_choice(self.amax_compute_algo, "FP8Recipe(amax_compute_algo=...)", ("max", "most_recent"), error=FP8Error)

    @classmethod
    def coerce(cls, recipe: str | FP8Recipe) -> FP8Recipe:
        """Accept a recipe object or its scaling name (``"delayed"`` / ``"current"``)."""
        if isinstance(recipe, FP8Recipe):
            return recipe
        if isinstance(recipe, str):
            return cls(scaling=recipe)
        raise FP8Error(f"fp8 recipe {recipe!r} is neither 'delayed', 'current' nor an `FP8Recipe`.")
