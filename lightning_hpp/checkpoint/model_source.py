"""The model inside a committed sharded checkpoint, as the exports read it.

* :func:`open_saved_model`: the checkpoint chosen (a ``step-<N>`` directory, a ``ModelCheckpoint`` path, or
  the newest valid one under a root), verified, with its model's tensors (names, shapes, dtypes: nothing is
  read yet), the names of tied tensors it left out, and the facts Lightning keeps beside the weights.
* :func:`source_names`: every name the model's ``state_dict`` has, each with the name its tensor was saved
  under. A tensor registered under several names (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
  is saved once; ``load_state_dict(strict=True)`` wants it under all of them.
* :func:`module_on_meta`: the LightningModule class rebuilt from the checkpoint's hyper-parameters as
  ``load_from_checkpoint`` rebuilds it, on the meta device: its names, shapes and ties, no memory.

Where the tied names come from, most trusted first: the module itself when its class is given (ties by
identity, as ``load_state_dict`` will see them); else the checkpoint's own record, written by every pipeline
position (:data:`~lightning_hpp.checkpoint.lightning_state.TIED`), which holds whatever the training module
tied, however it tied it (``_tied_weights_keys``, ``tie_word_embeddings``, an assignment in ``__init__``).
Neither ``hyper_parameters`` (a model built from a config may tie or not) nor the plan (it names units, not
tensors) can say it. A name that resolves to no saved tensor is an error, never a key silently left out.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_hpp.checkpoint.checksums import verify
from lightning_hpp.checkpoint.commit import METADATA_FILE, CheckpointInfo
from lightning_hpp.checkpoint.dcp_index import KeyInfo, checkpoint_keys
from lightning_hpp.checkpoint.discovery import latest_valid
from lightning_hpp.checkpoint.lightning_state import TIED, tensor_aliases
from lightning_hpp.checkpoint.load import load_sharded
from lightning_hpp.checkpoint.storage import filesystem
from lightning_hpp.checkpoint.warning import CheckpointWarning
from lightning_hpp.errors import CheckpointError

_FACTS = ("hyper_parameters", "hparams_name", "epoch", "global_step")


@dataclass(frozen=True)
class SavedModel:
    """What a checkpoint holds of a model; tensors are read on demand (:meth:`read`, :meth:`read_all`).

    Attributes:
        url: The checkpoint directory.
        info: Its ``metadata.json``.
        tensors: Saved name -> shape and dtype, for every tensor of ``state["model"]``.
        ties: The names left out for a tied tensor -> the name it was saved under; ``None`` when a
            checkpoint of HPPStrategy does not say (written before lightning_hpp recorded them); empty for a
            state saved with ``save_sharded`` by hand (its ``model`` names are all there is).
        facts: ``hyper_parameters``, ``hparams_name``, ``epoch``, ``global_step`` where saved (the
            hyper-parameters from ``metadata.json`` otherwise).
    """

    url: str
    info: CheckpointInfo
    tensors: dict[str, KeyInfo]
    ties: dict[str, str] | None
    facts: dict[str, Any]

    def read(self, name: str) -> torch.Tensor:
        """The tensor saved under ``name``, alone: nothing else of the checkpoint is read."""
        info = self.tensors[name]
        return load_sharded(self.url, {"model": {name: torch.empty(info.shape, dtype=info.dtype)}})["model"][name]

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model, by saved name."""
        model = load_sharded(self.url, {"model": None})["model"]
        if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
            raise CheckpointError(f"{self.url!r}: state['model'] is not a mapping of names to tensors.")
        return model


def resolve_source(src_url: str) -> str:
    """``src_url`` when it is a committed checkpoint, else the newest valid ``step-<N>`` under it."""
    fs, path = filesystem(src_url)
    fs.invalidate_cache(path)
    if fs.exists(f"{path.rstrip('/')}/{METADATA_FILE}"):
        return src_url
    newest = latest_valid(src_url)
    if newest is None:
        raise CheckpointError(
            f"export source {src_url!r} is neither a committed checkpoint (no {METADATA_FILE}) "
            f"nor a directory holding a valid `step-<N>` checkpoint. Pass a checkpoint directory "
            f"such as '<root>/step-100' or its root."
        )
    return newest.url


def open_saved_model(src_url: str, *, checksums: bool = True) -> SavedModel:
    """The model of the checkpoint at ``src_url`` (or the newest valid one under it), verified.

    Raises:
        CheckpointError: no usable checkpoint, or no ``model`` entry of tensors.
        CorruptCheckpointError: a file that does not match ``metadata.json`` (with ``checksums``).
    """
    url = resolve_source(src_url)
    info = verify(url, checksums=checksums)
    keys = checkpoint_keys(url)
    tops = {path[0] for path in keys}
    tensors = {str(k[1]): v for k, v in keys.items() if k[0] == "model" and len(k) == 2 and v.kind == "tensor"}
    if "model" not in tops or not tensors:
        raise CheckpointError(
            f"{url!r} has no 'model' entry of tensors (it holds {sorted(map(str, tops))}); export needs the "
            f"model saved under state['model'] as parameter name -> tensor."
        )
    positions = sorted(t for t in tops if isinstance(t, str) and t.startswith("position_"))
    template: dict[str, Any] = {k: None for k in (*_FACTS, *positions) if k in tops}
    loaded = load_sharded(url, template) if template else {}
    facts = {k: loaded[k] for k in _FACTS if k in loaded}
    if facts.get("hyper_parameters") is None:
        facts["hyper_parameters"] = (info.metadata.get("extra") or {}).get("hyper_parameters")
    records = [loaded[p].get(TIED) for p in positions if isinstance(loaded[p], dict)]
    ties: dict[str, str] | None = {alias: saved for r in records if r for alias, saved in r.items()}
    if positions and all(r is None for r in records):  # written by HPPStrategy before tied names were recorded
        ties = None
    return SavedModel(url, info, tensors, ties, facts)


