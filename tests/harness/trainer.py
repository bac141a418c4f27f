"""The quiet Trainer of the tests: the keyword arguments every test and worker Trainer repeats, in one place.

No progress bar, no model summary, and no logger or checkpointing unless asked, on the CPU accelerator; every other
keyword argument goes to ``lightning.Trainer`` as given (and may override these)."""

from __future__ import annotations

from typing import Any

QUIET = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def quiet_trainer(**kwargs: Any):
    """``lightning.Trainer(**QUIET, **kwargs)``: ``kwargs`` win over :data:`QUIET`."""
    import lightning as L

    return L.Trainer(**quiet_kwargs(**kwargs))


def quiet_kwargs(**kwargs: Any) -> dict[str, Any]:
    """:data:`QUIET` updated with ``kwargs``: for the Trainers built by a helper that takes keyword arguments."""
    return {**QUIET, **kwargs}
