"""Converting Lightning's checkpoint dict to the sharded, name-keyed state and back.

Lightning's ``dump_checkpoint`` gives every rank a dict whose ``state_dict`` holds that rank's
stages and whose ``optimizer_states`` are keyed by parameter *index*. The sharded state keys
everything by name or owner, so it loads under any other layout::

    model              parameter/buffer name -> tensor          (replica 0 of each stage)
    optim/<i>          parameter name -> per-parameter state      (replica 0 of each stage)
    position_pp<r>     param groups (params as names), LR schedulers, tied names (replica 0 of position r)
    rank/<g>           RNG states of global rank g (torch, numpy, python)
    trainer            loops, callbacks, precision state, ...       (global rank 0)
    fp8/dp<r>          fp8 scaling state per layer or weight         (every rank of replica r)
    epoch, global_step, hyper_parameters, pytorch-lightning_version (global rank 0)

A sharded stage (FSDP2, HSDP or tensor parallel: :func:`is_sharded`) is written by every rank of it,
``model``, ``optim/<i>`` and ``position_pp<r>`` alike: its DTensors as each rank's own shards, its
plain tensors and JSON (buffers, Adam's ``step``, param groups) once, as replicas. Loading into a
sharded stage asks for its parameters and their optimizer state as DTensors of the live layout
(:func:`load_template`), so each rank reads only its shards, whatever layout saved them.

A tensor registered under several names (tied weights: GPT-2's ``transformer.wte.weight`` is
``lm_head.weight``) is one entry, under its first name in ``named_parameters()`` /
``named_buffers()`` (:func:`tensor_aliases`), with its optimizer state once; loading fills it under
whichever of its names the checkpoint holds and gives it back to Lightning under all of them. Each
position records the names it left out, ``position_pp<r>/tied``: ``{other name: saved name}``
(:data:`TIED`), so that a reader without the module (the export to one ``.ckpt`` or to transformers'
format) writes the tensor under every name ``load_state_dict`` expects.

Loading rebuilds a Lightning checkpoint dict for the current rank: its own parameters, its
optimizers' states re-keyed to the current parameter indices, and hyper-parameters of the saved
param group that shares most parameters with each current group (exact when the layout is the
same, the best match when it changed).

fp8 scaling state (amax histories, scales) is saved and restored as tensors and JSON by
:mod:`~lightning_hpp.checkpoint.fp8_state`; Transformer Engine's pickled ``_extra_state`` entries
are left out of ``model`` (and given to ``load_state_dict`` as ``None``, which TE ignores). Any
``_extra_state`` entry the module would load is taken as saved, whatever its shape, and refused if
it holds a pickle (:func:`~lightning_hpp.checkpoint.entries.holds_pickle`): a module's
``set_extra_state`` may unpickle it, as Transformer Engine's does.

The name mapping is hand-written rather than torch.distributed.checkpoint.state_dict's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (torch 2.13, ``StateDictOptions(strict=False)``):
those do reshard name-keyed state between cuts once every parameter has state, but in a small
experiment (6 linear units saved as 2 stages, loaded as 3) ``get_optimizer_state_dict`` on an Adam
that had not stepped yet ran a zero-gradient step on the live optimizer (its state went from empty
to ``step=1``, changing the next real update's bias correction), and ``set_optimizer_state_dict``
given such a checkpoint (no per-parameter state) under the new cut failed with "ValueError: loaded
state dict has a different number of parameter groups", because with empty state it passes every
saved param group through unsplit.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from lightning_hpp.checkpoint.dcp_index import KeyInfo, checkpoint_keys
from lightning_hpp.checkpoint.entries import holds_pickle, is_extra_state, pickle_refused
from lightning_hpp.checkpoint.fp8_state import (
    STATE_KEY,
    FP8Slot,
    fp8_state,
    fp8_template,
    restore_fp8_state,
    te_extra_state_keys,
)
from lightning_hpp.checkpoint.load import load_sharded
from lightning_hpp.checkpoint.retention import Retention
from lightning_hpp.checkpoint.save import save_sharded

_SPLIT = ("state_dict", "optimizer_states", "lr_schedulers")
_TOP = ("epoch", "global_step", "hyper_parameters", "hparams_name", "pytorch-lightning_version")
TIED = "tied"
"""Key, in each ``position_pp<r>`` entry, of the names of tied tensors that position left out of ``model``:
``{other name: the name it was saved under}`` (empty when it has none; absent in checkpoints written before
lightning_hpp recorded them)."""


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2, tensor parallel): its ranks hold different shards."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def tensor_aliases(module: torch.nn.Module) -> dict[str, list[str]]:
    """Every parameter / buffer registered under several names: its first name -> all its names
    (first name first), grouped by identity. Tensors with one name are left out."""
    groups: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    for n, b in module.named_buffers(remove_duplicate=False):
        groups.setdefault(id(b), []).append(n)
    return {names[0]: names for names in groups.values() if len(names) > 1}


def _first_name(module: torch.nn.Module) -> dict[str, str]:
    """Any name of a tied tensor -> its first name."""
    return {alias: names[0] for names in tensor_aliases(module).values() for alias in names}


def _saved_name(names: list[str], saved: set[str]) -> str:
    """The name a tied tensor was saved under: its first name, or (a checkpoint written with another
    layout or before tied tensors were saved once) the first of its names that the checkpoint holds."""
    return next((n for n in names if n in saved), names[0])


def optimizer_to_named(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict[str, Any], list[dict]]:
    """An optimizer's state keyed by parameter name, and its param groups with names as params."""
    sd = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    for group_sd, group in zip(sd["param_groups"], optimizer.param_groups):
        for idx, p in zip(group_sd["params"], group["params"]):
            index_to_name[idx] = names[id(p)]
    state = {index_to_name[i]: s for i, s in sd["state"].items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index_to_name[i] for i in g["params"]]}
        for g in sd["param_groups"]
    ]
    return state, groups


