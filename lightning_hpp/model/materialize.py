"""Models larger than one device: built on the meta device, each rank materializing only its stages.

:func:`init_on_meta` is the context HPPStrategy gives ``configure_model()`` and
``Trainer.init_module(empty_init=True)``: every parameter registered inside it lives on the meta
device (shape and dtype, no storage), while buffers stay real — the values modules compute at
construction (RoPE frequencies, BatchNorm statistics, position ids) survive, and buffers are small.
Parameter construction runs under Lightning's ``_EmptyInit``, so no initializer touches memory.

After the cut, :func:`materialize` gives this rank's meta parameters real storage on its device —
one tensor per tied group, the ties kept — and initialises them with their module's own
initializer: a transformers model's ``_init_weights``, else the module's ``reset_parameters``.
Each module is seeded from the base seed and its name, so a module gets the same weights whatever
the plan, the rank or the order (and :func:`materialize` on the whole model in one process gives
the single-process reference the same weights). They differ from the weights of an eager
construction, whose random stream runs through the modules in order.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.init import _EmptyInit
from torch import nn

from lightning_hpp.checkpoint.weights import load_stage_weights
from lightning_hpp.errors import PlanError


@contextlib.contextmanager
def init_on_meta() -> Iterator[None]:
    """Register every new parameter on the meta device; buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        with _EmptyInit(enabled=True):
            yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def fake_parameters(module: nn.Module, device: torch.device) -> Iterator[Any]:
    """Let a model built by :func:`init_on_meta` be run and traced as if it lived on ``device``:
    meanwhile its meta parameters are stood in for by fake tensors on ``device`` (torch's
    ``FakeTensorMode``: shapes, dtypes and devices, no storage), so nothing is allocated, and the
    constants the model creates in ``forward`` get real values on ``device``, as in a trace of the
    real model. The real buffers elsewhere than ``device`` (built on the CPU) are stood in for on ``device``
    too, so parameters, buffers and the batch meet on one device. Everything is put back afterwards (ties
    kept: one stand-in per tensor). Yields the ``FakeTensorMode`` of the stand-ins."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    saved, stand_ins = [], {}
    for mod in module.modules():
        for registry in (mod._parameters, mod._buffers):
            for key, t in list(registry.items()):
                if t is None or not (t.is_meta if registry is mod._parameters else t.device != device):
                    continue
                if id(t) not in stand_ins:
                    with mode:
                        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                    stand_ins[id(t)] = (
                        nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
                    )
                saved.append((registry, key, t))
                registry[key] = stand_ins[id(t)]
    try:
        yield mode
    finally:
        for registry, key, t in saved:
            registry[key] = t


def is_fake(t: torch.Tensor) -> bool:
    """A tensor without values: on the meta device, or one of :func:`fake_parameters`' stand-ins (or made from one)."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return t.is_meta or _is_fake(t)


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def materialize(module: nn.Module, device: torch.device, *, seed: int = 0, initialize: bool = True) -> list[str]:
    """Give every meta parameter of ``module`` real storage on ``device`` and, with ``initialize``,
    its module's initial values (seeded per module name); returns the names materialized.

    Raises:
        PlanError: a module with meta parameters and no initializer (and ``initialize``).
    """
    fresh: dict[int, nn.Parameter] = {}
    for _, mod in module.named_modules(remove_duplicate=False):
        for key, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in fresh:
                    fresh[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                mod._parameters[key] = fresh[id(p)]
    new = {id(p) for p in fresh.values()}
    names = [n for n, p in module.named_parameters() if id(p) in new]
    if not initialize or not new:
        return names
    done: set[int] = set()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for name, mod in module.named_modules():
            own = [p for p in mod.parameters(recurse=False) if id(p) in new and id(p) not in done]
            if not own:
                continue
            torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
            with _whole(mod):
                _initialize(module, name, mod)
            done.update(id(p) for p in mod.parameters(recurse=False))
    return names


@contextlib.contextmanager
def _whole(mod: nn.Module) -> Iterator[None]:
    """While inside, ``mod``'s tensor-parallel shards (``DTensor`` parameters) are stood in for by whole tensors;
    on the way out each shard takes its own slice of them. The initializer then draws what it draws for the
    unsplit module (the same values on every rank, whatever ``tp``), and at most one module is whole at a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    shards = {key: p for key, p in mod._parameters.items() if isinstance(p, DTensor)}
    if not shards:
        yield
        return
    whole = {
        key: nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device), requires_grad=p.requires_grad
        )
        for key, p in shards.items()
    }
    mod._parameters.update(whole)
    try:
        yield
    finally:
        mod._parameters.update(shards)
    with torch.no_grad():
        for key, p in shards.items():  # every rank holds the whole tensor: each keeps its slice, nothing is sent
            p.to_local().copy_(
                distribute_tensor(whole[key].detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
            )


def _initialize(root: nn.Module, name: str, mod: nn.Module) -> None:
    owner = _pretrained_owner(root, name)
    if owner is not None:
        owner._init_weights(mod)
        return
    if hasattr(mod, "reset_parameters"):
        mod.reset_parameters()
        return
    raise PlanError(
        f"Module {name!r} ({type(mod).__name__}) was built on the meta device and has no initializer: give it a "
        f"`reset_parameters()` method, or load its weights from disk with "
        f"`HPPStrategy(init=InitOptions(weights=...))`."
    )


def _pretrained_owner(root: nn.Module, name: str) -> nn.Module | None:
    """The innermost transformers ``PreTrainedModel`` holding module ``name`` (its ``_init_weights`` knows it)."""
    owner = None
    parts = name.split(".") if name else []
    mod = root
    for i in range(len(parts) + 1):
        if callable(getattr(mod, "_init_weights", None)) and hasattr(mod, "config"):
            owner = mod
        if i < len(parts):
            mod = getattr(mod, parts[i])
    return owner


def materialize_stages(
    module: nn.Module, device: torch.device, *, seed: int, weights: str | None = None, rename: str | None = None
) -> int:
    """Materialize what is left of ``module`` after the cut (this rank's stages), initialised by
    :func:`materialize` or, with ``weights``, read from disk (traced stages read the new tensors through
    their linked registries). Returns how many parameters were materialized."""
    names = materialize(module, device, seed=seed, initialize=weights is None)
    if weights is not None:
        load_stage_weights(module, weights, names=names, rename=rename)
    return len(names)
