"""The progress bar the examples use: the one Lightning would pick, with ``v_num`` shown as an integer."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


class _RichBar(RichProgressBar):
    """Lightning's rich bar formats every non-string metric with ``".3f"``, the logger's integer
    version included (``v_num: 0.000``); handed over as a string it reads ``v_num: 0``."""

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict:
        items = super().get_metrics(trainer, pl_module)
        if isinstance(items.get("v_num"), int):
            items["v_num"] = str(items["v_num"])
        return items


def progress_bar() -> RichProgressBar | TQDMProgressBar:
    """Rich if it is installed, else tqdm (as Lightning chooses), with ``v_num`` unmangled."""
    try:
        return _RichBar()
    except ModuleNotFoundError:  # rich is not installed
        return TQDMProgressBar()
