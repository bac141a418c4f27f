"""What a traced capture allows of its inputs' shapes: :class:`InputDims`.

The traced frontend (:mod:`lightning_hpp.model.traced`) captures every dimension of every tensor input as
``torch.export``'s ``Dim.AUTO``: the dimensions the model lets vary (the batch, a sequence padded to each batch's
longest) stay symbolic, those the model fixes are specialised. :class:`InputDims` keeps which is which, the ranges
and torch.export's guards, and checks each new set of input shapes before the first stage runs, so that a batch the
capture cannot run is refused with a :class:`~lightning_hpp.errors.ShapeError` naming the input, the dimension,
both shapes and the fix, instead of failing inside a stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_hpp.errors import ShapeError
from lightning_hpp.validation import is_int


@dataclass
class InputDims:
    """Which dimensions of the model's flat inputs the capture left free, and the sizes it allows.

    Attributes:
        names: Each flat input's name in the capture (the ``forward`` argument it comes from).
        captured: Each tensor input's shape in the capture (``None`` for other inputs).
        dims: Per tensor input and dimension, the size the capture fixed (an ``int``) or the name of its
            symbol (a ``str``: free; dimensions sharing a symbol must be equal); ``None`` for other inputs.
        ranges: A symbol's smallest and largest size (``None``: unbounded).
        note: Why no dimension but the batch is free (the capture with every dimension free failed), or ``""``.
        guards: torch.export's checks of the flat inputs (the unlifted program's ``_guards_fn``: the conditions on
            sizes the model's code took a path by, ``ids.size()[1] % 3 == 0``), one per capture.
    """

    names: list[str]
    captured: list[tuple[int, ...] | None]
    dims: list[tuple[int | str, ...] | None]
    ranges: dict[str, tuple[int, int | None]]
    note: str = ""
    guards: list[Callable[..., None]] = field(default_factory=list, repr=False)
    _seen: set = field(default_factory=set, repr=False)

    @classmethod
    def of(cls, ep: Any, flat: list[Any], note: str = "") -> InputDims:
        """The input dimensions of the exported program ``ep`` of the example inputs ``flat``."""
        user = {spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind.name == "USER_INPUT"}
        nodes = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
        ranges = {str(sym): (_bound(vr.lower) or 0, _bound(vr.upper)) for sym, vr in ep.range_constraints.items()}
        names, captured, dims = [], [], []
        for i, value in enumerate(flat):
            node = nodes[i] if i < len(nodes) else None
            names.append(node.name if node is not None else f"input {i}")
            val = node.meta.get("val") if node is not None else None
            if not isinstance(value, torch.Tensor) or not isinstance(val, torch.Tensor):
                captured.append(None)
                dims.append(None)
                continue
            captured.append(tuple(value.shape))
            dims.append(tuple(_dim(d) for d in val.shape))
        guards = getattr(ep.module(), "_guards_fn", None)
        return cls(names, captured, dims, ranges, note, [guards] if guards is not None else [])

    def merged(self, other: InputDims | None) -> InputDims:
        """A dimension fixed in either capture (training and evaluation mode) is fixed."""
        if other is None or len(other.dims) != len(self.dims):
            return self
        dims = [a if b is None or a is None else tuple(x if isinstance(x, int) else y for x, y in zip(a, b))
                for a, b in zip(self.dims, other.dims)]
        return InputDims(self.names, self.captured, dims, {**other.ranges, **self.ranges}, self.note or other.note,
                         [*self.guards, *other.guards])

    def check(self, flat: list[Any] | tuple) -> None:
        """Refuse inputs the capture cannot run (once per set of shapes).

        Dimension 0, the batch, is left to the micro-batch split (``flat`` holds the whole batch's inputs).

        Raises:
            ShapeError: a fixed dimension of another size, a size out of the captured range, or two dimensions
                the capture ties that differ; naming the input, the dimension, both shapes and the fix.
        """
        key = tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in flat)
        if key in self._seen:
            return
        tied: dict[str, tuple[str, int, int]] = {}
        for name, shape, want, dims in zip(self.names, key, self.captured, self.dims):
            if shape is None or dims is None:
                continue
            if len(shape) != len(dims):
                raise ShapeError(f"Input `{name}` of `self(...)` has shape {shape}, but the traced model was captured "
                                 f"with {want}: a different number of dimensions. Pass inputs of the captured rank.")
            for d, (size, dim) in enumerate(zip(shape, dims)):
                if d == 0:  # the batch: split into micro-batches after this check, the capture saw one of them
                    continue
                if isinstance(dim, int):
                    if size != dim:
                        raise ShapeError(self._fixed(name, d, dim, shape, want))
                    continue
                lo, hi = self.ranges.get(dim, (0, None))
                if size < lo or (hi is not None and size > hi):
                    allowed = f"{lo}..{'' if hi is None else hi}"
                    why = "sizes 0 and 1 are special to torch.export" if size < lo else "a bound the model sets"
                    raise ShapeError(
                        f"Dim {d} of input `{name}` is {size} in this batch (shape {shape}; captured with {want}), but "
                        f"the traced model allows {allowed} there ({why}). Fix: keep that dimension within {allowed} "
                        f"(pad or truncate in the collate).")
                first = tied.setdefault(dim, (name, d, size))
                if first[2] != size:
                    raise ShapeError(
                        f"Dim {d} of input `{name}` is {size} but dim {first[1]} of `{first[0]}` is {first[2]} in this "
                        f"batch; the traced model ties them (it combines the two), so they must be equal. Fix: give "
                        f"both inputs the same size there (pad them together in the collate).")
        self._check_guards(flat, key)
        self._seen.add(key)

    def _check_guards(self, flat: list[Any] | tuple, shapes: tuple) -> None:
        # the guards see the inputs with the captured micro-batch's rows (dimension 0 is split later)
        rows = [v[: want[0]] if isinstance(v, torch.Tensor) and want else v for v, want in zip(flat, self.captured)]
        for guards in self.guards:
            try:
                guards(*rows)
            except AssertionError as err:
                condition = str(err).removeprefix("Guard failed: ")
                raise ShapeError(
                    f"The traced model was captured under the condition `{condition}` (torch.export's guard: the "
                    f"model's code took a path that depends on those sizes); this batch's inputs {list(shapes)} break "
                    f"it (the capture saw {self.captured}). Fix: give every batch sizes that keep the condition (pad "
                    f"in the collate, e.g. `pad_to_multiple_of`), or write that code so it does not depend on them."
                ) from None

    def _fixed(self, name: str, d: int, size: int, shape: tuple, want: tuple | None) -> str:
        why = (f" (the capture with every dimension free failed: {self.note}; the batch dimension alone is free)"
               if self.note else " (the model's code needs that size there: a parameter or a reshape of that size, "
               "or a size of 1, which torch.export always fixes)")
        return (f"The traced model fixes dim {d} of input `{name}` to {size}: torch.export specialised it while "
                f"capturing{why}. This batch gives `{name}` the shape {shape}; the capture saw {want}. Fix: pad every "
                f"batch to {size} along dim {d} (in the collate, e.g. `padding='max_length', max_length={size}`), or "
                f"change the model so that the dimension may vary.")


def _dim(size: Any) -> int | str:
    """A captured size: an ``int`` where the capture fixed it, else its symbol's name."""
    if is_int(size):
        return int(size)
    expr = size.node.expr
    return int(expr) if getattr(expr, "is_number", False) else str(expr)


def _bound(value: Any) -> int | None:
    """A sympy bound of a range as an ``int`` (``None``: infinite)."""
    if getattr(value, "is_finite", None) is not True:
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
