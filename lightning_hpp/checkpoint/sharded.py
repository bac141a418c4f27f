"""Sharded save and load of a training state with torch.distributed.checkpoint over fsspec.

Every rank passes the part of the state it holds: a nested dict whose model and optimizer keys
are the LightningModule's own parameter names. Ranks that hold the same key (data-parallel
replicas) must hold the same value; torch.distributed.checkpoint writes it once. Because keys are
names, not positions, a checkpoint saved under one stage layout loads under any other: each rank
of the new layout simply asks for the keys it now holds.

A sharded stage's tensors are ``DTensor`` s (FSDP2 shards over the data-parallel ranks, tensor
parallel splits): each rank writes its own shards, and the index records each shard's offset in
the whole tensor, under the same name as an unsharded tensor. A rank asking for a tensor gets the
part its template covers: a ``DTensor`` template reads only its own shard (from whichever saved
shards overlap it), a plain one the whole tensor. So a checkpoint moves between unsharded, FSDP2,
HSDP and tensor-parallel stages, and between pipeline cuts, with nothing gathered on any rank.

What is stored, and how (never a pickle):

* tensors, as they are (one torch.distributed.checkpoint entry each);
* everything else (loop progress, RNG states, callback states, plan, config, hyper-parameters)
  as JSON, in a uint8 tensor. JSON here also carries tuples, dicts with non-string keys and
  numpy arrays (``numpy.random.get_state()``), so RNG states round-trip exactly.

A container (dict, list, tuple) that holds a tensor anywhere inside is split into its entries;
one that holds none is stored as a single JSON value. Entry names are the path of keys joined
with ``/`` (``model/encoder.0.weight``; see :func:`checkpoint_keys`).

Loading reads only tensors (``torch.load(weights_only=True)``) and JSON. The index file that
torch.distributed.checkpoint pickles (``.metadata``) is read with an unpickler that admits only
its own record classes; a checkpoint holding any other pickled object is refused with
:class:`~lightning_hpp.errors.CheckpointError`.

A pickle can also hide in a tensor's bytes: a module's ``get_extra_state`` (the ``_extra_state``
entry of its ``state_dict``) may return one, as Transformer Engine's does, and its
``set_extra_state`` unpickles it when loaded. Saving such an entry is refused here
(:func:`holds_pickle` parses the bytes with ``pickletools``, which runs nothing); loading one into
a module is refused where the module's state is rebuilt
(:func:`~lightning_hpp.checkpoint.lightning_state.from_sharded`). Transformer Engine's fp8 state is
saved as tensors and JSON instead (:mod:`~lightning_hpp.checkpoint.fp8_state`).

Saving follows this package's commit protocol inside torch.distributed.checkpoint's own steps
(:class:`_Writer`): the coordinator un-commits an older save of the step before any rank writes,
every rank hashes the files it writes, and the coordinator writes ``metadata.json`` (every file's
size and sha256: the commit) once the index is written. ``async_save=True`` is
:func:`torch.distributed.checkpoint.async_save` with a staging step (a CPU copy taken before it
returns) and the same writer, on a gloo group of its own.

Retries: every file is read and written through
:func:`~lightning_hpp.checkpoint.store.filesystem`, so on ``s3://`` botocore retries each request;
elsewhere each step of a save (the target directory, this rank's files, the index, the commit) is
retried on its own by the rank that does it, and a load that fails transiently is re-run whole by
:meth:`~lightning_hpp.checkpoint.store.RetryPolicy.call` (see the store module's docstring).
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import pickle
import pickletools
import threading
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import quote, unquote

import fsspec
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult

from lightning_hpp._dist import all_gather_object, initialized, new_group
from lightning_hpp.checkpoint.store import (
    METADATA_FILE,
    CheckpointInfo,
    Retention,
    RetryPolicy,
    StorageFailure,
    _warn,
    build_metadata,
    filesystem,
    read_metadata,
    remove_metadata,
    storage_options,
    write_metadata,
)
from lightning_hpp.errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from lightning_hpp.redaction import redact
from lightning_hpp.validation import check_choice, check_int, check_path, is_int

log = logging.getLogger(__name__)

T = TypeVar("T")

_JSON = "@json"  # last path component of a JSON entry; '@' never survives quote()
EXTRA_STATE = "_extra_state"  # torch's state_dict name (last part) for what `get_extra_state()` returns
_DCP_INDEX = ".metadata"
_TAGS = ("__tuple__", "__items__", "__ndarray__", "__dtype__")


def _quiet_single_process() -> None:
    # torch warns on every single-process save/load; one process is a supported, deliberate case
    # here. Installed at each call, since test runners and Lightning reset warning filters.
    if not initialized():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")

# ============================================================================ paths of entries


def _component(key: Any, container: Any, where: str) -> str:
    if isinstance(container, dict):
        if isinstance(key, str):
            return quote(key, safe="") if key else "''"
        if is_int(key):
            return f"#{key}"
        raise CheckpointError(
            f"state{where} has the key {key!r} ({type(key).__name__}) next to tensors; dicts that "
            f"hold tensors must have str or int keys. Rename the key."
        )
    if isinstance(container, list):
        return f"[{key}]"
    return f"({key})"


def _parse_component(comp: str) -> tuple[str, Any]:
    if comp == "''":
        return "dict", ""
    if comp.startswith("#"):
        return "dict", int(comp[1:])
    if comp.startswith("["):
        return "list", int(comp[1:-1])
    if comp.startswith("("):
        return "tuple", int(comp[1:-1])
    return "dict", unquote(comp)


def parse_key(fqn: str) -> tuple[Any, ...]:
    """The path of keys (str or int) behind an entry name such as ``"model/encoder.0.weight"``."""
    comps = fqn.split("/")
    if comps[-1] == _JSON:
        comps = comps[:-1]
    return tuple(_parse_component(c)[1] for c in comps)


def _join(path: str, comp: str) -> str:
    return f"{path}/{comp}" if path else comp


# ============================================================================ JSON values


def _to_json(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OV":
            raise CheckpointError(f"state{where} is a numpy array of {value.dtype}; only numeric arrays are saved.")
        return {"__ndarray__": {"dtype": value.dtype.str, "shape": list(value.shape), "data": value.ravel().tolist()}}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
            return {k: _to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"__items__": [[_to_json(k, f"{where} key"), _to_json(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise CheckpointError(
        f"state{where} is a {type(value).__module__}.{type(value).__qualname__} ({_short(value)}); "
        f"checkpoints hold only tensors and JSON values (dict, list, tuple, str, int, float, bool, "
        f"None, numpy arrays), never pickled objects. Convert it (for example to a dict of plain "
        f"values, or its `state_dict()`) before saving."
    )


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, payload),) = value.items()
        if tag == "__tuple__":
            return tuple(_from_json(v) for v in payload)
        if tag == "__items__":
            return {_from_json(k): _from_json(v) for k, v in payload}
        if tag == "__ndarray__":
            dtype = np.dtype(payload["dtype"])
            if dtype.kind in "OV":
                raise CorruptCheckpointError(f"a JSON entry declares a numpy array of {dtype}, which is never saved.")
            return np.array(payload["data"], dtype=dtype).reshape(payload["shape"])
        if tag == "__dtype__":
            dtype = getattr(torch, str(payload), None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"a JSON entry names the unknown torch dtype {payload!r}.")
            return dtype
    return {k: _from_json(v) for k, v in value.items()}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ============================================================================ flattening


def _holds_tensor(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensor(v) for v in node)
    return False


def flatten_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """Split a nested state into named tensors and named JSON documents (secrets redacted).

    Args:
        state: Dict with str keys; values nest dicts, lists and tuples of tensors and JSON values.

    Returns:
        ``(tensors, documents)``, both keyed by entry name.

    Raises:
        CheckpointError: a value that is neither a tensor nor JSON-representable (it would need
            pickle), or a non-str/int key next to tensors.
    """
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(
            f"the state to save must be a dict with str keys, got {type(state).__name__} "
            f"{_short(list(state) if isinstance(state, dict) else state)}."
        )
    tensors: dict[str, torch.Tensor] = {}
    docs: dict[str, bytes] = {}

    def walk(node: Any, path: str, where: str) -> None:
        if isinstance(node, torch.Tensor):
            if is_extra_state(unquote(path.rsplit("/", 1)[-1])) and holds_pickle(node):
                raise CheckpointError(
                    f"state{where} is a pickle in a {node.dtype} tensor (what a module's `get_extra_state` "
                    f"returned); checkpoints never hold pickles, since loading one runs code. Return tensors or "
                    f"JSON values from `get_extra_state` (Transformer Engine modules are saved as tensors under "
                    f"'fp8/' by HPPStrategy), or leave that module out of the state."
                )
            tensors[path] = node
        elif isinstance(node, (dict, list, tuple)) and _holds_tensor(node):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in items:
                walk(value, _join(path, _component(key, node, where)), f"{where}[{key!r}]")
        else:
            encoded = _to_json(redact(node), where)
            docs[_join(path, _JSON)] = json.dumps(encoded, allow_nan=True, separators=(",", ":")).encode()

    for key, value in state.items():
        walk(value, _component(key, state, ""), f"[{key!r}]")
    return tensors, docs


# ============================================================================ pickles in bytes


def is_extra_state(name: str) -> bool:
    """Whether a ``state_dict`` name is a module's ``get_extra_state()`` entry (``"layers.2._extra_state"``)."""
    return name == EXTRA_STATE or name.endswith("." + EXTRA_STATE)


