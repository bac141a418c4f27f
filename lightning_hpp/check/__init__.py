"""Checking a LightningModule under HPPStrategy against Lightning's own strategy, rank by rank.

``lightning-hpp-check`` (:mod:`lightning_hpp.check.cli`) or :func:`check` runs the user's module for a few steps
under Lightning's DDP (one process per replica: one process for pp=2, two for pp=2 × dp=2) and under HPPStrategy,
and reports every difference on every rank: losses, parameters, logged and callback metrics, hook calls and their
arguments, the files loggers and checkpoint callbacks wrote. The conformance suite runs on the same machinery
(:mod:`.hooks`, :mod:`.compare`).
"""

from lightning_hpp.check.record import CheckRecorder
from lightning_hpp.check.run import LAYOUTS, Report, Target, check

__all__ = ["LAYOUTS", "CheckRecorder", "Report", "Target", "check"]