def optimizer_from_named(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    state: dict[str, Any],
    saved_groups: list[dict],
    first_name: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The torch ``state_dict`` for ``optimizer`` built from name-keyed state and saved groups.

    ``first_name`` maps the other names of tied parameters to the name ``names`` gives them, so state
    saved under any of a parameter's names reaches it."""
    current = optimizer.state_dict()
    first = first_name or {}
    name_to_index: dict[str, int] = {}
    for group_sd, group in zip(current["param_groups"], optimizer.param_groups):
        for idx, p in zip(group_sd["params"], group["params"]):
            name_to_index[names[id(p)]] = idx
    new_state: dict[int, Any] = {}
    for n, s in state.items():  # a tied parameter's state under any of its names, once
        idx = name_to_index.get(first.get(n, n))
        if idx is not None:
            new_state.setdefault(idx, s)
    groups = []
    for group_sd in current["param_groups"]:
        mine = {n for n, i in name_to_index.items() if i in group_sd["params"]}
        best = max(saved_groups, key=lambda g: len(mine & {first.get(n, n) for n in g["params"]}), default=None)
        merged = dict(group_sd)
        if best is not None and mine & {first.get(n, n) for n in best["params"]}:
            merged.update({k: v for k, v in best.items() if k != "params"})
        groups.append(merged)
    return {"state": new_state, "param_groups": groups}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(tuple(state["numpy"]) if isinstance(state["numpy"], list) else state["numpy"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]) if isinstance(py, (list, tuple)) else py)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def to_sharded(
    checkpoint: dict[str, Any],
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    global_rank: int,
    position: int,
    replica: int,
    fp8: Mapping[str, FP8Slot] | None = None,
) -> dict[str, Any]:
    """This rank's part of the sharded state, from Lightning's checkpoint dict; ``fp8``: this rank's
    fp8 scaling state (:func:`~lightning_hpp.precision.fp8_slots.fp8_slots`)."""
    names = param_names(module)
    state: dict[str, Any] = {"rank": {str(global_rank): rng_state()}}
    if fp8:
        saved = fp8_state(fp8)
        if saved:
            state[STATE_KEY] = {f"dp{replica}": saved}
    if replica == 0 or is_sharded(module):  # a sharded stage: every rank writes its own shards
        model = dict(checkpoint["state_dict"])
        tied: dict[str, str] = {}
        for names_of in tensor_aliases(module).values():  # a tied tensor once, under its first name
            if names_of[0] in model:
                for alias in names_of[1:]:
                    if model.pop(alias, None) is not None:
                        tied[alias] = names_of[0]
        for key in te_extra_state_keys(fp8 or {}):  # TE's pickle: its content is under fp8/ instead
            model.pop(key, None)
        state["model"] = model
        optim, groups = {}, {}
        for i, opt in enumerate(optimizers):
            optim[str(i)], groups[str(i)] = optimizer_to_named(opt, names)
        state["optim"] = optim
        # one top-level entry per position: a tensor-free subtree is stored as one JSON value
        state[f"position_pp{position}"] = {
            "param_groups": groups,
            "lr_schedulers": list(checkpoint.get("lr_schedulers", [])),
            TIED: tied,
        }
    if global_rank == 0:
        state["trainer"] = {k: v for k, v in checkpoint.items() if k not in _SPLIT and k not in _TOP}
        for k in _TOP:
            if k in checkpoint:
                state[k] = checkpoint[k]
    return state


