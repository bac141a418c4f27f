"""fp8 scaling state in checkpoints, as tensors and JSON: never a pickle.

A delayed-scaling fp8 GEMM carries its amax history (and, in Transformer Engine, the scales taken
from it) from one step to the next; a resume that loses it restarts the scaling from scratch and no
longer matches an uninterrupted run. Neither backend's own state fits a checkpoint: the emulation
keeps its histories in non-persistent buffers (absent from ``state_dict``, so that an emulated layer
has the keys of ``nn.Linear``) or, on a traced stage, outside the modules; Transformer Engine
returns its state from ``get_extra_state`` as an empty tensor before the first fp8 forward and as
pickled bytes after it (so the load template of a fresh model has another shape than the saved
entry), and its ``set_extra_state`` unpickles what the checkpoint holds.

Every owner of fp8 scaling state on a rank is one :class:`FP8Slot`
(:func:`lightning_hpp.precision.fp8_slots.fp8_slots` finds them; the layer that knows the fp8 modules), saved under
the checkpoint's ``fp8`` entry per data-parallel replica (the emulation's amaxes are the replica's
own; Transformer Engine's, reduced over the replicas, are equal)::

    fp8/dp<r>/<owner>/amax_history       float32 (rows, 3)   emulation; rows: amax_history_len
                                                             (delayed) or 1 (current); columns:
                                                             input, weight, grad_output
    fp8/dp<r>/<owner>/scale_fwd          float32 (3n,)       Transformer Engine, delayed scaling, a
    fp8/dp<r>/<owner>/scale_inv_fwd      float32 (3n,)       module of n GEMMs: forward input, weight,
    fp8/dp<r>/<owner>/amax_history_fwd   float32 (len, 3n)   output; backward grad_output,
    fp8/dp<r>/<owner>/scale_bwd          float32 (2n,)       grad_input (TE's order)
    fp8/dp<r>/<owner>/scale_inv_bwd      float32 (2n,)
    fp8/dp<r>/<owner>/amax_history_bwd   float32 (len, 2n)
    fp8/dp<r>/<owner>/meta               JSON: "backend", "recipe" (format, scaling, margin,
                                         amax_history_len, amax_compute_algo); for TE "initialized"
                                         and "extra_fp8_variables" (TE's plain fp8_meta values)

``<owner>`` is the module's name for an fp8 module (:class:`~lightning_hpp.precision.fp8_emulation.EmulatedFP8Linear`,
a Transformer Engine module) and the weight's parameter name for a traced stage's emulated GEMM
(:class:`~lightning_hpp.precision.fp8_emulation.EmulatedFP8Mode`). The emulation's scale is computed from its
history at every call, so the history is its whole state. The layout follows from the recipe and the
module type alone: a Transformer Engine module that has not run an fp8 forward yet (TE allocates its
tensors then) is saved with the values TE starts from (scale 1, zero history) and
``"initialized": false``, so a load template built from a fresh model has the saved keys and shapes.
An entry saved under another backend or recipe is not restored (the scaling starts afresh, with a
warning); a missing one neither.

Transformer Engine's extra state, the dict its ``get_extra_state`` pickles
(``TransformerEngineBaseModule.get_extra_state`` in ``transformer_engine/pytorch/module/base.py``;
TE 2.x, checked against 2.20.0.dev0), is::

    {"recipe": DelayedScaling(margin=..., fp8_format=Format.HYBRID, amax_history_len=..., ...),
     "scale_fwd": (3n,), "amax_history_fwd": (len, 3n),      # delayed scaling only
     "scale_bwd": (2n,), "amax_history_bwd": (len, 2n),      # (TE 1.x: also "scale_inv_fwd" and
     "extra_fp8_variables": {fp8_meta entries of type bool,  #  "scale_inv_bwd", and no "recipe")
                             int, float, str, tuple, list}}

:func:`~lightning_hpp.precision.fp8_slots.te_extra_state_to_data` and
:func:`~lightning_hpp.precision.fp8_slots.te_extra_state_from_data` convert between it and the layout above. The live
state is read from the module's ``fp8_meta`` directly (what ``get_extra_state`` reads,
without pickling it) and put back the way ``set_extra_state`` does once it has unpickled: update
``fp8_meta``, ``init_fp8_meta_tensors``, copy the scales and histories in place (TE's quantizers hold
views of them). Transformer Engine's own ``_extra_state`` entries are left out of the saved model
and handed to ``load_state_dict`` as ``None`` (which TE ignores). Nothing here imports Transformer
Engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_hpp.checkpoint.dcp_index import KeyInfo
from lightning_hpp.checkpoint.warning import warn_checkpoint
from lightning_hpp.errors import CorruptCheckpointError

STATE_KEY = "fp8"
"""The checkpoint's top-level entry for fp8 scaling state."""


