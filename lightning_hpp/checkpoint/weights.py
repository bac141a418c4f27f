"""Initial weights for a stage materialized from the meta device, read from disk tensor by tensor.

A model too large for one device is built on the meta device; each rank materializes only its own
stages (``to_empty``) and then calls :func:`load_stage_weights`, which reads from the checkpoint
exactly the tensors those stages need and nothing else::

    module = MyLightningModule()                   # built under torch.device("meta")
    ...                                            # this rank's stages materialized on its device
    load_stage_weights(module, "/ckpt/llama-7b", rename="model.")

Sources:

* a ``.safetensors`` file;
* a transformers checkpoint directory (``save_pretrained``): ``model.safetensors``, or a sharded
  ``model.safetensors.index.json`` and its shards: only the shards that hold wanted tensors are
  opened (safetensors' lazy ``safe_open``; a shard's header gives the shapes, its data is read one
  wanted tensor at a time); a tensor-parallel shard (a ``DTensor`` destination) reads only its own
  rows or columns (``get_slice``), so no rank reads a whole split weight;
* a checkpoint of this project (a directory with ``metadata.json``, written by
  :func:`~lightning_hpp.checkpoint.save_sharded` / ``HPPStrategy``; also on ``s3://``): its model
  entries (``state["model"][name]``) are read through torch.distributed.checkpoint with a template
  of the wanted entries only, on this rank alone (no collective, no process group needed).

Pickled formats (``pytorch_model.bin``, ``.ckpt``) are never read: loading them can run code.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

import safetensors
import torch
from torch import nn

from lightning_hpp.checkpoint.collective import storage_failure
from lightning_hpp.checkpoint.commit import METADATA_FILE, read_metadata
from lightning_hpp.checkpoint.dcp_index import (
    IndexedReader,
    NoBytesLoadPlanner,
    entry_index,
    quiet_single_process,
    read_index,
)
from lightning_hpp.checkpoint.entries import parse_key
from lightning_hpp.checkpoint.retry import RetryPolicy
from lightning_hpp.errors import CheckpointError

__all__ = ["load_stage_weights"]

_SHOW = 10  # names shown per kind of problem
_INDEX_SUFFIX = ".safetensors.index.json"


def load_stage_weights(
    module: nn.Module,
    source: str | os.PathLike[str],
    *,
    names: Iterable[str] | None = None,
    rename: Callable[[str], str | None] | str | None = None,
    strict: bool = True,
    check_unexpected: bool = False,
) -> list[str]:
    """Copy into ``module``'s parameters and buffers the tensors of ``source`` that they need.

    Only the wanted tensors are read (safetensors' lazy ``safe_open``; torch.distributed.checkpoint
    with a template of the wanted entries for this project's checkpoints). Each is cast to its
    destination's dtype, moved to its device and copied in place (``copy_`` under
    ``torch.no_grad()``), so Parameter objects (optimizers, tied weights) stay the same. Every
    check runs before the first copy: if the call raises, ``module`` is left as it was.

    Tied weights: a wanted name absent from the file whose tensor is the same Parameter (or
    buffer) as another name present in the file is filled from that one, as transformers'
    ``save_pretrained`` drops tied duplicates (``lm_head.weight`` with ``tie_word_embeddings``). A
    tensor is read once, whatever number of names it has.

    Args:
        module: The module (a LightningModule, a stage, a whole model) whose wanted tensors are
            already materialized on their device, in any dtype.
        source: A ``.safetensors`` file, a transformers checkpoint directory (``model.safetensors``
            or ``model.safetensors.index.json`` with its shards; or a ``*.safetensors.index.json``
            file), or a checkpoint directory / URL of this project (holding ``metadata.json``).
        names: The names (``module.state_dict()`` keys) to fill; default: every
            ``module.state_dict()`` tensor that is not on the meta device. Other names are never read.
        rename: Maps a module name to its name in the file: a callable (returning ``None`` for
            "not in the file"), or a prefix to strip (``"model."`` when a LightningModule holds
            ``self.model = LlamaForCausalLM(...)`` saved with ``save_pretrained``; a name without
            the prefix is then not in the file). Default: names are the same.
        strict: Raise if a wanted name is not in the file (and has no tied alias there); with
            ``False`` such names are skipped (they are absent from the returned list). Wrong
            shapes, unknown names and tensors still on the meta device always raise.
        check_unexpected: Also raise if the file holds names that no name of ``module`` maps to
            (loading a whole model). Off by default: a stage's file holds the other stages too.

    Returns:
        The wanted names that were filled, in order.

    Raises:
        CheckpointError: a source that cannot be read (missing, without weights, pickled, corrupt),
            or one error listing every problem: missing names, wrong shapes (file vs module),
            unexpected names, names that are not parameters/buffers of ``module``, destinations
            on the meta device.
    """
    src_text = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    if not isinstance(src_text, str) or not src_text:
        raise CheckpointError(
            f"`source` is {source!r}; pass a .safetensors file, a transformers checkpoint directory "
            f"or a lightning_hpp checkpoint directory."
        )
    to_file = _rename_fn(rename)
    tensors, groups = _tensors_of(module)
    wanted, problems = _wanted(module, names, tensors)

    with ExitStack() as stack:
        src = _open_source(src_text, stack)
        in_file = src.names()
        plan: dict[str, str] = {}  # wanted module name -> file name read for it
        missing: list[str] = []  # module names
        for name in wanted:
            target = to_file(name)
            if target is not None and target in in_file:
                plan[name] = target
                continue
            alias = next(
                (a for a in groups.get(id(tensors[name]), ()) if (t := to_file(a)) is not None and t in in_file), None
            )
            if alias is not None:
                plan[name] = to_file(alias)  # type: ignore[assignment]
            else:
                missing.append(name)
        reads: dict[int, tuple[str, str]] = {}  # one read per tensor: id -> (module name, file name)
        for name, target in plan.items():
            reads.setdefault(id(tensors[name]), (name, target))
        shapes = src.shapes([target for _, target in reads.values()])
        wrong = [
            f"{name!r} (file {target!r}): file {list(shapes[target])}, module {list(tensors[name].shape)}"
            for name, target in reads.values()
            if tuple(shapes[target]) != tuple(tensors[name].shape)
        ]
        if strict and missing:
            problems["missing"] = [_as_in_file(name, to_file(name)) for name in missing]
        if wrong:
            problems["wrong shape"] = wrong
        if check_unexpected:
            mapped = {t for n in (*tensors, *module.state_dict()) if (t := to_file(n)) is not None}
            unexpected = sorted(in_file - mapped)
            if unexpected:
                problems["unexpected"] = [repr(u) for u in unexpected]
        if problems:
            raise CheckpointError(_report(module, src_text, problems, sorted(in_file), missing, rename))
        with torch.no_grad():
            src.read([(target, tensors[name]) for name, target in reads.values()])
    return [name for name in wanted if name in plan]


# ============================================================================ the module's side


def _rename_fn(rename: Callable[[str], str | None] | str | None) -> Callable[[str], str | None]:
    if rename is None:
        return lambda name: name
    if isinstance(rename, str):
        prefix = rename
        return lambda name: name[len(prefix) :] if name.startswith(prefix) else None
    if callable(rename):

        def checked(name: str) -> str | None:
            out = rename(name)
            if out is not None and not isinstance(out, str):
                raise CheckpointError(
                    f"`rename` returned {out!r} ({type(out).__name__}) for {name!r}; it must return the "
                    f"name in the file (str) or None for 'not in the file'."
                )
            return out

        return checked
    raise CheckpointError(
        f"`rename` is {rename!r} ({type(rename).__name__}); pass a prefix to strip (str, e.g. 'model.'), "
        f"a callable mapping a module name to the file's name (or None), or None."
    )


def _tensors_of(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, list[str]]]:
    """Every parameter and buffer under each of its names, and the names of each tensor (by id)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        tensors[name] = t
    for name, t in module.named_buffers(remove_duplicate=False):
        tensors.setdefault(name, t)
    groups: dict[int, list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault(id(t), []).append(name)
    return tensors, groups


def _wanted(
    module: nn.Module, names: Iterable[str] | None, tensors: dict[str, torch.Tensor]
) -> tuple[list[str], dict[str, list[str]]]:
    problems: dict[str, list[str]] = {}
    if names is None:
        keys = module.state_dict(keep_vars=True).keys()
        return [k for k in keys if k in tensors and not tensors[k].is_meta], problems
    if isinstance(names, (str, bytes)):
        raise CheckpointError(f"`names` is the string {names!r}; pass an iterable of names, e.g. names=[{names!r}].")
    wanted = list(dict.fromkeys(names))
    unknown = [repr(n) for n in wanted if n not in tensors]
    on_meta = [repr(n) for n in wanted if n in tensors and tensors[n].is_meta]
    if unknown:
        problems["not a parameter or buffer of the module"] = unknown
    if on_meta:
        problems["still on the meta device"] = on_meta
    return [n for n in wanted if n in tensors and not tensors[n].is_meta], problems


# ============================================================================ sources


class _Safetensors:
    """One ``.safetensors`` file, or the shards of a ``*.safetensors.index.json``; opened lazily."""

    def __init__(self, label: str, stack: ExitStack, *, file: str | None = None, index: str | None = None) -> None:
        self.label = label
        self.stack = stack
        self.handles: dict[str, Any] = {}
        if file is not None:
            self.where = {name: file for name in self._open(file).keys()}
        else:
            assert index is not None
            self.where = _weight_map(index)

    def _open(self, path: str) -> Any:
        if path not in self.handles:
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"{self.label!r}: the shard {path!r} it lists does not exist. The checkpoint is "
                    f"incomplete: copy the missing shard, or save the model again."
                )
            try:
                self.handles[path] = self.stack.enter_context(safetensors.safe_open(path, framework="pt", device="cpu"))
            except Exception as exc:  # safetensors' own error type is not importable in every version
                raise CheckpointError(
                    f"{path!r} is not a readable safetensors file ({type(exc).__name__}: {exc}). It is "
                    f"truncated or not safetensors: save it again (safetensors.torch.save_file or "
                    f"save_pretrained)."
                ) from None
        return self.handles[path]

    def names(self) -> set[str]:
        return set(self.where)

    def shapes(self, names: list[str]) -> dict[str, tuple[int, ...]]:
        # a shard's header holds the shapes: only the shards with wanted names are opened
        return {n: tuple(self._open(self.where[n]).get_slice(n).get_shape()) for n in names}

    def read(self, targets: list[tuple[str, torch.Tensor]]) -> None:
        for name, dest in targets:
            handle = self._open(self.where[name])
            region = _local_region(dest)
            if region is None:
                dest.copy_(handle.get_tensor(name))
            else:  # a shard (tensor parallel): only its rows / columns are read
                local, index = region
                local.copy_(handle.get_slice(name)[index])