def _state_template(
    param: torch.Tensor | None, saved_keys: Collection[tuple], i: int, name: str
) -> dict[str, Any] | None:
    """What a parameter's optimizer state is asked for as: ``None`` (whatever was saved, whole) for a
    plain parameter; for a DTensor one, each saved entry of the parameter's shape as a DTensor laid out
    like it, so that each rank reads only its own shards (scalars such as Adam's ``step`` whole)."""
    if not isinstance(param, DTensor) or not isinstance(saved_keys, Mapping):
        return None
    entries = {k[3]: info for k, info in saved_keys.items() if len(k) == 4 and k[:3] == ("optim", str(i), name)}
    return {
        key: torch.empty_like(param.detach(), dtype=info.dtype)
        if info.kind == "tensor" and info.shape == tuple(param.shape)
        else None
        for key, info in entries.items()
    }


def load_template(
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    saved_keys: Collection[tuple] | Mapping[tuple, KeyInfo],
    fp8_extra_states: Collection[str] = (),
) -> dict[str, Any]:
    """What this rank asks a checkpoint for: its own parameters and whatever else exists.

    ``saved_keys``: what the checkpoint holds (:func:`~lightning_hpp.checkpoint.dcp_index.checkpoint_keys`);
    with their shapes, the optimizer state of DTensor parameters is asked for shard by shard.
    ``_extra_state`` entries are asked for whole (any shape), when saved; those in ``fp8_extra_states``
    (Transformer Engine's, whose content is under ``fp8/``) are not asked for otherwise."""
    names = param_names(module)
    params = dict(module.named_parameters(remove_duplicate=False))
    aliases = tensor_aliases(module)
    tops = {k[0] for k in saved_keys}
    model = dict(module.state_dict())
    saved_model = {k[1] for k in saved_keys if len(k) > 1 and k[0] == "model"}
    for key in [k for k in model if is_extra_state(k)]:
        if key in saved_model:
            model[key] = None  # whatever was saved: checked for pickles by from_sharded
        elif key in fp8_extra_states:
            del model[key]
    for first, names_of in aliases.items():  # a tied tensor: asked for once, under the name it was saved as
        if first not in model:
            continue
        tensor = model[first]
        for alias in names_of:
            model.pop(alias, None)
        model[_saved_name(names_of, saved_model)] = tensor
    template: dict[str, Any] = {"model": model}
    optim: dict[str, Any] = {}
    for i, opt in enumerate(optimizers):
        present = {k[2] for k in saved_keys if len(k) > 2 and k[0] == "optim" and k[1] == str(i)}
        wanted: set[str] = set()
        for g in opt.param_groups:
            for p in g["params"]:
                n = names[id(p)]
                if n in present:
                    wanted.add(n)
                elif n in aliases:
                    other = _saved_name(aliases[n], present)
                    if other in present:
                        wanted.add(other)
        optim[str(i)] = {n: _state_template(params.get(n), saved_keys, i, n) for n in sorted(wanted)}
    if optim:
        template["optim"] = optim
    for k in tops:
        if k.startswith("position_") or k in ("rank", "trainer", *_TOP):
            template[k] = None
    return template


