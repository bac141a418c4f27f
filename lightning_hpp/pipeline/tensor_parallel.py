"""Tensor parallel inside a stage: which modules a stage splits over its ``tp`` ranks, and the split.

A stage's plan comes, in this order of preference, from:

1. the LightningModule's hook ``parallelize_stage(self, module, mesh)``, called once per stage module this
   rank holds (a :class:`~lightning_hpp.pipeline.stage.StageModule`: ``module.units`` are the user's
   modules of the stage, ``module.names`` their names) with the stage's 1-D ``tp`` mesh; it splits
   them itself (torch's ``parallelize_module``, or :func:`apply_tensor_parallel` with style names);
2. a transformers model's own plan (``config.base_model_tp_plan``, e.g. Llama's colwise
   ``q/k/v/gate/up`` and rowwise ``o/down`` projections) for every transformers model inside the
   LightningModule: :func:`transformers_tp_plan`.

Without either, :func:`resolve_tp_plan` refuses at setup. The styles are torch's
(``torch.distributed.tensor.parallel``) under transformers' names (:data:`STYLES`); parameters become
``DTensor`` shards (``Shard(0)`` colwise, ``Shard(1)`` rowwise) and everything between the split
modules stays a plain, full tensor: a rowwise module's output is all-reduced (``Replicate``) before the
next op, so a stage's inputs and outputs are full activations and the pipeline's send/recv carries plain
tensors.

Every split dimension must divide by ``tp`` (and with it the attention heads: a colwise ``q_proj``
splits heads, ``num_attention_heads`` and ``num_key_value_heads`` must divide by ``tp``): each rank then
runs the same local program on ``1/tp`` of the heads and features. transformers' attention reshapes
with ``view(*input_shape, -1, head_dim)``, so the eager modules need no change. The traced frontend
burns shapes into its graph (``expand(b, kv_heads, groups, t, d)``), so it must capture that local
program: :func:`at_local_width` stands in for the split weights with their local shapes while the
model is traced, and the captured graph then runs on every tp rank.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_hpp.errors import PlanError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

HOOK = "parallelize_stage"
"""The LightningModule method that splits a stage module itself: ``parallelize_stage(self, module, mesh)``."""

STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
          "embedding_rowwise", "embedding_colwise")
"""The style names a plan may use (transformers' names), each one of torch's styles (:func:`torch_style`)."""

_SHOW = 4
"""Modules named per error, at most."""

_SPLIT_DIM = {"colwise": 0, "colwise_rep": 0, "colwise_gather_output": 0, "rowwise": 1, "rowwise_rep": 1,
              "rowwise_split_input": 1, "embedding_rowwise": 0, "embedding_colwise": 1}
"""The dimension of ``weight`` each style splits."""

_NARROWED = {"colwise": 0, "rowwise": 1}
"""Styles whose local program differs in shape from the module's (the dim of ``weight`` each rank holds
``1/tp`` of); the others gather or reduce to full width inside the module."""


class _Kinded:
    """torch's style applied by the *kind* of the user's module (``nn.Linear`` / ``nn.Embedding``) rather
    than the class of the module it is given: the traced frontend's captured submodule runs a Linear's
    computation (``aten.linear(x, self.weight)``) without being one, and torch picks the partition by class."""

    kind: str = "linear"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        embedding = self.kind == "embedding"
        if isinstance(self, RowwiseParallel):
            self.desired_input_layouts = (Replicate(),) if embedding else (Shard(-1),)
        partition = self._partition_embedding_fn if embedding else self._partition_linear_fn
        return distribute_module(module, device_mesh, partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Colwise(_Kinded, ColwiseParallel):
    """torch's ``ColwiseParallel`` for a module of the given kind."""


class Rowwise(_Kinded, RowwiseParallel):
    """torch's ``RowwiseParallel`` for a module of the given kind."""


def torch_style(name: str, kind: str) -> ColwiseParallel | RowwiseParallel:
    """torch's ``ParallelStyle`` for a plan's style ``name`` on a module of ``kind`` (``"linear"`` / ``"embedding"``).

    Raises:
        PlanError: a style name outside :data:`STYLES`, or one that does not fit the module's kind.
    """
    if name not in STYLES:
        raise PlanError(f"Tensor-parallel style {name!r} is not one lightning_hpp applies; the styles are "
                        f"{', '.join(STYLES)} (torch's ColwiseParallel / RowwiseParallel). Split that module in "
                        f"`{HOOK}(self, module, mesh)` instead, or leave it out of the plan.")
    wants = "embedding" if name.startswith("embedding_") else "linear"
    if kind != wants:
        raise PlanError(
            f"Tensor-parallel style {name!r} splits an nn.{wants.capitalize()}, but the module is "
            f"{'an nn.Embedding' if kind == 'embedding' else 'an nn.Linear' if kind == 'linear' else 'a ' + kind}. "
            f"Use {'embedding_rowwise / embedding_colwise' if kind == 'embedding' else 'colwise / rowwise'}, "
            f"or split it in `{HOOK}`."
        )
    if name == "colwise":
        style: ColwiseParallel | RowwiseParallel = Colwise()
    elif name in ("colwise_rep", "colwise_gather_output"):
        style = Colwise(output_layouts=Replicate())
    elif name == "rowwise":
        style = Rowwise()
    elif name in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
        style = Rowwise(input_layouts=Replicate())
    else:  # embedding_colwise: each rank looks up a slice of every vector, gathered after
        style = Colwise(output_layouts=Replicate())
    style.kind = kind
    return style


