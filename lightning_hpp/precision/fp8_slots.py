"""fp8 scaling state as data: the slots of this rank's fp8 modules and Transformer Engine's extra state.

:func:`fp8_slots` finds every owner of fp8 scaling state in a rank's stages (an
:class:`~lightning_hpp.precision.fp8_emulation.EmulatedFP8Linear`, a traced stage's
:class:`~lightning_hpp.precision.fp8_emulation.EmulatedFP8Mode` weight, a Transformer Engine module) as an
:class:`~lightning_hpp.checkpoint.fp8_state.FP8Slot`, which the checkpoint layer saves and restores as
tensors and JSON (the layout is in :mod:`lightning_hpp.checkpoint.fp8_state`); Transformer Engine's
pickled extra state is converted to and from that layout here, without pickling and without importing TE.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_hpp.checkpoint.entries import EXTRA_STATE
from lightning_hpp.checkpoint.fp8_state import FP8Slot
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError
from lightning_hpp.precision.fp8 import te_recipe_of
from lightning_hpp.precision.fp8_emulation import EmulatedFP8Linear, EmulatedFP8Mode
from lightning_hpp.precision.fp8_recipe import FP8Recipe

FORMAT = "HYBRID"
"""e4m3 forward, e5m2 backward (Transformer Engine's ``Format.HYBRID``): the format both backends run."""

_TE_GEMMS = {"Linear": 1, "LayerNormLinear": 1, "LayerNormMLP": 2}  # GEMMs per Transformer Engine module
_DIRECTIONS = (("fwd", 3), ("bwd", 2))  # fp8 tensors per GEMM: input, weight, output / grad_output, grad_input
# process-local fp8_meta entries, dropped (TE's own get_extra_state / set_extra_state drop them too)
_TE_DROPPED = ("buffer_index_and_autocast_key", "global_fp8_buffer_pos_fwd_recompute")


# --------------------------------------------------------------------------------------- recipes
def recipe_fields(recipe: FP8Recipe) -> dict[str, Any]:
    """The JSON form of a recipe: the fields that decide its scaling and the layout of its state."""
    if recipe.scaling == "current":
        return {"format": FORMAT, "scaling": "current"}
    return {"format": FORMAT, "scaling": "delayed", "margin": recipe.margin,
            "amax_history_len": recipe.amax_history_len, "amax_compute_algo": recipe.amax_compute_algo}


def te_recipe_fields(recipe: Any) -> dict[str, Any]:
    """:func:`recipe_fields` of a Transformer Engine recipe object (``DelayedScaling``, ``Float8CurrentScaling``).

    Raises:
        CheckpointError: another recipe, or a delayed one whose ``amax_compute_algo`` is a function.
    """
    kind = type(recipe).__name__
    fmt = getattr(getattr(recipe, "fp8_format", None), "name", None)
    if kind == "Float8CurrentScaling":
        return {"format": fmt, "scaling": "current"}
    if kind == "DelayedScaling" and isinstance(recipe.amax_compute_algo, str):
        return {"format": fmt, "scaling": "delayed", "margin": int(recipe.margin),
                "amax_history_len": int(recipe.amax_history_len), "amax_compute_algo": recipe.amax_compute_algo}
    raise CheckpointError(
        f"Transformer Engine recipe {recipe!r} cannot be saved as data: only `DelayedScaling` (with "
        f"amax_compute_algo 'max' or 'most_recent') and `Float8CurrentScaling` are, the recipes of "
        f"`HPPPrecision(fp8_recipe='delayed' / 'current')`. Use one of those."
    )


# --------------------------------------------------------------------------------------- TE's dict
def te_extra_state_to_data(state: Mapping[str, Any], recipe: Any = None) -> dict[str, Any]:
    """Transformer Engine's extra-state dict (see the module docstring) in this module's layout.

    Args:
        state: The dict TE's ``get_extra_state`` pickles (never unpickled here: built from ``fp8_meta``).
        recipe: The recipe object, for a TE 1.x dict, which has none.

    Returns:
        ``{"scale_fwd": ..., "scale_inv_fwd": ..., "amax_history_fwd": ..., (the same "_bwd"),
        "meta": {...}}`` with CPU float32 copies (``scale_inv`` is ``1 / scale`` where TE keeps none);
        only ``{"meta": ...}`` for current scaling.
    """
    recipe = state.get("recipe", recipe)
    if recipe is None:
        raise CheckpointError("Transformer Engine extra state without a recipe (TE 1.x): pass `recipe=`.")
    fields = te_recipe_fields(recipe)
    data: dict[str, Any] = {}
    if fields["scaling"] == "delayed":
        for d, _ in _DIRECTIONS:
            scale = _f32(state[f"scale_{d}"])
            inverse = state.get(f"scale_inv_{d}")
            data[f"scale_{d}"] = scale
            data[f"scale_inv_{d}"] = _f32(inverse) if inverse is not None else torch.reciprocal(scale)
            data[f"amax_history_{d}"] = _f32(state[f"amax_history_{d}"])
    extra = {k: v for k, v in (state.get("extra_fp8_variables") or {}).items() if k not in _TE_DROPPED and _plain(v)}
    data["meta"] = {"backend": "te", "initialized": True, "recipe": fields, "extra_fp8_variables": extra}
    return data


def te_extra_state_from_data(data: Mapping[str, Any], recipe: Any) -> dict[str, Any]:
    """Transformer Engine's extra-state dict, with ``recipe`` as its recipe object, from this module's layout.

    Raises:
        CheckpointError: ``data`` was saved under another recipe than ``recipe``.
        CorruptCheckpointError: tensors missing or of shapes the recipe does not give.
    """
    meta = data.get("meta") or {}
    fields = te_recipe_fields(recipe)
    if meta.get("recipe") != fields:
        raise CheckpointError(f"fp8 state saved with recipe {meta.get('recipe')} cannot be restored under {fields}.")
    state: dict[str, Any] = {"recipe": recipe, "extra_fp8_variables": dict(meta.get("extra_fp8_variables") or {})}
    if fields["scaling"] != "delayed":
        return state
    for d, per_gemm in _DIRECTIONS:
        try:
            scale, inverse, history = (data[f"{k}_{d}"] for k in ("scale", "scale_inv", "amax_history"))
        except KeyError as exc:
            raise CorruptCheckpointError(f"fp8 state of a Transformer Engine module lacks {exc.args[0]!r}.") from None
        n = scale.shape[0] if scale.dim() == 1 else 0
        rows = fields["amax_history_len"]
        if not n or n % per_gemm or tuple(inverse.shape) != (n,) or tuple(history.shape) != (rows, n):
            raise CorruptCheckpointError(
                f"fp8 state of a Transformer Engine module has scale_{d} {list(scale.shape)}, scale_inv_{d} "
                f"{list(inverse.shape)} and amax_history_{d} {list(history.shape)}; its recipe gives "
                f"({per_gemm}n,) and ({fields['amax_history_len']}, {per_gemm}n)."
            )
        state[f"scale_{d}"], state[f"scale_inv_{d}"], state[f"amax_history_{d}"] = scale, inverse, history
    return state


def _te_live_state(module: nn.Module) -> dict[str, Any]:
    """What ``get_extra_state`` pickles, read from the module's ``fp8_meta`` (CPU copies, no pickle)."""
    meta = module.fp8_meta
    recipe = meta["recipe"]
    state: dict[str, Any] = {"recipe": recipe}
    if type(recipe).__name__ == "DelayedScaling":
        for d, _ in _DIRECTIONS:
            scaling = meta[f"scaling_{d}"]
            state[f"scale_{d}"] = _f32(scaling.scale)
            state[f"amax_history_{d}"] = _f32(scaling.amax_history)
            if getattr(scaling, "scale_inv", None) is not None:  # TE 1.x
                state[f"scale_inv_{d}"] = _f32(scaling.scale_inv)
    state["extra_fp8_variables"] = {k: v for k, v in meta.items() if k != "buffer_index_and_autocast_key"
                                    and isinstance(v, (bool, int, float, str, tuple, list))}
    return state


def _te_apply(module: nn.Module, state: Mapping[str, Any]) -> None:
    """Put ``state`` (TE's dict, already decoded) into the module, as ``set_extra_state`` does after unpickling."""
    meta = module.fp8_meta
    meta.update(state["extra_fp8_variables"])
    meta["recipe"] = state["recipe"]
    meta.pop("global_fp8_buffer_pos_fwd_recompute", None)
    init = module.init_fp8_meta_tensors
    if inspect.signature(init).parameters:  # TE 2.x takes the recipe; 1.x reads fp8_meta["recipe"]
        init(state["recipe"])
    else:
        init()
    if "scale_fwd" in state:
        with torch.no_grad():
            for d, _ in _DIRECTIONS:
                scaling = meta[f"scaling_{d}"]
                scaling.scale.copy_(state[f"scale_{d}"])
                scaling.amax_history.copy_(state[f"amax_history_{d}"])
                if getattr(scaling, "scale_inv", None) is not None:
                    scaling.scale_inv.copy_(state[f"scale_inv_{d}"])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _is_te_module(module: nn.Module) -> bool:
    in_te = type(module).__module__.startswith("transformer_engine")
    return in_te and isinstance(getattr(module, "fp8_meta", None), dict)


def _te_initialized(module: nn.Module) -> bool:
    return bool(getattr(module, "fp8_meta_tensors_initialized", False)) and "recipe" in module.fp8_meta


def _te_gemms(module: nn.Module) -> int | None:
    n = _TE_GEMMS.get(type(module).__name__, getattr(module, "num_gemms", None))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


class _EmulatedSlot(FP8Slot):
    """An :class:`EmulatedFP8Linear`, or one weight of a traced stage's :class:`EmulatedFP8Mode`."""

    backend = "emulate"

    def __init__(self, name: str, recipe: FP8Recipe, holder: Callable[[], nn.Module],
                 present: Callable[[], bool] = lambda: True) -> None:
        super().__init__(name, recipe, recipe_fields(recipe))
        self._holder, self._present = holder, present

    def present(self) -> bool:
        return self._present()

    def state(self) -> dict[str, Any]:
        return {"amax_history": self._holder().amax_history, "meta": self.meta()}

    def layout(self) -> dict[str, tuple[int, ...]]:
        rows = self.recipe.amax_history_len if self.recipe.scaling == "delayed" else 1
        return {"amax_history": (rows, 3)}

    def restore(self, data: Mapping[str, Any]) -> None:
        with torch.no_grad():
            self._holder().amax_history.copy_(data["amax_history"])


class _TESlot(FP8Slot):
    """A Transformer Engine module (a ``TransformerEngineBaseModule``: ``te.Linear`` and the like)."""

    backend = "te"

    def __init__(self, name: str, recipe: FP8Recipe, module: nn.Module) -> None:
        super().__init__(name, recipe, recipe_fields(recipe))
        self.module = module

    def extra_state_key(self) -> str:
        return f"{self.name}.{EXTRA_STATE}" if self.name else EXTRA_STATE

    def layout(self) -> dict[str, tuple[int, ...]] | None:
        gemms = _te_gemms(self.module)
        if self.recipe.scaling != "delayed":
            return {}
        if gemms is None:
            return None
        shapes: dict[str, tuple[int, ...]] = {}
        for d, per_gemm in _DIRECTIONS:
            n = per_gemm * gemms
            rows = self.recipe.amax_history_len
            shapes.update({f"scale_{d}": (n,), f"scale_inv_{d}": (n,), f"amax_history_{d}": (rows, n)})
        return shapes

    def state(self) -> dict[str, Any]:
        if _te_initialized(self.module):
            return te_extra_state_to_data(_te_live_state(self.module))
        # before the first fp8 forward: the values TE starts from, in the layout it will have
        data: dict[str, Any] = {k: (torch.zeros if k.startswith("amax") else torch.ones)(shape)
                                for k, shape in (self.layout() or {}).items()}
        data["meta"] = {**self.meta(), "initialized": False}
        return data

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "initialized": True}

    def restore(self, data: Mapping[str, Any]) -> None:
        if self.recipe.scaling != "delayed":
            return  # current scaling keeps no state between calls (TE saves none for it either)
        if data["meta"].get("initialized", True):
            _te_apply(self.module, te_extra_state_from_data(data, te_recipe_of(self.recipe)))
        elif _te_initialized(self.module) and hasattr(self.module, "reset_fp8_meta_tensors"):
            self.module.reset_fp8_meta_tensors()  # saved before its first fp8 forward: back to TE's start