def holds_pickle(value: Any) -> bool:
    """Whether ``value`` (a 1-d uint8/int8 tensor, or bytes) is a pickle: bytes that begin with a
    complete pickle stream of any protocol (what ``pickle.loads`` would run; it ignores what follows
    the stream), or a ``torch.save`` archive (a zip holding a ``.pkl``).

    The bytes are parsed with ``pickletools.genops``, which reads opcodes and runs none of them.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.uint8, torch.int8) or value.dim() != 1 or value.numel() == 0:
            return False
        data = value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    else:
        return False
    if not data:
        return False
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                return any(name.endswith(".pkl") for name in archive.namelist())
        except (zipfile.BadZipFile, ValueError):
            return False
    last = None
    try:
        for opcode, _, _ in pickletools.genops(data):
            last = opcode.name
    except Exception:  # noqa: BLE001 - bytes that are not opcodes up to a STOP: not a pickle
        return False
    return last == "STOP"


def pickle_refused(key: str, url: str) -> CheckpointError:
    """The error for a pickle found on load at ``key`` (an ``_extra_state`` entry) of the checkpoint ``url``."""
    return CheckpointError(
        f"{url!r}: entry {key!r} holds a pickle (the format of Transformer Engine's `get_extra_state`, or "
        f"another object pickled into bytes); loading refuses pickles, since unpickling runs code, and it "
        f"was not unpickled. Fix: resume from a checkpoint written by this version of lightning_hpp, which "
        f"saves fp8 scaling state as tensors under 'fp8/', or take only the weights with "
        f"`load_stage_weights(module, {url!r})`, which never reads `_extra_state` (the fp8 scaling then "
        f"starts afresh)."
    )


# ============================================================================ storage adapters


class _HashingStream:
    """Write-through wrapper that counts bytes and computes sha256 of what passes."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        self._raw.write(data)
        return view.nbytes

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        # callers fsync this descriptor: push Python-level buffers to the OS first
        self._raw.flush()
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()