@dataclass(frozen=True)
class TPPlan:
    """The modules of a LightningModule that tensor parallel splits, by full name, and the style of each.

    Attributes:
        styles: Full module name (as in the LightningModule's ``named_modules()``) -> style name.
        source: Where the plan comes from (logged).
        hook: The LightningModule's ``parallelize_stage`` splits each stage instead (``styles`` empty).
        kinds: The kind of each module of ``styles``.
    """

    styles: dict[str, str] = field(default_factory=dict)
    source: str = ""
    hook: bool = False
    kinds: dict[str, str] = field(default_factory=dict)
    """The kind of each planned module (``"linear"`` / ``"embedding"``), taken while the model is whole."""


def module_kind(mod: nn.Module) -> str:
    if isinstance(mod, nn.Embedding):
        return "embedding"
    if isinstance(mod, nn.Linear):
        return "linear"
    return type(mod).__name__


def _pretrained_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models inside ``module`` (those with a ``config`` holding a TP plan)."""
    found: list[tuple[str, nn.Module]] = []
    for name, mod in module.named_modules():
        if any(name == f or name.startswith(f + ".") or f == "" for f, _ in found):
            continue
        config = getattr(mod, "config", None)
        if config is not None and hasattr(mod, "base_model_prefix") and getattr(config, "base_model_tp_plan", None):
            found.append((name, mod))
    return found


def transformers_tp_plan(module: nn.Module) -> TPPlan | None:
    """The plan of every transformers model inside ``module``: its ``config.base_model_tp_plan``, whose keys
    (``"layers.*.self_attn.q_proj"``, ``*`` a layer index) name modules of its base model; ``None`` if there
    is none. The head's own plan (``lm_head``) is left out: the head stays whole, as its tied embedding does."""
    styles: dict[str, str] = {}
    sources = []
    for path, model in _pretrained_models(module):
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, model) if prefix else model
        base_path = ".".join(p for p in (path, prefix if base is not model else "") if p)
        names = [n for n, _ in base.named_modules() if n]
        for key, style in model.config.base_model_tp_plan.items():
            pattern = re.compile(re.escape(key).replace(r"\*", r"\d+"))
            for n in names:
                if pattern.fullmatch(n):
                    styles[f"{base_path}.{n}" if base_path else n] = style
        sources.append(f"{type(model).__name__}.config.base_model_tp_plan at {path or 'the module itself'!r}")
    if not styles:
        return None
    modules = dict(module.named_modules())
    return TPPlan(styles, source="; ".join(sources), kinds={n: module_kind(modules[n]) for n in styles})


def resolve_tp_plan(module: nn.Module, tp: int) -> TPPlan:
    """The plan that splits ``module``'s stages over ``tp`` ranks, checked (every rank, before the cut).

    Args:
        module: The LightningModule, whole.
        tp: The tensor-parallel degree (> 1).

    Raises:
        PlanError: no plan (no transformers model with a ``base_model_tp_plan``, no ``parallelize_stage``),
            a style that is not applied, a split dimension or head count that ``tp`` does not divide.
    """
    name = type(module).__name__
    if callable(getattr(type(module), HOOK, None)):
        return TPPlan(source=f"{name}.{HOOK}", hook=True)
    plan = transformers_tp_plan(module)
    if plan is None:
        raise PlanError(
            f"HPPStrategy(sharding={{'tp_degree': {tp}}}) splits every stage by tensor parallel, but `{name}` has no "
            f"plan for it: no transformers model with a `config.base_model_tp_plan` inside it, and no "
            f"`{HOOK}(self, module, mesh)` method. Fix: define `{HOOK}` on `{name}` (split `module.units` with "
            f"torch's `parallelize_module(unit, mesh, {{...: ColwiseParallel(), ...: RowwiseParallel()}})`), "
            f"or train with tp_degree=1."
        )
    check_divisible(module, plan, tp)
    return plan


