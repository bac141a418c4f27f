"""Pipeline telemetry: ``model`` (a pure model of a schedule: orders, bubbles, replay),
``recorder`` (timing a running schedule), ``callback`` (``PipelineTelemetry``, the Lightning
callback) and ``render`` (text grid, Chrome trace, PNG timeline). ``model`` and ``render`` start
no process; nothing here imports the recorder from the renderer or back."""

from lightning_hpp.telemetry.callback import PipelineTelemetry

__all__ = ["PipelineTelemetry"]