class FP8Slot:
    """One owner of fp8 scaling state on this rank: what it saves, asks a checkpoint for, and restores.

    Attributes:
        name: Its key under ``fp8/dp<r>/`` (a module name, or a traced stage's weight name).
        backend: ``"emulate"`` or ``"te"``.
        recipe: The recipe it runs; ``fields``: its JSON form (the fields that decide its scaling and the
            layout of its state), compared with a saved entry's.
    """

    backend = ""

    def __init__(self, name: str, recipe: Any, fields: dict[str, Any]) -> None:
        self.name, self.recipe, self.fields = name, recipe, fields

    def present(self) -> bool:
        """Whether it has state to save (a traced stage's weight has none before its first GEMM)."""
        return True

    def state(self) -> dict[str, Any]:
        """What is saved: its tensors (live ones, or CPU copies) and ``"meta"``."""
        raise NotImplementedError

    def layout(self) -> dict[str, tuple[int, ...]] | None:
        """The shapes of its tensors, from the recipe and the module type (``None``: not known)."""
        raise NotImplementedError

    def restore(self, data: Mapping[str, Any]) -> None:
        """Put back what :meth:`state` saved (``data`` already checked by :meth:`refusal`)."""
        raise NotImplementedError

    def extra_state_key(self) -> str | None:
        """The ``state_dict`` name of the module's own ``_extra_state`` this slot carries instead (``None``: none)."""
        return None

    def meta(self) -> dict[str, Any]:
        return {"backend": self.backend, "recipe": self.fields}

    def refusal(self, data: Any) -> str | None:
        """Why ``data`` (a loaded entry) is not restored into this slot, or ``None``.

        Raises:
            CorruptCheckpointError: an entry of the right backend and recipe with wrong tensors.
        """
        meta = data.get("meta") if isinstance(data, dict) else None
        if not isinstance(meta, dict):
            raise CorruptCheckpointError(f"fp8 state {self.name!r} has no 'meta' entry.")
        if meta.get("backend") != self.backend:
            return f"it was saved by the fp8 backend {meta.get('backend')!r} and this run uses {self.backend!r}"
        if meta.get("recipe") != self.fields:
            return f"it was saved with the recipe {meta.get('recipe')} and this run uses {self.fields}"
        if meta.get("initialized", True):
            want = self.layout()
            got = {k: tuple(v.shape) for k, v in data.items() if isinstance(v, torch.Tensor)}
            if want is not None and got != want:
                raise CorruptCheckpointError(f"fp8 state {self.name!r} holds tensors {got}; its recipe gives {want}.")
        return None


def te_extra_state_keys(slots: Mapping[str, FP8Slot]) -> set[str]:
    """The ``state_dict`` names of the Transformer Engine ``_extra_state`` entries that ``slots`` carry instead."""
    return {key for s in slots.values() if (key := s.extra_state_key()) is not None}


# --------------------------------------------------------------------------------------- save / load
def fp8_state(slots: Mapping[str, FP8Slot]) -> dict[str, Any]:
    """What a rank saves under ``fp8/dp<r>``: each present slot's :meth:`FP8Slot.state`."""
    return {name: s.state() for name, s in slots.items() if s.present()}


def _section(saved: Mapping[tuple, KeyInfo], replica: int) -> str | None:
    sections = {k[1] for k in saved if len(k) > 1 and k[0] == STATE_KEY}
    return next((s for s in (f"dp{replica}", "dp0") if s in sections), None)


def fp8_template(slots: Mapping[str, FP8Slot], saved: Mapping[tuple, KeyInfo], replica: int) -> dict[str, Any]:
    """What a rank asks a checkpoint for under ``fp8``: its replica's section (else replica 0's).

    Each slot the checkpoint holds is asked for with tensors of its :meth:`FP8Slot.layout` when the
    saved shapes are those, else whole (``None``: another recipe, restored by nobody).

    Args:
        slots: This rank's slots.
        saved: ``checkpoint_keys(url)``.
        replica: This rank's data-parallel replica.

    Returns:
        ``{"dp<r>": {name: template}}``, or ``{}`` if the checkpoint holds no fp8 state for ``slots``.
    """
    section = _section(saved, replica)
    if section is None:
        return {}
    entries: dict[str, dict[tuple, KeyInfo]] = {}
    for key, info in saved.items():
        if len(key) > 2 and key[:2] == (STATE_KEY, section) and key[2] in slots:
            entries.setdefault(key[2], {})[key[3:]] = info
    wanted: dict[str, Any] = {}
    for name, found in entries.items():
        layout = slots[name].layout()
        tensors = {k[0]: info.shape for k, info in found.items() if info.kind == "tensor" and len(k) == 1}
        if layout and tensors == layout:
            wanted[name] = {**{k: torch.empty(shape) for k, shape in layout.items()}, "meta": None}
        else:
            wanted[name] = None
    return {section: wanted} if wanted else {}


def restore_fp8_state(slots: Mapping[str, FP8Slot], loaded: Mapping[str, Any] | None, source: str) -> list[str]:
    """Put the loaded fp8 state back into this rank's slots; warn about those it leaves afresh.

    Args:
        slots: This rank's slots.
        loaded: What :func:`fp8_template` loaded (``{"dp<r>": {name: data}}``), or ``None``.
        source: The checkpoint, for messages.

    Returns:
        The names restored.

    Raises:
        CorruptCheckpointError: an entry of the right backend and recipe with wrong tensors.
    """
    data = next(iter((loaded or {}).values()), None) or {}
    restored, refused = [], []
    for name, slot in slots.items():
        entry = data.get(name)
        if entry is None:
            continue
        reason = slot.refusal(entry)
        if reason is None:
            slot.restore(entry)
            restored.append(name)
        else:
            refused.append(f"{name!r} ({reason})")
    missing = [repr(name) for name, slot in slots.items() if slot.present() and name not in data]
    if missing:
        warn_checkpoint(
            f"{source} holds no fp8 scaling state for {len(missing)} fp8 layer(s) of this rank: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Their scaling starts afresh (the "
            f"checkpoint was saved by a run where they were not fp8, or by an older version)."
        )
    if refused:
        warn_checkpoint(
            f"{source}: the fp8 scaling state of {len(refused)} layer(s) is not restored, their scaling "
            f"starts afresh: {'; '.join(refused[:4])}{' ...' if len(refused) > 4 else ''}."
        )
    return restored
