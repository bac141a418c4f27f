"""The domain errors of lightning_hpp, in one place.

Every error a user can cause is a ``ValueError`` subclass (``CheckpointSaveError`` and
``NonFiniteError`` report run-time failures instead); each message names the value, the context
and the fix. The layers raise these and import nothing else from each other for them.
"""

from __future__ import annotations


# ---- plans, schedules and placement
class PlanError(ValueError):
    """A stage plan that cannot be used: the message names the value, the context and the fix."""


class ScheduleError(PlanError):
    """A schedule that cannot run with the requested stages, ranks and micro-batches."""


class MicroBatchError(PlanError):
    """A batch that cannot be split into the requested number of micro-batches."""


class SequentialForwardError(PlanError):
    """``forward`` is not the units applied in order, so the model cannot be cut into stages."""


class TraceError(PlanError):
    """``torch.export`` cannot capture the model, so the traced frontend cannot cut it."""


class ShapeError(PlanError):
    """A batch whose shapes the pipeline cannot take (a dimension the model fixes, shapes that differ
    between the micro-batches of one batch): the message names the dimension, both shapes and the fix."""


class PartitionError(ValueError):
    """No valid partition: impossible memory limits, missing devices or costs, bad arguments."""


class ShardingError(PlanError):
    """A sharding layout (``ShardingOptions``) that cannot run on this job or with these stages."""


class PlacementError(ValueError):
    """Stages cannot be placed on the ranks (kinds absent or too few, or a bad device map)."""


class ProfileError(ValueError):
    """A profile that cannot be used or measured (bad file, unsupported precision, bad input)."""


class ProfileMismatchError(ProfileError):
    """A profile whose units do not match the model's units."""


# ---- precision
class NonFiniteError(FloatingPointError):
    """A NaN or Inf crossed a stage boundary."""


class FP8Error(ValueError):
    """An fp8 request that cannot be honoured: the message names the value, the context and the fix."""


# ---- checkpoints and storage
class CheckpointError(ValueError):
    """A checkpoint request that cannot be honoured: the message gives the value, context and fix."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint directory that is incomplete or does not match its ``metadata.json``."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """A checkpoint directory without ``metadata.json``: a save that did not finish (or lost it)."""


class ShardedCheckpointError(CheckpointError, IsADirectoryError):
    """A sharded checkpoint directory handed to a loader of one file (``torch.load``, ``load_from_checkpoint``);
    an ``IsADirectoryError`` too, the error those loaders raised before, so code catching it still does."""


class CheckpointSaveError(RuntimeError):
    """A save that failed after its retries; every earlier checkpoint is left as it was."""


class S3ConfigError(ValueError):
    """An S3 setting in the environment that cannot be used."""


# ---- coded bias
class BiasConfigError(ValueError):
    """An invalid option given to a coded-bias guard (a policy, a threshold, a rank)."""


class FingerprintMismatchError(ValueError):
    """Ranks (or a resumed run and its checkpoint) run in different environments."""


class SamplerError(ValueError):
    """A sampler configured with values that cannot work; the message names the value and the fix."""


class CodedBiasError(ValueError):
    """The audit found coded bias and the policy is ``"error"``."""


# ---- telemetry and the hydra entry point
class TelemetryError(ValueError):
    """Telemetry asked for something it cannot do: the message names the value, the context and the fix."""


class SweepError(ValueError):
    """A sweep that produced nothing to summarise, or a summary option that is not valid."""


class TrainConfigError(ValueError):
    """A configuration the entry point cannot run; the message names the key, the value and the fix."""


# ---- the job's processes
class RankFailedError(RuntimeError):
    """Another rank of the job failed first; the message names it and repeats its exception."""


class TransferError(RuntimeError):
    """A pipeline send or receive failed or timed out; the message names both ranks and their stages."""
