"""Checks of user-given values, shared by every option section, plan, callback and ``HPPPrecision``.

Each check names the value the way the user wrote it (``what``, e.g. ``"CheckpointOptions(keep_last=...)"``
or ``"n_microbatches"``), prints the offending value with ``!r``, and raises the error class of the
caller's concern (``error=CheckpointError``, ``error=TelemetryError``, ...), so a message says
what was wrong, where, and what to pass instead. ``bool`` is never accepted as a number (``True``
is an ``int`` to Python, never to a user).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from lightning_hpp.errors import PlanError


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _label(what: str, value: Any) -> str:
    if what.endswith("=...)"):  # "Section(field=...)" -> "`Section(field=<value>)`"
        return f"`{what[:-4]}{value!r})`"
    return f"`{what}={value!r}`" if "`" not in what else f"{what} ({value!r})"


def _tail(optional: bool, hint: str) -> str:
    return f"{' or None' if optional else ''}." + (f" {hint}" if hint else "")


def check_int(value: Any, what: str, *, minimum: int | None = 1, maximum: int | None = None, optional: bool = False,
              error: type[Exception] = PlanError, hint: str = "") -> Any:
    """``value`` if it is an integer in ``[minimum, maximum]`` (``None`` too when ``optional``); else ``error``.

    Args:
        value: The value given.
        what: How the user wrote it: ``"CheckpointOptions(keep_last=...)"`` or a plain name.
        minimum: The smallest value allowed (``None``: no lower bound).
        maximum: The largest value allowed (``None``: no upper bound).
        optional: ``None`` is allowed (and returned).
        error: The error class of the caller's concern.
        hint: A sentence appended to the message (the fix, an example).
    """
    if value is None and optional:
        return None
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            kind = f"an integer in [{minimum}, {maximum}]"
        elif maximum is not None:
            kind = f"an integer <= {maximum}"
        elif minimum == 1:
            kind = "a positive integer"
        elif minimum is None:
            kind = "an integer"
        else:
            kind = f"an integer >= {minimum}"
        raise error(f"{_label(what, value)}: must be {kind}{_tail(optional, hint)}")
    return value


def check_number(
    value: Any,
    what: str,
    *,
    minimum: float | None = 0.0,
    strict: bool = True,
    maximum: float | None = None,
    optional: bool = False,
    error: type[Exception] = PlanError,
    hint: str = "",
) -> Any:
    """``value`` if it is a number above ``minimum`` (``>=`` when not ``strict``) and at most ``maximum``
    (``None`` too when ``optional``); else ``error``. Arguments as for :func:`check_int`.

    Infinite and NaN values are refused unless ``minimum`` is ``None`` (then only NaN is).
    """
    if value is None and optional:
        return None
    ok = is_number(value) and value == value
    if ok and minimum is not None:
        ok = (value > minimum if strict else value >= minimum) and value != float("inf")
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        if minimum is not None and maximum is not None:
            kind = f"a number in {'(' if strict else '['}{minimum}, {maximum}]"
        elif maximum is not None:
            kind = f"a number <= {maximum}"
        elif minimum is None:
            kind = "a number"
        elif minimum == 0:
            kind = "a positive number" if strict else "a number >= 0"
        else:
            kind = f"a number {'>' if strict else '>='} {minimum}"
        raise error(f"{_label(what, value)}: must be {kind}{_tail(optional, hint)}")
    return value


def check_bool(
    value: Any, what: str, *, optional: bool = False, error: type[Exception] = PlanError, hint: str = ""
) -> Any:
    """``value`` if it is ``True`` or ``False`` (or ``None`` when ``optional``); arguments as for :func:`check_int`."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        kind = "True, False or None" if optional else "True or False"
        raise error(
            f"{_label(what, value)}: must be {kind} (not a {type(value).__name__})." + (f" {hint}" if hint else "")
        )
    return value


def check_choice(
    value: Any,
    what: str,
    choices: Iterable[Any],
    *,
    optional: bool = False,
    error: type[Exception] = PlanError,
    hint: str = "",
) -> Any:
    """``value`` if it is one of ``choices`` (or ``None`` when ``optional``); arguments as for :func:`check_int`."""
    allowed = tuple(choices)
    if value is None and optional:
        return None
    try:
        ok = value in allowed
    except TypeError:  # an unhashable value against a set-like container
        ok = False
    if not ok:
        raise error(
            f"{_label(what, value)} is not supported; use one of {', '.join(map(repr, allowed))}{_tail(optional, hint)}"
        )
    return value


def check_path(
    value: Any,
    what: str,
    *,
    optional: bool = False,
    error: type[Exception] = PlanError,
    kind: str = "a path or URL",
    hint: str = "",
) -> Any:
    """``value`` as a string if it is a non-empty ``str`` or ``os.PathLike`` (or ``None`` when ``optional``).

    ``kind`` says what the path names (``"the path of a cost-profile JSON"``); the other arguments as for
    :func:`check_int`.
    """
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise error(f"{_label(what, value)}: must be {kind}{_tail(optional, hint)}")
    return os.fspath(value)