def _local_region(dest: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]] | None:
    """For a ``DTensor`` destination, its local shard and where that lies in the whole tensor (the index of a
    safetensors ``get_slice``); ``None`` for a plain tensor. The offsets are torch's own for the DTensor's
    placements (``compute_local_shape_and_global_offset``, what DCP reads shards with)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(dest, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dest.shape, dest.device_mesh, dest.placements)
    return dest.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _weight_map(index: str) -> dict[str, str]:
    try:
        with open(index, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{index!r} is not a readable JSON index ({type(exc).__name__}: {exc}); save the model again "
            f"with save_pretrained."
        ) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index!r} has no 'weight_map' of tensor name -> shard file; it is not a safetensors "
            f"index written by save_pretrained. Pass the checkpoint directory or a .safetensors file."
        )
    base = os.path.dirname(index)
    return {name: os.path.join(base, shard) for name, shard in weight_map.items()}


class _Sharded:
    """A checkpoint of this project: model entries ``state["model"][name]``, read with DCP."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.retry = RetryPolicy()
        whole = self.retry.for_url(url)
        whole.call(lambda: read_metadata(url, retry=self.retry), what=f"reading metadata.json of {url!r}")
        self.metadata = whole.call(lambda: read_index(url, self.retry), what=f"reading the shard index of {url!r}")
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}  # model name -> (entry, shape)
        for fqn, info in entry_index(self.metadata, url).items():
            path = parse_key(fqn)
            if info.kind == "tensor" and len(path) == 2 and path[0] == "model" and isinstance(path[1], str):
                self.entries[path[1]] = (fqn, info.shape)
        if not self.entries:
            raise CheckpointError(
                f"{url!r} is a lightning_hpp checkpoint without model tensors (no state['model'] entries). "
                f"Pass a checkpoint saved by HPPStrategy or save_sharded({{'model': module.state_dict(), ...}})."
            )

    def names(self) -> set[str]:
        return set(self.entries)

    def shapes(self, names: list[str]) -> dict[str, tuple[int, ...]]:
        return {n: self.entries[n][1] for n in names}

    def read(self, targets: list[tuple[str, torch.Tensor]]) -> None:
        if not targets:
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        # the template holds the wanted entries only; DCP copies each into its destination
        # (cast to its dtype, moved to its device). no_dist: this rank alone, no collective.
        request: dict[str, torch.Tensor] = {}
        again: list[tuple[torch.Tensor, str]] = []  # a second destination of one entry: copied after
        for name, dest in targets:
            fqn = self.entries[name][0]
            if fqn in request:
                again.append((dest, fqn))
            else:
                request[fqn] = dest.detach()

        def read() -> None:
            quiet_single_process()
            try:
                dcp.load(
                    request,
                    storage_reader=IndexedReader(self.url, self.metadata, self.retry),
                    planner=NoBytesLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                    no_dist=True,
                )
            except CheckpointException as exc:
                raise storage_failure(exc) from None

        self.retry.for_url(self.url).call(read, what=f"reading the model tensors of {self.url!r}")
        for dest, fqn in again:
            dest.copy_(request[fqn])


