"""The warning every checkpoint operation emits: skipped checkpoints, retried or abandoned saves.

One class and one function, so that every module of the package warns the same way: the message
redacted (:func:`~lightning_hpp.redaction.redact`), logged, and raised as a :class:`CheckpointWarning`
(Python's warning filters and ``pytest.warns`` see it).
"""

from __future__ import annotations

import logging
import warnings

from lightning_hpp.redaction import redact

log = logging.getLogger(__name__)


class CheckpointWarning(UserWarning):
    """Skipped checkpoints, retried or abandoned saves."""


def warn_checkpoint(message: str) -> None:
    """Log ``message`` (secrets redacted) and emit it as a :class:`CheckpointWarning` at the caller's caller."""
    message = redact(message)
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=3)