_FORWARD_REDUCES = frozenset(
    {
        "rowwise",
        "rowwise_rep",
        "rowwise_split_input",
        "embedding_rowwise",
        "colwise_rep",
        "colwise_gather_output",
        "embedding_colwise",
    }
)
"""Styles whose forward ends in a collective over the tp ranks (a partial sum all-reduced, a split output gathered)."""

_BACKWARD_REDUCES = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "embedding_colwise"})
"""Styles whose input is replicated: the gradient of their input is all-reduced over the tp ranks in the backward."""


def plan_shape(module: nn.Module, unit_names: list[str], plan: TPPlan) -> tuple[list[float], list[list[int]]] | None:
    """What ``plan`` splits of each planning unit (named as in ``module``): the share of the unit's parameter bytes
    it splits, and ``[forward, backward]`` collectives over the tp ranks per micro-batch (a rowwise module's
    output, a colwise module's input gradient) — the cost model's tensor-parallel terms
    (:class:`~lightning_hpp.planning.profile.CostProfile`). ``None`` for a ``parallelize_stage`` hook, which says
    nothing of what it splits."""
    if plan.hook:
        return None
    modules = dict(module.named_modules())
    split = [0.0] * len(unit_names)
    reduces = [[0, 0] for _ in unit_names]
    totals = [float(sum(p.numel() * p.element_size() for p in modules[u].parameters())) for u in unit_names]
    for name, style in plan.styles.items():
        i = next((k for k, u in enumerate(unit_names) if name == u or name.startswith(u + ".")), None)
        if i is None:
            continue
        mod = modules[name]
        keys = ["weight"] + (["bias"] if style == "colwise" else [])
        split[i] += sum(p.numel() * p.element_size() for k in keys if (p := mod._parameters.get(k)) is not None)
        reduces[i][0] += style in _FORWARD_REDUCES
        reduces[i][1] += style in _BACKWARD_REDUCES
    return [min(1.0, b / t) if t else 0.0 for b, t in zip(split, totals)], reduces


def tp_degrees(module: nn.Module, world_size: int) -> list[int]:
    """The tensor-parallel degrees ``module`` can be split by on a job of ``world_size`` ranks: 1, and every
    divisor of the world its plan (a transformers model's, or the ``parallelize_stage`` hook's) divides
    (:func:`resolve_tp_plan`)."""
    out = [1]
    for t in range(2, world_size + 1):
        if world_size % t:
            continue
        try:
            resolve_tp_plan(module, t)
        except PlanError:
            continue
        out.append(t)
    return out


def check_frontend(plan: TPPlan, frontend: str, module_name: str) -> None:
    """The hook splits modules as written: refused for traced stages, whose graphs keep the width they were
    captured at (a transformers plan is captured at its local width instead, :func:`at_local_width`).

    Raises:
        PlanError: ``plan`` is the hook's and ``frontend`` is ``"traced"``.
    """
    if plan.hook and frontend == "traced":
        raise PlanError(
            f"`{module_name}.{HOOK}(self, module, mesh)` splits the modules of a stage as written, but this model's "
            f"stages are traced (frontend='traced'): their graphs run each module's computation at the width it was "
            f"captured with. Split a transformers model by its own plan (remove `{HOOK}`), or cut the model "
            f"between the top-level units of a chain forward, which the sequential frontend runs as written."
        )


def check_divisible(module: nn.Module, plan: TPPlan, tp: int) -> None:
    """Every split dimension, and the attention heads of every transformers model the plan splits, divide by ``tp``.

    Raises:
        PlanError: naming the module (or config field), the number and ``tp``.
    """
    problems, widths = [], []
    for path, model in _pretrained_models(module):
        config = model.config
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        for field_name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            if isinstance(value, int) and value % tp:
                problems.append(
                    f"{type(config).__name__}.{field_name}={value} (the model at {path!r}): each tp rank "
                    f"must hold whole heads"
                )
    modules = dict(module.named_modules())
    for name, style in plan.styles.items():
        mod = modules.get(name)
        if mod is None:
            raise PlanError(
                f"The tensor-parallel plan names {name!r}, which is no submodule of `{type(module).__name__}`."
            )
        kind = module_kind(mod)
        torch_style(style, kind)  # refuses unknown styles and kinds early
        weight = getattr(mod, "weight", None)
        if weight is None:
            continue
        d = _SPLIT_DIM[style]
        if weight.shape[d] % tp:
            widths.append(f"{name!r} ({style}): weight dim {d} has {weight.shape[d]} rows/columns")
    problems += widths[:_SHOW] + ([f"... and {len(widths) - _SHOW} more modules"] if len(widths) > _SHOW else [])
    if problems:
        raise PlanError(
            f"tp_degree={tp} does not divide: "
            + "; ".join(problems)
            + f". Fix: a tp_degree that divides them (e.g. 1 or a common divisor), or a model whose "
            f"head counts and widths are multiples of {tp}."
        )