def module_on_meta(module_cls: type, saved: SavedModel) -> torch.nn.Module:
    """``module_cls`` built as ``load_from_checkpoint`` builds it (the checkpoint's hyper-parameters, its
    ``configure_model``), on the meta device: names, shapes and ties without memory.

    Raises:
        CheckpointError: the class cannot be built so (the exception named, with the fix).
    """
    hparams = dict(saved.facts.get("hyper_parameters") or {})
    init = inspect.signature(module_cls.__init__).parameters
    params = [n for n, p in init.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][1:]
    name = saved.facts.get("hparams_name")
    if name and name in params:  # `def __init__(self, hparams)`: the whole dict under that name
        hparams = {name: hparams}
    if not any(p.kind is p.VAR_KEYWORD for p in init.values()):
        hparams = {k: v for k, v in hparams.items() if k in params}
    try:
        with torch.device("meta"):
            module = module_cls(**hparams)
            if isinstance(module, LightningModule) and is_overridden("configure_model", module):
                module.configure_model()
    except Exception as exc:
        raise CheckpointError(
            f"`--module {module_cls.__module__}:{module_cls.__qualname__}` could not be built on the meta device "
            f"from the checkpoint's hyper-parameters {sorted(hparams)} ({type(exc).__name__}: {exc}). The export "
            f"builds the class as `load_from_checkpoint` does, without weights; make its `__init__` and "
            f"`configure_model` build the model from those arguments alone."
        ) from exc
    if not isinstance(module, torch.nn.Module):
        raise CheckpointError(f"`--module` {module_cls.__qualname__} built a {type(module).__name__}, not a module.")
    return module


def source_names(saved: SavedModel, module: torch.nn.Module | None = None, *,
                 only: list[str] | None = None) -> dict[str, str]:
    """Every name of the model's ``state_dict`` -> the name its tensor was saved under.

    Args:
        saved: The checkpoint's model.
        module: The LightningModule (on the meta device): its ``state_dict`` names, in its order, are the
            answer, checked against the checkpoint (every name found, same shapes, no saved tensor left over).
            ``None``: the saved names and the tied names the checkpoint recorded.
        only: With ``module``: resolve these names only (a part of the module), without the leftover check.

    Raises:
        CheckpointError: a name that resolves to no saved tensor (a tied name whose saved tensor is missing
            included), shapes that differ, or saved tensors the module does not have.
    """
    ties = saved.ties or {}
    broken = {alias: src for alias, src in ties.items() if src not in saved.tensors}
    if module is None:
        if broken:
            raise _broken_ties(saved, broken)
        names = {n: n for n in saved.tensors}
        names.update({alias: src for alias, src in ties.items() if alias not in names})
        return names
    expected = module.state_dict(keep_vars=True)
    groups = {n: names_of for names_of in tensor_aliases(module).values() for n in names_of}
    wanted = list(expected) if only is None else only
    found: dict[str, str] = {}
    missing, wrong = [], []
    for name in wanted:
        src = _source_of(name, saved, ties, groups)
        if src is None:
            missing.append(name)
        elif name in expected and tuple(expected[name].shape) != saved.tensors[src].shape:
            wrong.append(f"{name}: {list(saved.tensors[src].shape)} vs {list(expected[name].shape)}")
        else:
            found[name] = src
    unexpected = [] if only is not None else sorted(set(saved.tensors) - set(found.values()))
    if missing and broken:  # a missing name explained: its tensor, recorded as saved, is not there
        raise _broken_ties(saved, broken)
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{saved.url!r} does not match {type(module).__name__}: missing {missing[:8]}, unexpected "
            f"{unexpected[:8]}, shape mismatches {wrong[:8]}. Export with the LightningModule class that was "
            f"trained (and the hyper-parameters it saved), or without `--module`."
        )
    return found


def warn_if_ties_unknown(saved: SavedModel) -> None:
    """Warn when the checkpoint was written by HPPStrategy before it recorded tied names: without the module,
    a tied tensor is exported under the one name it was saved under."""
    if saved.ties is None:
        warnings.warn(
            f"{saved.url!r} was written by a lightning_hpp that did not record the other names of tied tensors "
            f"(an LM head tied to its embedding): each is exported under the name it was saved under only, and "
            f"`load_from_checkpoint` will miss the others. Pass `--module package.module:MyModule` (the "
            f"LightningModule that was trained) to export every name.",
            CheckpointWarning,
            stacklevel=2,
        )


def _source_of(name: str, saved: SavedModel, ties: dict[str, str], groups: dict[str, list[str]]) -> str | None:
    if name in saved.tensors:
        return name
    tied = next((n for n in groups.get(name, ()) if n in saved.tensors), None)  # the module's ties first
    if tied is None and ties.get(name) in saved.tensors:
        tied = ties[name]
    return tied


def _broken_ties(saved: SavedModel, broken: dict[str, str]) -> CheckpointError:
    pairs = ", ".join(f"{alias!r} -> {src!r}" for alias, src in sorted(broken.items())[:8])
    return CheckpointError(
        f"{saved.url!r} records tied names whose saved tensor is missing: {pairs} (name -> the name its tensor "
        f"was saved under). The checkpoint's model is incomplete (a partial copy, or a state edited after "
        f"saving); export another checkpoint, or the one this was copied from."
    )
