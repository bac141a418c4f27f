"""The profile cache: a profile file reused while it matches the model, measured and updated otherwise."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_hpp.planning.devices import normalize_kind
from lightning_hpp.planning.measure import as_args, input_shapes, model_signature_counts, profile_units
from lightning_hpp.planning.plan import normalize_precision
from lightning_hpp.planning.profile import CostProfile

log = logging.getLogger(__name__)

def load_or_profile(
    path: str | os.PathLike,
    units: Sequence[tuple[str, nn.Module]],
    example_input: Any,
    device_kind: str,
    precision: str = "32-true",
    model_name: str | None = None,
    **kwargs: Any,
) -> CostProfile:
    """Return the cached profile at ``path`` when it matches, else measure and update the file.

    A cached file matches when its signature (model name, unit names, parameter counts, input
    shapes) equals the model's and it has an entry for ``(device_kind, precision)``. With the same
    signature but without that entry, the new measurement is added to the file; with another
    signature the file is replaced (and a warning is logged).

    Args:
        path: JSON file of the cache.
        units, example_input, device_kind, precision, model_name: As for :func:`profile_units`.
        **kwargs: ``repeats`` and ``warmup`` for :func:`profile_units`.

    Returns:
        A profile that holds at least the requested entry.

    Raises:
        ProfileError: the file exists but is not a profile (it is not overwritten), or the
            measurement fails (see :func:`profile_units`).
    """
    path = os.fspath(path)
    kind = normalize_kind(device_kind, "`load_or_profile` device_kind")
    prec = normalize_precision(precision, "`load_or_profile`") or "32-true"
    units = list(units)
    wanted = {
        "model": model_name or "model",
        "units": [[n, c] for (n, _), c in zip(units, model_signature_counts(units))],
        "input_shapes": input_shapes(as_args(example_input)),
    }
    cached = CostProfile.load(path) if os.path.exists(path) else None
    if cached is not None and cached.signature == wanted and cached.get(kind, prec) is not None:
        return cached
    fresh = profile_units(units, example_input, kind, prec, model_name=model_name, **kwargs)
    if cached is not None and cached.signature == wanted:
        fresh = cached.merge(fresh)
    elif cached is not None:
        log.warning(
            "Cost profile %s was made for another model or input shape (%s); replacing it.",
            path,
            cached.signature,
        )
    fresh.save(path)
    return fresh