def fp8_slots(module: nn.Module, recipe: str | FP8Recipe = "delayed",
              emulations: Iterable[EmulatedFP8Mode] = ()) -> dict[str, FP8Slot]:
    """Every owner of fp8 scaling state in ``module`` (this rank's stages), by its name under ``fp8/dp<r>/``.

    Args:
        module: The LightningModule (holding this rank's stages).
        recipe: The recipe of the Transformer Engine stages (emulated layers carry their own).
        emulations: The fp8 emulations of this rank's traced stages: one slot per weight that has an
            amax history, or that its stage holds (:meth:`EmulatedFP8Mode.adopt`), under the weight's
            parameter name.
    """
    rc = FP8Recipe.coerce(recipe)
    slots: dict[str, FP8Slot] = {}
    for name, m in module.named_modules():
        if isinstance(m, EmulatedFP8Linear):
            slots[name] = _EmulatedSlot(name, m.fp8_recipe, lambda m=m: m)
        elif _is_te_module(m):
            slots[name] = _TESlot(name, rc, m)
    params = {id(p): (n, p) for n, p in module.named_parameters()}
    for mode in emulations:
        for key in [*mode.weights, *(k for k in mode._states if k not in mode.weights)]:
            if key not in params or params[key][0] in slots:
                continue
            name, weight = params[key]
            slots[name] = _EmulatedSlot(name, mode.recipe, lambda m=mode, w=weight: m.state_of(w),
                                        lambda m=mode, w=weight: m.has_state(w))
    return slots


# --------------------------------------------------------------------------------------- helpers
def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32, copy=True)


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)