@contextlib.contextmanager
def at_local_width(module: nn.Module, plan: TPPlan, tp: int) -> Iterator[None]:
    """While inside, every ``colwise`` / ``rowwise`` module of ``plan`` holds stand-ins of its *local* shapes
    (``weight`` and ``bias`` narrowed to ``1/tp`` on the split dimension, no copy of the values for a meta
    model's fake stand-ins): what ``module`` computes meanwhile, a trace included, is one tp rank's program.
    The original parameters are put back afterwards."""
    saved = []
    modules = dict(module.named_modules())
    for name, style in plan.styles.items():
        if style not in _NARROWED:
            continue
        mod = modules[name]
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            dim = 0 if key == "bias" and style == "colwise" else _NARROWED[style] if key == "weight" else None
            if dim is None:
                continue
            local = p.detach().narrow(dim, 0, p.shape[dim] // tp).contiguous()
            saved.append((mod, key, p))
            mod._parameters[key] = nn.Parameter(local, requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for mod, key, p in saved:
            mod._parameters[key] = p


def stage_targets(stage_module: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    """For each full module name (the LightningModule's), the module of ``stage_module`` that runs it, where the
    stage holds it: a traced stage's captured submodule of that name, or a submodule of the sequential stage's unit."""
    found: dict[str, nn.Module] = {}
    for unit_name, unit in zip(getattr(stage_module, "names", []), getattr(stage_module, "units", [])):
        graph = getattr(unit, "graph", None)
        if isinstance(graph, nn.Module) and getattr(stage_module, "captured", False):
            held = dict(graph.named_modules())
            found.update({n: held[n] for n in names if n in held})
            continue
        for n in names:
            if n == unit_name:
                found[n] = unit
            elif n.startswith(unit_name + "."):
                try:
                    found[n] = unit.get_submodule(n[len(unit_name) + 1 :])
                except AttributeError:
                    pass
    return found


def apply_tensor_parallel(
    stage_module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str], kinds: dict[str, str] | None = None
) -> list[str]:
    """Split the modules of ``plan`` that ``stage_module`` holds over ``tp_mesh`` (torch's ``parallelize_module``);
    returns their names.

    Args:
        stage_module: A :class:`~lightning_hpp.pipeline.stage.StageModule` (or any module whose
            ``named_modules()`` use the plan's names).
        tp_mesh: The stage's 1-D ``tp`` mesh.
        plan: Full module name -> style name (:data:`STYLES`).
        kinds: The kind of each planned module (``"linear"``/``"embedding"``), where the module the stage runs is
            not the user's (a traced stage); default: the kind of the module itself.

    Each rank keeps its own slice of the values it holds (``src_data_rank=None``: every rank starts from the
    same weights, so nothing is sent); a parameter still on the meta device becomes a meta shard.
    """
    return _split(_targets(stage_module, plan), tp_mesh, plan, kinds, done=set())


def _targets(stage_module: nn.Module, plan: dict[str, str]) -> dict[str, nn.Module]:
    if hasattr(stage_module, "units"):
        return stage_targets(stage_module, list(plan))
    return {n: m for n, m in stage_module.named_modules() if n in plan}


def _split(
    targets: dict[str, nn.Module],
    tp_mesh: DeviceMesh,
    plan: dict[str, str],
    kinds: dict[str, str] | None,
    done: set[int],
) -> list[str]:
    """``parallelize_module`` on each target not in ``done`` (ids; a module two stage modules share is split once)."""
    for name, target in targets.items():
        if id(target) in done:
            continue
        done.add(id(target))
        kind = (kinds or {}).get(name) or module_kind(target)
        parallelize_module(target, tp_mesh, torch_style(plan[name], kind), src_data_rank=None)
    return sorted(targets)


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank holds of ``t`` (a DTensor's local shard)."""
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def split_stages(module: nn.Module, stage_modules: list[nn.Module], plan: TPPlan, tp_mesh: DeviceMesh) -> list[str]:
    """Split this rank's stage modules (every capture of each: a traced stage has one for training and one for
    forward-only passes, on the same parameters) by ``plan`` over ``tp_mesh``: the LightningModule's hook once
    per stage module, else :func:`apply_tensor_parallel` with the kinds of the user's modules (``plan.kinds``: the
    stages of other ranks are gone by now). Returns the names
    of the modules split by a plan (none for the hook)."""
    unique = list({id(sm): sm for sm in stage_modules}.values())
    if plan.hook:
        for sm in unique:
            getattr(module, HOOK)(sm, tp_mesh)
        return []
    split: set[str] = set()
    done: set[int] = set()
    for sm in unique:
        split.update(_split(_targets(sm, plan.styles), tp_mesh, plan.styles, plan.kinds, done))
    return sorted(split)
