"""``torch.compile`` per block, as torchtitan applies it: each block of a stage compiled on its own (after tensor
parallel splits it and before FSDP2 shards it), so a stage's graph breaks stay at block boundaries, the compiled
code is reused by every block of one shape, and FSDP2's per-block all-gathers stay outside the compiled regions.

:func:`compiled_names` finds what to compile: the model's blocks (``HPPStrategy(compile=True)``), and the modules
the user compiled in place (``nn.Module.compile()``), which a traced stage would otherwise run from the eager graph
it captured. :func:`compile_blocks` compiles those a stage holds (the user's modules on the sequential frontend,
the captured graph's submodules of the same names on the traced one). Forward-only passes of traced stages run
their own captures, eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from lightning_hpp.errors import PlanError

OPTION_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")
"""The ``torch.compile`` keyword arguments ``HPPStrategy(compile={...})`` passes on."""


def compile_options(value: Any) -> dict[str, Any] | None:
    """``HPPStrategy(compile=...)`` as ``torch.compile`` keyword arguments (``None``: off).

    Raises:
        PlanError: neither a bool nor a dict of :data:`OPTION_KEYS`.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict) and all(k in OPTION_KEYS for k in value):
        return dict(value)
    raise PlanError(f"`HPPStrategy(compile={value!r})`: give True (torch.compile's defaults), False, or a dict of "
                    f"torch.compile's keyword arguments ({', '.join(OPTION_KEYS)}), e.g. {{'backend': 'inductor'}}.")


def user_compiled(module: nn.Module) -> list[str]:
    """The modules of ``module`` compiled in place by their ``compile()`` (by name)."""
    return [n for n, m in module.named_modules() if n and getattr(m, "_compiled_call_impl", None) is not None]


@contextlib.contextmanager
def eager(module: nn.Module) -> Iterator[list[str]]:
    """While inside, the modules the user compiled in place run eagerly (the cut captures what they compute, not a
    compiled call inside ``torch.export``); yields their names, compiled again afterwards."""
    names = user_compiled(module)
    modules = dict(module.named_modules())
    saved = {n: modules[n]._compiled_call_impl for n in names}
    for n in names:
        modules[n]._compiled_call_impl = None
    try:
        yield names
    finally:
        for n, impl in saved.items():
            modules[n]._compiled_call_impl = impl


def compile_blocks(stages: dict[int, nn.Module], names: Iterable[str], root: nn.Module,
                   options: dict[str, Any]) -> list[str]:
    """``module.compile(**options)`` on every module of ``names`` that one of ``stages`` holds (deepest first: a
    compiled block is not compiled again inside its parent). Returns the names compiled.

    The sequential frontend's stages hold the user's modules (looked up in ``root``); a traced stage holds its
    captured graph's submodules under the same names.
    """
    done: list[str] = []
    seen: set[int] = set()
    wanted = sorted(dict.fromkeys(names), key=lambda n: -n.count("."))
    for sm in stages.values():
        units = list(getattr(sm, "units", []))
        graph = getattr(units[0], "graph", None) if getattr(sm, "captured", False) and units else None
        lookup = dict((graph if graph is not None else root).named_modules())
        held = {id(m) for m in sm.modules()}
        for name in wanted:
            mod = lookup.get(name)
            if mod is None or id(mod) not in held or id(mod) in seen:
                continue
            if any(id(m) in seen for m in mod.modules()):
                continue  # a part of it is compiled already
            mod.compile(**options)
            seen.add(id(mod))
            done.append(name)
    return sorted(done)
