"""Robust alarm rules for noisy per-step series (what :class:`~lightning_hpp.bias.monitor.BiasMonitor` judges).

A correct run's spread metrics are noisy: one step can spike, and the first steps of training (large,
fast-changing losses and gradients) say nothing about the spread the run settles to. Both rules here
therefore ignore a warm-up and look at the median of the last few values, so a single spike never
alarms, while a shift that persists (the field report's ``loss_std`` 0.042 → 0.189) does within a
few steps:

* :class:`SustainedLevel` — the median of the last ``sustain`` values exceeds a fixed threshold;
* :class:`SustainedShift` — the median of the last ``sustain`` values exceeds both ``jump`` times the
  rolling median of the values before them and that median plus ``mad_factor`` robust standard
  deviations (1.4826 × the median absolute deviation). The baseline window rolls, so slow drift is
  followed; values that are part of a flagged shift are kept out of it, so a persistent shift does
  not become the new normal.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

MAD_TO_STD = 1.4826
"""Scale of the median absolute deviation to a standard deviation for normally distributed values."""


@dataclass(frozen=True)
class Shift:
    """A flagged shift: the recent median against the baseline's median and MAD."""

    recent: float
    base: float
    mad: float

    @property
    def factor(self) -> float:
        return self.recent / self.base if self.base > 0 else float("inf")


class SustainedLevel:
    """The median of the last ``sustain`` values (after ``warmup`` values) above ``threshold``."""

    def __init__(self, threshold: float, sustain: int, warmup: int) -> None:
        self.threshold = threshold
        self.warmup = warmup
        self._seen = 0
        self._recent: deque[float] = deque(maxlen=sustain)

    def update(self, value: float) -> float | None:
        """Add one value; returns the recent median when it exceeds the threshold, else ``None``."""
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        self._recent.append(value)
        if len(self._recent) < self._recent.maxlen:
            return None
        median = statistics.median(self._recent)
        return median if median > self.threshold else None


class SustainedShift:
    """A persistent rise of a series above its own rolling median (see the module docstring).

    Args:
        jump: The recent median must exceed ``jump`` times the baseline median.
        window: Values in the rolling baseline.
        sustain: Values in the recent window whose median is judged.
        warmup: Leading values ignored (neither baseline nor judged).
        mad_factor: The recent median must also exceed the baseline median by this many robust
            standard deviations of the baseline.
        min_baseline: Baseline values needed before judging (default: 5, or the window if smaller); the
            window then keeps growing to ``window`` values, which steadies the median of a noisy series.
    """

    def __init__(
        self,
        jump: float,
        window: int,
        sustain: int,
        warmup: int,
        mad_factor: float = 5.0,
        min_baseline: int | None = None,
    ) -> None:
        self.jump = jump
        self.mad_factor = mad_factor
        self.warmup = warmup
        self.min_baseline = min(window, 5) if min_baseline is None else min_baseline
        self._seen = 0
        self._base: deque[float] = deque(maxlen=window)
        self._recent: deque[float] = deque(maxlen=sustain)
        self._shifted = False

    def update(self, value: float) -> Shift | None:
        """Add one value; returns the :class:`Shift` when the recent window stands out, else ``None``."""
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        if len(self._recent) == self._recent.maxlen:
            leaving = self._recent[0]
            if not self._shifted:
                self._base.append(leaving)
        self._recent.append(value)
        if len(self._recent) < self._recent.maxlen or len(self._base) < self.min_baseline:
            return None
        base = statistics.median(self._base)
        mad = statistics.median(abs(v - base) for v in self._base)
        recent = statistics.median(self._recent)
        self._shifted = base > 0 and recent > self.jump * base and recent > base + self.mad_factor * MAD_TO_STD * mad
        return Shift(recent, base, mad) if self._shifted else None
