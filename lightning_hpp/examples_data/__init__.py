"""Data sets that ship inside installed packages, for the examples (no downloads)."""

from __future__ import annotations

from lightning_hpp.examples_data.digits import DigitsDataError, DigitsDataModule

__all__ = ["DigitsDataError", "DigitsDataModule"]