class _HashingFileSystem(_FsspecFileSystem):
    """torch.distributed.checkpoint's fsspec adapter, recording size and sha256 of each file."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        super().__init__()
        self.fs = fs
        self.files: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: Any, mode: str):  # type: ignore[override]
        if not any(ch in mode for ch in "wa+"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            hashing = _HashingStream(raw)
            yield hashing
        # the with-block closed the file: for object stores the upload is complete here
        with self._lock:
            self.files[_basename(path)] = (hashing.size, hashing.sha256.hexdigest())

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        with self._lock:
            if _basename(path) in self.files:
                self.files[_basename(new_path)] = self.files.pop(_basename(path))


def _basename(path: Any) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


class _Reader(FsspecReader):
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


class _NoBytesLoadPlanner(DefaultLoadPlanner):
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


def _read_index(url: str, retry: RetryPolicy | None = None) -> Metadata:
    fs, path = filesystem(url, retry)
    target = f"{path.rstrip('/')}/{_DCP_INDEX}"
    try:
        raw = (retry or RetryPolicy()).call(lambda: fs.cat_file(target), what=f"reading the shard index of {url!r}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{url!r} has no {_DCP_INDEX} (the shard index).") from None
    try:
        metadata = _IndexUnpickler(io.BytesIO(raw)).load()
    except _RefusedGlobal as exc:
        raise CheckpointError(
            f"{url!r}: its shard index {_DCP_INDEX} contains a pickled reference to {exc}, which "
            f"could run code when loaded, so the checkpoint is refused. Only checkpoints written by "
            f"`save_sharded` (tensors and JSON) are loaded."
        ) from None
    except Exception as exc:
        raise CorruptCheckpointError(f"{url!r}: its shard index {_DCP_INDEX} is unreadable ({exc}).") from None
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


def _index(metadata: Metadata, url: str) -> dict[str, KeyInfo]:
    index = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise CheckpointError(
                f"{url!r} stores {fqn!r} as a pickled Python object; loading refuses pickles (they "
                f"can run code). Re-save it with `save_sharded`, which stores such values as JSON."
            )
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{url!r}: entry {fqn!r} has unknown index type {type(md).__name__}.")
        kind = "json" if fqn.endswith("/" + _JSON) or fqn == _JSON else "tensor"
        index[fqn] = KeyInfo(kind, tuple(md.size), md.properties.dtype)
    return index


def checkpoint_keys(url: str) -> dict[tuple[Any, ...], KeyInfo]:
    """What the checkpoint at ``url`` holds: key path -> :class:`KeyInfo`.

    Example: ``("model", "encoder.0.weight") -> KeyInfo("tensor", (16, 8), torch.float32)``;
    ``("loops",) -> KeyInfo("json", ...)`` for a JSON value stored whole.
    """
    return {parse_key(fqn): info for fqn, info in _index(_read_index(url), url).items()}


# ============================================================================ process groups


def _rank(group: Any) -> int:
    return dist.get_rank(group) if initialized() else 0


def _world(group: Any) -> int:
    return dist.get_world_size(group) if initialized() else 1


def _agree(error: BaseException | None, group: Any, what: str, exc_type: type = CheckpointError) -> None:
    """Raise on every rank if any rank failed ``what`` (so no rank waits in a collective)."""
    report = None
    if error is not None:
        report = (f"{type(error).__name__}: {redact(str(error))}", isinstance(error, CorruptCheckpointError))
    reports = all_gather_object(report, group)
    if error is not None:
        raise error
    for rank, entry in enumerate(reports):
        if entry is not None:
            message, corrupt = entry
            # damage stays damage on every rank, so that callers can fall back to another checkpoint
            raise (CorruptCheckpointError if corrupt and exc_type is CheckpointError else exc_type)(
                f"rank {rank} failed {what}: {message}"
            )


_ASYNC_GROUPS: dict[tuple[int, ...], Any] = {}


def _async_group(group: Any) -> Any:
    """A gloo group of the same ranks, for collectives of saves running in the background.

    Created on first use; ``dist.new_group`` is collective over the whole world, so every rank
    must make its first asynchronous save at the same point.
    """
    if not initialized():
        return None
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if ranks not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[ranks] = new_group(list(ranks), backend="gloo")  # with the job's timeout
    return _ASYNC_GROUPS[ranks]


def _failure(exc: CheckpointException) -> StorageFailure:
    errors = [pair[0] for pair in exc.failures.values()]
    lines = [f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in exc.failures.items()]
    return StorageFailure(redact("; ".join(lines)), errors)


# ============================================================================ save

_FILE_RECORD = "@file"  # index name of the write results that carry one written file's size and sha256


class _Writer(FsspecWriter):
    """torch.distributed.checkpoint's fsspec writer, carrying this package's commit protocol.

    torch.distributed.checkpoint calls it in this order, so the protocol needs no collective of
    its own, and runs the same in :func:`torch.distributed.checkpoint.save` and in ``async_save``'s
    background thread:

    * ``prepare_local_plan``: the target directory is made; on the coordinator (rank 0 of the
      group), whose plan is gathered before any rank may write, an older save of this step is
      un-committed first (its ``metadata.json`` and ``.metadata`` removed), so that it never stays
      committed while its files are replaced;
    * ``write_data``, on every rank: its own files, hashed while written and retried whole (they
      are this rank's alone); their names, sizes and sha256 travel to the coordinator beside the
      write results (as records under :data:`_FILE_RECORD`, taken out again before the index is
      written);
    * ``finish``, on the coordinator, once every rank has written: ``.metadata`` (the shard index),
      then ``metadata.json`` with every file's checksum (the commit), then ``retention``.

    Each step retries transient errors with ``retry.for_url(url)`` (on ``s3://`` botocore
    retries each request instead) and fails with :class:`CheckpointSaveError` naming the step.
    """

    def __init__(self, url: str, step: int, extra_metadata: dict[str, Any], retry: RetryPolicy,
                 retention: Retention | None, protect: tuple[str, ...]) -> None:
        fs, _ = filesystem(url, retry)
        local = isinstance(fs, fsspec.implementations.local.LocalFileSystem)
        # fsync is meaningless for object stores (and falls back to a host-wide sync())
        super().__init__(url, sync_files=local, overwrite=True, **storage_options(url, retry))
        self.fs = _HashingFileSystem(fs)  # the configured filesystem, retries included
        self.url, self.step, self.extra_metadata, self.retry = url, step, extra_metadata, retry
        self.retention, self.protect = retention, protect
        self.coordinator = False
        self.committed: dict[str, Any] | None = None  # metadata.json as written (coordinator)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.coordinator = is_coordinator

    def _metadata_exists(self) -> bool:
        return False  # an older save of this step is un-committed below, never "overwritten" with a warning

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.coordinator:
            self._step(self._uncommit, "clearing the target directory")
        return self._step(lambda: FsspecWriter.prepare_local_plan(self, plan), "preparing the target directory")

    def _uncommit(self) -> None:
        remove_metadata(self.url, retry=self.retry)
        fs, path = filesystem(self.url, self.retry)
        try:
            fs.rm_file(f"{path.rstrip('/')}/{_DCP_INDEX}")
        except FileNotFoundError:
            pass

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        def attempt() -> list[WriteResult]:
            self.fs.files.clear()
            return FsspecWriter.write_data(self, plan, planner).value()

        results = self._step(attempt, "writing the shards")
        records = [WriteResult(index=MetadataIndex(_FILE_RECORD), size_in_bytes=size, storage_data=(name, sha))
                   for name, (size, sha) in self.fs.files.items()]
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results + records)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = [(wr.storage_data, wr.size_in_bytes) for rank in results for wr in rank if wr.index.fqn == _FILE_RECORD]
        writes = [[wr for wr in rank if wr.index.fqn != _FILE_RECORD] for rank in results]
        self.fs.files.clear()
        self._step(lambda: FsspecWriter.finish(self, metadata, writes), f"writing {_DCP_INDEX}")
        shards = [{"path": name, "size": size, "sha256": sha} for (name, sha), size in files]
        shards += [{"path": name, "size": size, "sha256": sha} for name, (size, sha) in self.fs.files.items()]
        meta = build_metadata(step=self.step, shards=shards, world_size=len(results), extra_metadata=self.extra_metadata)
        self._step(lambda: write_metadata(self.url, meta, retry=self.retry), f"writing {METADATA_FILE}")
        self.committed = meta
        if self.retention is not None:
            url = self.url.rstrip("/")
            root = url.rsplit("/", 1)[0] if "://" in url else os.path.dirname(url)
            try:
                deleted = self.retention.apply(root, protect=(*self.protect, self.url))
                if deleted:
                    log.info("retention deleted %s", deleted)
            except Exception as exc:  # retention must never fail a save that committed
                _warn(f"Retention on {root!r} failed ({type(exc).__name__}: {exc}); nothing else changed.")

    def _step(self, fn: Callable[[], T], what: str) -> T:
        tries = 0

        def attempt() -> T:
            nonlocal tries
            tries += 1
            return fn()

        try:
            return self.retry.for_url(self.url).call(attempt, what=f"{what} of {self.url!r}")
        except Exception as exc:
            raise CheckpointSaveError(redact(
                f"Saving checkpoint {self.url!r} (step {self.step}) failed while {what} "
                f"{self.retry.describe(self.url, tries)}: {type(exc).__name__}: {exc}. {_UNTOUCHED}"
            )) from exc

    def info(self) -> CheckpointInfo:
        """The committed checkpoint; ranks other than the coordinator read its ``metadata.json``."""
        meta = self.committed if self.committed is not None else read_metadata(self.url, retry=self.retry)
        return CheckpointInfo(url=self.url, step=self.step, metadata=meta)


_UNTOUCHED = ("Earlier checkpoints are untouched and this one is not committed. Check the storage (endpoint, "
              "credentials, free space), or pass on_error='warn' to keep training without this checkpoint.")


def _save_error(exc: CheckpointException, url: str, step: int, world: int) -> CheckpointSaveError:
    """One error for every rank of a failed save: the failing step's own message where a step of
    :class:`_Writer` failed (naming its rank), else what torch.distributed.checkpoint raised."""
    failures = sorted(exc.failures.items())
    for rank, (err, _) in failures:
        if isinstance(err, CheckpointSaveError):
            return CheckpointSaveError(f"rank {rank}: {err}" if world > 1 else str(err))
    lines = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in failures)
    return CheckpointSaveError(redact(f"Saving checkpoint {url!r} (step {step}) failed: {lines}. {_UNTOUCHED}"))


class PendingSave:
    """A save running in the background (``save_sharded(..., async_save=True)``).

    Attributes:
        url: Checkpoint being written.
        step: Its step.
    """

    def __init__(self, future: Future, writer: _Writer, on_error: str, world: int) -> None:
        self._future = future
        self._world = world
        self._writer = writer
        self.url = writer.url
        self.step = writer.step
        self._on_error = on_error
        self._warned = False
        self._info: CheckpointInfo | None = None
        self.reported = False  # result() has handed the outcome to the caller

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save to end, without raising what it failed with."""
        self._future.exception(timeout)

    def result(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save.

        Returns:
            The committed checkpoint, or ``None`` if it failed and ``on_error="warn"``.

        Raises:
            CheckpointSaveError: the save failed and ``on_error="raise"``.
        """
        try:
            self._future.result(timeout)
            if self._info is None:
                self._info = self._writer.info()
        except (CheckpointException, CheckpointSaveError) as exc:
            self.reported = True
            error = _save_error(exc, self.url, self.step, self._world) if isinstance(exc, CheckpointException) else exc
            if self._on_error == "raise":
                raise error from None
            if not self._warned:
                self._warned = True
                _warn(str(error))
            return None
        self.reported = True
        return self._info


_PENDING: PendingSave | None = None
_PENDING_LOCK = threading.Lock()


def wait_for_pending_save(timeout: float | None = None) -> CheckpointInfo | None:
    """Block until the save in flight (if any) finishes; see :meth:`PendingSave.result`.

    A failure that :meth:`PendingSave.result` already reported to its caller is not raised again.
    """
    global _PENDING
    with _PENDING_LOCK:
        pending, _PENDING = _PENDING, None
    if pending is None:
        return None
    if pending.reported:
        pending.wait(timeout)  # without raising twice
        return None
    return pending.result(timeout)


def _stager() -> DefaultStager:
    # the staging step of an asynchronous save: a private CPU copy of every tensor (DTensors: of
    # their local shards), taken before `async_save` returns, so that training may change the
    # originals while the copy is written; pinned where it is copied from a GPU
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def save_sharded(
    state: dict[str, Any],
    url: str,
    *,
    step: int,
    extra_metadata: dict[str, Any] | None = None,
    process_group: Any = None,
    async_save: bool = False,
    retry: RetryPolicy | None = None,
    on_error: Literal["raise", "warn"] = "raise",
    retention: Retention | None = None,
    protect: Iterable[str] = (),
) -> CheckpointInfo | PendingSave | None:
    """Save this rank's part of the training state as one checkpoint; collective over the group.

    Every rank of ``process_group`` calls it with the same ``url`` and ``step``. The checkpoint
    counts only once ``metadata.json`` is written, after every shard is complete. DTensors (the
    parameters and optimizer state of FSDP2 or tensor-parallel stages) are written as their local
    shards: no rank gathers a whole tensor.

    Args:
        state: This rank's state: a dict with str keys nesting dicts/lists/tuples of tensors
            and JSON values (see the module docstring). Keys present on several ranks must hold
            equal values (or be DTensors: each rank's shards).
        url: Checkpoint directory, normally ``checkpoint_url(root, step)``.
        step: Steps completed (stored in ``metadata.json``).
        extra_metadata: ``plan``, ``fingerprint``, ``metrics`` and any other JSON facts for
            ``metadata.json`` (only rank 0's copy is used; secrets are redacted).
        process_group: Group of ranks writing this checkpoint; default: the whole world.
        async_save: Stage the tensors (a CPU copy), return at once and write them with
            :func:`torch.distributed.checkpoint.async_save` in a background thread. At most one
            save is in flight: a new save first waits for the previous one.
        retry: Retries of transient storage errors (per request on S3, of each step of the save
            elsewhere); default ``RetryPolicy()``.
        on_error: ``"raise"``: a save that fails after its retries raises
            :class:`CheckpointSaveError`; ``"warn"``: it emits a :class:`CheckpointWarning` and
            returns ``None`` (training goes on).
        retention: Applied by rank 0 to ``url``'s parent after the commit.
        protect: Checkpoint URLs retention must never delete (the one the run resumed from).

    Returns:
        The :class:`CheckpointInfo` (every rank); a :class:`PendingSave` when ``async_save``;
        ``None`` if the save failed with ``on_error="warn"``.

    Raises:
        CheckpointError: a value that cannot be saved without pickle, or ranks holding different
            values under one key.
        CheckpointSaveError: storage failed after the retries (``on_error="raise"``).
    """
    global _PENDING
    check_choice(on_error, "save_sharded(on_error=...)", ("raise", "warn"), error=CheckpointError)
    url = check_path(url, "save_sharded(url=...)", error=CheckpointError, kind="a path or fsspec URL",
                     hint="For example 's3://bucket/run/step-10'.")
    check_int(step, "save_sharded(step=...)", minimum=0, error=CheckpointError,
              hint="Pass the number of optimizer steps completed.")
    group = process_group

    wait_for_pending_save()  # at most one save in flight, also against a synchronous save

    error: BaseException | None = None
    tensors: dict[str, torch.Tensor] = {}
    docs: dict[str, bytes] = {}
    try:
        tensors, docs = flatten_state(state)
    except CheckpointError as exc:
        error = exc
    _agree(error, group, "to prepare its state for saving")
    _check_replicas(tensors, docs, group)

    flat = dict(tensors)
    for fqn, data in docs.items():
        flat[fqn] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    writer = _Writer(url, step, copy.deepcopy(dict(extra_metadata or {})), retry or RetryPolicy(), retention,
                     tuple(str(p) for p in protect))
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    _quiet_single_process()
    if async_save:
        stager = _stager()
        future = dcp.async_save(flat, storage_writer=writer, planner=planner, process_group=_async_group(group),
                                async_stager=stager, no_dist=not initialized())
        future.add_done_callback(lambda _: stager.close())
        pending = PendingSave(future, writer, on_error, _world(group))
        with _PENDING_LOCK:
            _PENDING = pending
        return pending
    try:
        dcp.save(flat, storage_writer=writer, planner=planner, process_group=group, no_dist=not initialized())
        return writer.info()
    except CheckpointException as exc:
        failure = _save_error(exc, url, step, _world(group))
        if on_error == "raise":
            raise failure from None
        _warn(str(failure))
        return None


def _check_replicas(tensors: dict[str, torch.Tensor], docs: dict[str, bytes], group: Any) -> None:
    """Refuse keys that several ranks hold with different shapes, dtypes or JSON values."""
    if _world(group) == 1:
        return
    mine = {k: (tuple(t.shape), str(t.dtype)) for k, t in tensors.items()}
    mine.update({k: hashlib.sha1(d).hexdigest() for k, d in docs.items()})
    seen: dict[str, tuple[int, Any]] = {}
    for rank, sigs in enumerate(all_gather_object(mine, group)):
        for key, sig in sigs.items():
            if key in seen and seen[key][1] != sig:
                raise CheckpointError(
                    f"ranks {seen[key][0]} and {rank} both save {key!r} but with different "
                    f"{'values' if key.endswith(_JSON) else 'shapes or dtypes'} ({seen[key][1]} vs {sig}). "
                    f"Only replicas may share a key; key per-rank values by rank "
                    f"(for example state['rng'][f'rank{{rank}}'])."
                )
            seen.setdefault(key, (rank, sig))


# ============================================================================ load


class _JsonSlot:
    def __init__(self, fqn: str, buffer: torch.Tensor) -> None:
        self.fqn = fqn
        self.buffer = buffer

    def decode(self, url: str) -> Any:
        try:
            return _from_json(json.loads(self.buffer.numpy().tobytes()))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{url!r}: JSON entry {self.fqn!r} is unreadable ({exc}).") from None


class _Binder:
    """Matches a template state against the index: what to read, and into which tensors."""

    def __init__(self, index: dict[str, KeyInfo], url: str) -> None:
        self.index = index
        self.url = url
        self.requests: dict[str, torch.Tensor] = {}
        self.missing: list[str] = []
        self.mismatched: list[str] = []
        self.prefixes: set[str] = set()
        for fqn in index:
            parts = fqn.split("/")
            self.prefixes.update("/".join(parts[:i]) for i in range(1, len(parts)))

    def bind(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state``'s containers with placeholders bound; ``state`` is not modified."""
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointError(
                f"the state to load into must be a dict with str keys, got {type(state).__name__}."
            )
        bound = {key: self._bind(value, _component(key, state, "")) for key, value in state.items()}
        if self.missing or self.mismatched:
            raise CheckpointError(self._report())
        return bound

    def _bind(self, node: Any, path: str) -> Any:
        info = self.index.get(_join(path, _JSON))
        if info is not None:
            return self._slot(_join(path, _JSON), info)
        if isinstance(node, torch.Tensor):
            info = self.index.get(path)
            if info is None or info.kind != "tensor":
                self.missing.append(path)
            elif tuple(node.shape) != info.shape:
                self.mismatched.append(f"{path!r}: saved {list(info.shape)}, requested {list(node.shape)}")
            else:
                self.requests[path] = node
            return node
        if isinstance(node, dict) and node:
            items = [(k, self._bind(v, _join(path, _component(k, node, path)))) for k, v in node.items()]
            return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
        if isinstance(node, list) and node:
            return [self._bind(v, _join(path, f"[{i}]")) for i, v in enumerate(node)]
        if isinstance(node, tuple) and node:
            return tuple(self._bind(v, _join(path, f"({i})")) for i, v in enumerate(node))
        # a placeholder (None, a plain value, an empty container): take what was saved here
        info = self.index.get(path)
        if info is not None and info.kind == "tensor":
            return self._tensor(path, info)
        if path in self.prefixes:
            return self._rebuild(path)
        self.missing.append(path)
        return node

    def _slot(self, fqn: str, info: KeyInfo) -> _JsonSlot:
        buffer = torch.empty(info.shape, dtype=torch.uint8)
        self.requests[fqn] = buffer
        return _JsonSlot(fqn, buffer)

    def _tensor(self, fqn: str, info: KeyInfo) -> torch.Tensor:
        tensor = torch.empty(info.shape, dtype=info.dtype)
        self.requests[fqn] = tensor
        return tensor

    def _rebuild(self, path: str) -> Any:
        tree: dict[str, Any] = {}
        for fqn, info in self.index.items():
            if not fqn.startswith(path + "/"):
                continue
            comps = fqn[len(path) + 1 :].split("/")
            leaf: Any
            if comps[-1] == _JSON:
                comps, leaf = comps[:-1], self._slot(fqn, info)
            else:
                leaf = self._tensor(fqn, info)
            node = tree
            for comp in comps[:-1]:
                node = node.setdefault(comp, _Node())
            node[comps[-1]] = leaf
        return self._materialize(tree, path)

    def _materialize(self, node: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node
        parsed = [(_parse_component(c), v) for c, v in node.items()]
        kinds = {kind for (kind, _), _ in parsed}
        if len(kinds) != 1:
            raise CorruptCheckpointError(f"{self.url!r}: entries under {path!r} mix container kinds {sorted(kinds)}.")
        kind = kinds.pop()
        children = [(key, self._materialize(v, _join(path, str(key)))) for (_, key), v in parsed]
        if kind == "dict":
            return dict(children)
        ordered = [v for _, v in sorted(children, key=lambda kv: kv[0])]
        return ordered if kind == "list" else tuple(ordered)

    def _report(self) -> str:
        lines = []
        if self.missing:
            sample = sorted(self.index)[:6]
            lines.append(
                f"{self.url!r} has no entry for {len(self.missing)} requested key(s): "
                f"{self.missing[:8]}{' ...' if len(self.missing) > 8 else ''}. It holds for example "
                f"{sample}. Ask only for keys the checkpoint was saved with (see `checkpoint_keys`), or "
                f"put None in the state to take whatever was saved under a key."
            )
        if self.mismatched:
            lines.append(
                f"{self.url!r} holds tensors of other shapes than requested: {self.mismatched[:8]}. "
                f"The model's architecture differs from the one that was saved."
            )
        return " ".join(lines)


class _Node(dict):
    """Intermediate node while rebuilding a saved subtree."""


def _resolve(node: Any, url: str) -> Any:
    if isinstance(node, _JsonSlot):
        return node.decode(url)
    if isinstance(node, dict):
        for key in list(node):
            node[key] = _resolve(node[key], url)
        return node
    if isinstance(node, list):
        for i, value in enumerate(node):
            node[i] = _resolve(value, url)
        return node
    if isinstance(node, tuple):
        return tuple(_resolve(v, url) for v in node)
    return node


def load_sharded(
    url: str,
    state: dict[str, Any],
    process_group: Any = None,
    *,
    retry: RetryPolicy | None = None,
) -> dict[str, Any]:
    """Load the entries this rank asks for from a committed checkpoint; collective over the group.

    ``state`` is a template of what this rank holds, usually its live state: tensors are filled
    in place (so model parameters load directly), JSON values replace the template's values, and
    a ``None`` (or empty container) takes whatever was saved under that key, whole. A rank may ask
    for any subset of the saved keys: this is how a checkpoint saved under one stage layout loads
    under another. ``state``'s top-level entries are replaced by the loaded ones (nested
    containers are new objects; tensors are the template's own, filled). If the request cannot
    be met, ``state`` is left as it was.

    Args:
        url: A checkpoint directory (``<root>/step-<N>``) with ``metadata.json``.
        state: Template dict (str keys), updated in place.
        process_group: Group of ranks loading together; default: the whole world.
        retry: Retries of transient storage errors (per request on S3, of the whole load
            elsewhere); default ``RetryPolicy()``.

    Returns:
        ``state``, loaded.

    Raises:
        CheckpointError: not a committed checkpoint, keys it does not hold, shape mismatches, or
            pickled objects in it (refused, never unpickled).
        StorageFailure: storage failed after the retries.
    """
    retry = retry or RetryPolicy()
    whole = retry.for_url(url)  # one try on S3, where botocore retries each request
    error: BaseException | None = None
    binder: _Binder | None = None
    metadata: Metadata | None = None
    bound: dict[str, Any] = {}
    try:
        read_metadata(url, retry=retry)  # lookups retry by themselves
        metadata = _read_index(url, retry)
        binder = _Binder(_index(metadata, url), url)
        bound = binder.bind(state)
    except Exception as exc:
        error = exc
    _agree(error, process_group, f"to prepare loading {url!r}")
    assert binder is not None and metadata is not None

    def read() -> None:
        _quiet_single_process()
        try:
            dcp.load(
                binder.requests,
                storage_reader=_Reader(url, metadata, retry),
                planner=_NoBytesLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                process_group=process_group,
                no_dist=not initialized(),
            )
        except CheckpointException as exc:
            failure = _failure(exc)
            if any(isinstance(e, (pickle.UnpicklingError, CheckpointError)) for e in failure.errors):
                raise CheckpointError(
                    f"{url!r} holds data that is not a plain tensor (a pickled object); loading "
                    f"refuses it. Details: {failure}"
                ) from None
            raise failure from None

    if binder.requests or initialized():
        whole.call(read, what=f"reading the shards of {url!r}")
    state.update(_resolve(bound, url))
    return state