def from_sharded(
    loaded: dict[str, Any],
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    global_rank: int,
    position: int,
    fp8_extra_states: Collection[str] = (),
    url: str = "<checkpoint>",
) -> dict[str, Any]:
    """A Lightning checkpoint dict for this rank, from what :func:`load_template` loaded (from ``url``).

    The entries of ``fp8_extra_states`` become ``None``, which Transformer Engine's ``set_extra_state`` ignores.

    Raises:
        CheckpointError: an ``_extra_state`` entry holds a pickle.
    """
    names = param_names(module)
    first = _first_name(module)
    positions = {k[len("position_") :]: v for k, v in loaded.items() if k.startswith("position_") and v}
    mine = positions.get(f"pp{position}") or positions.get("pp0") or {}
    all_groups: dict[str, list] = {}
    for entry in positions.values():
        for i, groups in (entry.get("param_groups") or {}).items():
            all_groups.setdefault(i, []).extend(groups)
    checkpoint: dict[str, Any] = dict(loaded.get("trainer") or {})
    for k in _TOP:
        if k in loaded:
            checkpoint[k] = loaded[k]
    model = dict(loaded["model"])
    for key, value in model.items():
        if is_extra_state(key) and holds_pickle(value):
            raise pickle_refused(f"model/{key}", url)
    for key in fp8_extra_states:
        model[key] = None
    current = module.state_dict(keep_vars=True)
    for names_of in tensor_aliases(module).values():  # a tied tensor under every name this rank has for it
        value = next((model[n] for n in names_of if n in model), None)
        if value is not None:
            for alias in names_of:
                if alias in current:
                    model[alias] = value
    checkpoint["state_dict"] = model
    checkpoint["optimizer_states"] = [
        optimizer_from_named(
            opt, names, (loaded.get("optim") or {}).get(str(i)) or {}, all_groups.get(str(i), []), first
        )
        for i, opt in enumerate(optimizers)
    ]
    checkpoint["lr_schedulers"] = list(mine.get("lr_schedulers", []))
    rng = (loaded.get("rank") or {}).get(str(global_rank))
    if rng is not None:
        checkpoint["hpp_rng"] = rng
    return checkpoint


def save_lightning_checkpoint(
    checkpoint: dict[str, Any],
    url: str,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    global_rank: int,
    position: int,
    replica: int,
    extra: dict[str, Any],
    step_dir: str | None,
    keep_last: int | None,
    async_save: bool,
    on_error: str,
    protect: list[str],
    fp8: Mapping[str, FP8Slot] | None = None,
) -> None:
    """Write this rank's part of Lightning's ``checkpoint`` as one sharded checkpoint at ``url`` (collective).

    Args:
        extra: Facts for ``metadata.json`` (plan, metrics, fingerprints, hyperparameters).
        step_dir: The directory of the strategy's own ``step-<N>`` checkpoints; retention
            (``keep_last``) applies only to checkpoints written there.
        protect: Checkpoints retention must keep (the one the run resumed from).
        fp8: This rank's fp8 scaling state (:func:`~lightning_hpp.precision.fp8_slots.fp8_slots`).
    """
    state = to_sharded(
        checkpoint, module, optimizers, global_rank=global_rank, position=position, replica=replica, fp8=fp8
    )
    in_dir = step_dir is not None and url.rstrip("/").rsplit("/", 1)[0] == step_dir.rstrip("/")
    retention = Retention(keep_last=keep_last) if keep_last is not None and in_dir else None
    save_sharded(
        state,
        url,
        step=int(checkpoint.get("global_step", 0)),
        extra_metadata=extra,
        async_save=async_save,
        on_error=on_error,
        retention=retention,
        protect=protect,
    )


def load_lightning_checkpoint(
    url: str,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    global_rank: int,
    position: int,
    replica: int = 0,
    fp8: Mapping[str, FP8Slot] | None = None,
) -> dict[str, Any]:
    """This rank's part of the sharded checkpoint at ``url``, as Lightning's checkpoint dict (collective);
    whatever plan, frontend, pp or dp degree wrote it.

    The fp8 scaling state of ``fp8`` (this rank's slots, data-parallel ``replica``) is put back into
    the live layers here, as the parameters are filled in place."""
    slots = fp8 or {}
    saved = checkpoint_keys(url)
    extra_states = te_extra_state_keys(slots)
    template = load_template(module, optimizers, saved, extra_states)
    wanted = fp8_template(slots, saved, replica)
    if wanted:
        template[STATE_KEY] = wanted
    loaded = load_sharded(url, template)
    checkpoint = from_sharded(
        loaded, module, optimizers, global_rank=global_rank, position=position, fp8_extra_states=extra_states, url=url
    )
    restore_fp8_state(slots, loaded.get(STATE_KEY), repr(url))
    return checkpoint
