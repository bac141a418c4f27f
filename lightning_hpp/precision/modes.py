"""The precision modes a stage can run in: parameter dtype, autocast dtype, wire dtype, loss scaling."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mode:
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    wire_dtype: torch.dtype
    scaled: bool


MODES: dict[str, Mode] = {
    "32-true": Mode(torch.float32, None, torch.float32, False),
    "16-mixed": Mode(torch.float32, torch.float16, torch.float16, True),
    "bf16-mixed": Mode(torch.float32, torch.bfloat16, torch.bfloat16, False),
    "16-true": Mode(torch.float16, None, torch.float16, True),
    "bf16-true": Mode(torch.bfloat16, None, torch.bfloat16, False),
    "fp8": Mode(torch.float32, None, torch.float32, False),
}

NONFINITE_POLICIES = ("raise", "warn", "sanitize")
CLIP_MODES = ("per-stage", "global")
