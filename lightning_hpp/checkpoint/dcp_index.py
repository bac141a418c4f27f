"""torch.distributed.checkpoint's shard index (``.metadata``), read without running a pickle.

Loading reads only tensors (``torch.load(weights_only=True)``) and JSON. The index file that
torch.distributed.checkpoint pickles (``.metadata``) is read with an unpickler that admits only
its own record classes; a checkpoint holding any other pickled object is refused with
:class:`~lightning_hpp.errors.CheckpointError`.

:class:`IndexedReader` and :class:`NoBytesLoadPlanner` are the reader and planner every load hands
to torch.distributed.checkpoint: the reader is given the index already read safely, the planner
refuses a pickled entry.
"""

from __future__ import annotations

import io
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from lightning_hpp._dist import initialized
from lightning_hpp.checkpoint.entries import JSON_LEAF, parse_key
from lightning_hpp.checkpoint.retry import RetryPolicy
from lightning_hpp.checkpoint.storage import filesystem, storage_options
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError

DCP_INDEX = ".metadata"
"""The file name of torch.distributed.checkpoint's index in a checkpoint directory."""


def quiet_single_process() -> None:
    """Silence torch's warning on a single-process save or load (a supported, deliberate case here).

    Installed at each call, since test runners and Lightning reset warning filters.
    """
    if not initialized():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


class IndexedReader(FsspecReader):
    """fsspec reader that never unpickles: it is handed the index already read safely."""

    def __init__(self, url: str, metadata: Metadata, retry: RetryPolicy) -> None:
        super().__init__(url, **storage_options(url, retry))
        self.fs.fs, _ = filesystem(url, retry)  # the configured filesystem, retries included
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class NoBytesLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"entry {read_item.dest_index.fqn!r} is a pickled Python object; loading refuses pickles."
        )


# ---------------------------------------------------------------------------- safe index read

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    # torch's local writer records the checkpoint path as a Path object; building one runs no code
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _IndexUnpickler(pickle.Unpickler):
    """Unpickler for torch.distributed.checkpoint's ``.metadata``: its record classes only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedGlobal(f"{module}.{name}")


def read_index(url: str, retry: RetryPolicy | None = None) -> Metadata:
    """The shard index of the checkpoint at ``url``, unpickled with its record classes only."""
    fs, path = filesystem(url, retry)
    target = f"{path.rstrip('/')}/{DCP_INDEX}"
    try:
        raw = (retry or RetryPolicy()).call(lambda: fs.cat_file(target), what=f"reading the shard index of {url!r}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{url!r} has no {DCP_INDEX} (the shard index).") from None
    try:
        metadata = _IndexUnpickler(io.BytesIO(raw)).load()
    except _RefusedGlobal as exc:
        raise CheckpointError(
            f"{url!r}: its shard index {DCP_INDEX} contains a pickled reference to {exc}, which "
            f"could run code when loaded, so the checkpoint is refused. Only checkpoints written by "
            f"`save_sharded` (tensors and JSON) are loaded."
        ) from None
    except Exception as exc:
        raise CorruptCheckpointError(f"{url!r}: its shard index {DCP_INDEX} is unreadable ({exc}).") from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{url!r}: its shard index holds a {type(metadata).__name__}, not an index.")
    return metadata


@dataclass(frozen=True)
class KeyInfo:
    """One saved entry.

    Attributes:
        kind: ``"tensor"`` or ``"json"``.
        shape: Tensor shape (for JSON: the encoded length in bytes).
        dtype: Tensor dtype (``torch.uint8`` for JSON).
    """

    kind: Literal["tensor", "json"]
    shape: tuple[int, ...]
    dtype: torch.dtype


def entry_index(metadata: Metadata, url: str) -> dict[str, KeyInfo]:
    """Every entry of an index by name, refusing one stored as pickled bytes."""
    index = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise CheckpointError(
                f"{url!r} stores {fqn!r} as a pickled Python object; loading refuses pickles (they "
                f"can run code). Re-save it with `save_sharded`, which stores such values as JSON."
            )
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{url!r}: entry {fqn!r} has unknown index type {type(md).__name__}.")
        kind = "json" if fqn.endswith("/" + JSON_LEAF) or fqn == JSON_LEAF else "tensor"
        index[fqn] = KeyInfo(kind, tuple(md.size), md.properties.dtype)
    return index


def checkpoint_keys(url: str) -> dict[tuple[Any, ...], KeyInfo]:
    """What the checkpoint at ``url`` holds: key path -> :class:`KeyInfo`.

    Example: ``("model", "encoder.0.weight") -> KeyInfo("tensor", (16, 8), torch.float32)``;
    ``("loops",) -> KeyInfo("json", ...)`` for a JSON value stored whole.
    """
    return {parse_key(fqn): info for fqn, info in entry_index(read_index(url), url).items()}
