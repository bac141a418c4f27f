"""Sharded load of a training state: :func:`load_sharded`, each rank reading the entries it asks for.

Keys are names, not positions, so a checkpoint saved under one stage layout loads under any other:
each rank of the new layout asks for the keys it now holds. A ``DTensor`` template reads only its own
shard (from whichever saved shards overlap it), a plain one the whole tensor, so a checkpoint moves
between unsharded, FSDP2, HSDP and tensor-parallel stages, and between pipeline cuts, with nothing
gathered on any rank. Only tensors and JSON are read; the index is read without running a pickle
(:mod:`~lightning_hpp.checkpoint.dcp_index`).
"""

from __future__ import annotations

import json
import pickle
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lightning_hpp._dist import initialized
from lightning_hpp.checkpoint.collective import agree, storage_failure
from lightning_hpp.checkpoint.commit import read_metadata
from lightning_hpp.checkpoint.dcp_index import (
    IndexedReader,
    KeyInfo,
    NoBytesLoadPlanner,
    entry_index,
    quiet_single_process,
    read_index,
)
from lightning_hpp.checkpoint.entries import JSON_LEAF, entry_component, from_json, join_entry, parse_component
from lightning_hpp.checkpoint.retry import RetryPolicy
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError


class _JsonSlot:
    def __init__(self, fqn: str, buffer: torch.Tensor) -> None:
        self.fqn = fqn
        self.buffer = buffer

    def decode(self, url: str) -> Any:
        try:
            return from_json(json.loads(self.buffer.numpy().tobytes()))
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
        bound = {key: self._bind(value, entry_component(key, state, "")) for key, value in state.items()}
        if self.missing or self.mismatched:
            raise CheckpointError(self._report())
        return bound

    def _bind(self, node: Any, path: str) -> Any:
        info = self.index.get(join_entry(path, JSON_LEAF))
        if info is not None:
            return self._slot(join_entry(path, JSON_LEAF), info)
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
            items = [(k, self._bind(v, join_entry(path, entry_component(k, node, path)))) for k, v in node.items()]
            return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
        if isinstance(node, list) and node:
            return [self._bind(v, join_entry(path, f"[{i}]")) for i, v in enumerate(node)]
        if isinstance(node, tuple) and node:
            return tuple(self._bind(v, join_entry(path, f"({i})")) for i, v in enumerate(node))
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
            if comps[-1] == JSON_LEAF:
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
        parsed = [(parse_component(c), v) for c, v in node.items()]
        kinds = {kind for (kind, _), _ in parsed}
        if len(kinds) != 1:
            raise CorruptCheckpointError(f"{self.url!r}: entries under {path!r} mix container kinds {sorted(kinds)}.")
        kind = kinds.pop()
        children = [(key, self._materialize(v, join_entry(path, str(key)))) for (_, key), v in parsed]
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
        metadata = read_index(url, retry)
        binder = _Binder(entry_index(metadata, url), url)
        bound = binder.bind(state)
    except Exception as exc:
        error = exc
    agree(error, process_group, f"to prepare loading {url!r}")
    assert binder is not None and metadata is not None

    def read() -> None:
        quiet_single_process()
        try:
            dcp.load(
                binder.requests,
                storage_reader=IndexedReader(url, metadata, retry),
                planner=NoBytesLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                process_group=process_group,
                no_dist=not initialized(),
            )
        except CheckpointException as exc:
            failure = storage_failure(exc)
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