def _open_source(source: str, stack: ExitStack) -> _Safetensors | _Sharded:
    if "://" in source and not source.startswith("file://"):
        return _Sharded(source)  # object stores hold checkpoints of this project only
    path = source.removeprefix("file://")
    if os.path.isfile(path):
        if path.endswith(_INDEX_SUFFIX):
            return _Safetensors(source, stack, index=path)
        if path.endswith(".safetensors"):
            return _Safetensors(source, stack, file=path)
        raise CheckpointError(
            f"{source!r} is not a .safetensors file (nor a *{_INDEX_SUFFIX}); only safetensors and "
            f"lightning_hpp checkpoints are read, never pickles (.bin, .pt, .ckpt can run code when "
            f"loaded). Convert it: save_pretrained(dir) or safetensors.torch.save_file."
        )
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{source!r} does not exist. Pass a .safetensors file, a transformers checkpoint directory "
            f"(save_pretrained) or a lightning_hpp checkpoint directory (holding metadata.json)."
        )
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return _Sharded(source)
    entries = sorted(os.listdir(path))
    for preferred in ("model" + _INDEX_SUFFIX, "model.safetensors"):
        if preferred in entries:
            return _open_source(os.path.join(path, preferred), stack)
    indexes = [e for e in entries if e.endswith(_INDEX_SUFFIX)]
    files = [e for e in entries if e.endswith(".safetensors")]
    for group in (indexes, files):
        if len(group) == 1:
            return _open_source(os.path.join(path, group[0]), stack)
        if len(group) > 1:
            raise CheckpointError(
                f"{source!r} holds several weight files {group[:_SHOW]} and no model.safetensors(.index.json); "
                f"pass the one to read as `source` (its full path)."
            )
    steps = [e for e in entries if re.fullmatch(r"step-\d+", e)]
    hint = (
        f" It holds checkpoints {steps[-3:]}: pass one of them, e.g. latest_valid({source!r}).url."
        if steps
        else " A pytorch_model.bin is never read (a pickle): convert it with save_pretrained(dir)."
    )
    raise CheckpointError(
        f"{source!r} holds no weights: no model.safetensors, no *{_INDEX_SUFFIX}, no metadata.json "
        f"(it holds {entries[:_SHOW]}{' ...' if len(entries) > _SHOW else ''}).{hint}"
    )


