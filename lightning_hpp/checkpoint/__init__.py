"""Sharded, resumable checkpoints on any fsspec URL (local disk, ``file://``, ``s3://``...).

* :func:`save_sharded` / :func:`load_sharded`: each rank writes and reads only its own part of
  the state, through torch.distributed.checkpoint; keys are parameter names, so a checkpoint
  saved under one stage layout loads under another.
* :func:`list_checkpoints`, :func:`latest_valid`, :func:`verify`: a checkpoint counts once its
  ``metadata.json`` is written (last); incomplete or corrupt ones are skipped with a warning.
* :mod:`~lightning_hpp.checkpoint.resume`: where a fit starts, decided once for every rank; damage
  found by any rank while verifying (sha256, shared between the ranks) or loading falls back to the
  next valid checkpoint and moves the damaged one to ``<root>/corrupt/``.
* :class:`Retention`: keep the last k and the best k, never the one resumed from or the newest
  valid one; a checkpoint it cannot verify is moved to ``corrupt/``, never deleted.
* :func:`export_to_lightning_ckpt`: one plain Lightning ``.ckpt`` for inference, every name of a tied
  tensor in it; :func:`export_to_pretrained`: the transformers model inside, in ``save_pretrained``
  format, written one tensor at a time.
* :mod:`~lightning_hpp.checkpoint.directory_guard` (installed on import): a checkpoint directory handed to
  ``torch.load`` or ``load_from_checkpoint`` fails with the export command to run.
"""

from __future__ import annotations

from lightning_hpp.checkpoint import directory_guard
from lightning_hpp.checkpoint.checksums import verify
from lightning_hpp.checkpoint.commit import FORMAT_VERSION, METADATA_FILE, CheckpointInfo
from lightning_hpp.checkpoint.dcp_index import KeyInfo, checkpoint_keys
from lightning_hpp.checkpoint.discovery import latest_valid, list_checkpoints
from lightning_hpp.checkpoint.load import load_sharded
from lightning_hpp.checkpoint.retention import Retention
from lightning_hpp.checkpoint.retry import RetryPolicy, StorageFailure, is_transient
from lightning_hpp.checkpoint.s3 import s3_storage_options
from lightning_hpp.checkpoint.save import PendingSave, save_sharded, wait_for_pending_save
from lightning_hpp.checkpoint.storage import checkpoint_url
from lightning_hpp.checkpoint.warning import CheckpointWarning
from lightning_hpp.errors import (
    CheckpointError,
    CheckpointSaveError,
    CorruptCheckpointError,
    S3ConfigError,
    ShardedCheckpointError,
)
from lightning_hpp.redaction import redact

directory_guard.install()

__all__ = [
    "FORMAT_VERSION",
    "METADATA_FILE",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointSaveError",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "KeyInfo",
    "PendingSave",
    "Retention",
    "RetryPolicy",
    "S3ConfigError",
    "ShardedCheckpointError",
    "StorageFailure",
    "checkpoint_keys",
    "checkpoint_url",
    "export_to_lightning_ckpt",
    "export_to_pretrained",
    "is_transient",
    "latest_valid",
    "list_checkpoints",
    "load_sharded",
    "redact",
    "s3_storage_options",
    "save_sharded",
    "verify",
    "wait_for_pending_save",
]


def __getattr__(name: str):
    # imported lazily so that `python -m lightning_hpp.checkpoint.export` runs without a warning
    if name == "export_to_lightning_ckpt":
        from lightning_hpp.checkpoint.export import export_to_lightning_ckpt

        return export_to_lightning_ckpt
    if name == "export_to_pretrained":
        from lightning_hpp.checkpoint.pretrained import export_to_pretrained

        return export_to_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
