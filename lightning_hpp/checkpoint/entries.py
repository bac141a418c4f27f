"""A checkpoint's entries: a nested training state as named tensors and JSON documents, and back.

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

A pickle can also hide in a tensor's bytes: a module's ``get_extra_state`` (the ``_extra_state``
entry of its ``state_dict``) may return one, as Transformer Engine's does, and its
``set_extra_state`` unpickles it when loaded. Saving such an entry is refused here
(:func:`holds_pickle` parses the bytes with ``pickletools``, which runs nothing); loading one into
a module is refused where the module's state is rebuilt
(:func:`~lightning_hpp.checkpoint.lightning_state.from_sharded`). Transformer Engine's fp8 state is
saved as tensors and JSON instead (:mod:`~lightning_hpp.checkpoint.fp8_state`).
"""

from __future__ import annotations

import io
import json
import pickletools
import zipfile
from typing import Any
from urllib.parse import quote, unquote

import numpy as np
import torch

from lightning_hpp.errors import CheckpointError, CorruptCheckpointError
from lightning_hpp.redaction import redact
from lightning_hpp.validation import is_int

JSON_LEAF = "@json"
"""Last path component of a JSON entry's name; ``@`` never survives ``quote()``."""
EXTRA_STATE = "_extra_state"  # torch's state_dict name (last part) for what `get_extra_state()` returns
_TAGS = ("__tuple__", "__items__", "__ndarray__", "__dtype__")


# ============================================================================ paths of entries


def entry_component(key: Any, container: Any, where: str) -> str:
    """The name component of ``key`` in ``container`` (quoted str, ``#int``, ``[i]``, ``(i)``)."""
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


def parse_component(comp: str) -> tuple[str, Any]:
    """The container kind and key behind one name component (the inverse of :func:`entry_component`)."""
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
    if comps[-1] == JSON_LEAF:
        comps = comps[:-1]
    return tuple(parse_component(c)[1] for c in comps)


def join_entry(path: str, comp: str) -> str:
    """``path/comp``, or ``comp`` at the top."""
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


def from_json(value: Any) -> Any:
    """A JSON document's value as saved: tuples, non-str keys, numpy arrays and dtypes rebuilt."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, payload),) = value.items()
        if tag == "__tuple__":
            return tuple(from_json(v) for v in payload)
        if tag == "__items__":
            return {from_json(k): from_json(v) for k, v in payload}
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
    return {k: from_json(v) for k, v in value.items()}


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
                walk(value, join_entry(path, entry_component(key, node, where)), f"{where}[{key!r}]")
        else:
            encoded = _to_json(redact(node), where)
            docs[join_entry(path, JSON_LEAF)] = json.dumps(encoded, allow_nan=True, separators=(",", ":")).encode()

    for key, value in state.items():
        walk(value, entry_component(key, state, ""), f"[{key!r}]")
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