# ============================================================================ the error


def _as_in_file(name: str, target: str | None) -> str:
    if target is None:
        return f"{name!r} (rename gave None)"
    return repr(name) if target == name else f"{name!r} (as {target!r})"


def _report(
    module: nn.Module,
    source: str,
    problems: dict[str, list[str]],
    in_file: list[str],
    missing: list[str],
    rename: Any,
) -> str:
    lines = [f"Cannot load {type(module).__name__}'s weights from {source!r}:"]
    for kind, items in problems.items():
        more = f" ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
        lines.append(f"  {kind} ({len(items)}): {', '.join(items[:_SHOW])}{more}")
    fixes = []
    if "missing" in problems:
        hint = _prefix_hint(missing, in_file, rename)
        fixes.append(
            f"missing: the file holds e.g. {in_file[:3]}; map module names to those with `rename=`{hint}, "
            f"load fewer names with `names=`, or skip absent ones with strict=False"
        )
    if "wrong shape" in problems:
        fixes.append(
            "wrong shape: the file was saved from a model of another configuration; build the module "
            "from the checkpoint's config (or fix a `rename=` that pairs the wrong names)"
        )
    if "unexpected" in problems:
        fixes.append(
            "unexpected: these file names map to no module name; fix `rename=`, or leave "
            "check_unexpected=False when the file holds more than this module (other stages)"
        )
    if "not a parameter or buffer of the module" in problems:
        fixes.append("unknown names: pass names from `module.state_dict()` (its parameter and buffer names)")
    if "still on the meta device" in problems:
        fixes.append(
            "meta: materialize those tensors first (e.g. `stage.to_empty(device=...)`), or leave them out of `names=`"
        )
    lines.append("Fix: " + "; ".join(fixes) + ".")
    return "\n".join(lines)


def _prefix_hint(missing: list[str], in_file: list[str], rename: Any) -> str:
    """A ``rename=`` that would pair some missing names with the file's: a prefix to strip or to add."""
    present = set(in_file)
    for name in missing[:_SHOW]:
        parts = name.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[i:]) in present:
                prefix = ".".join(parts[:i]) + "."
                return f" (e.g. rename={prefix!r})" if rename != prefix else ""
        for key in in_file:
            if key.endswith("." + name):
                prefix = key[: -len(name)]
                return f" (e.g. rename=lambda n: {prefix!r} + n)"
    return ""
