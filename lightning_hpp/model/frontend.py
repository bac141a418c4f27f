"""One plan, two frontends: how a model is cut into the stages a plan describes.

* **sequential**: the user's modules run as written. Chosen where the cut points are units of the
  model's top-level chain (:func:`~lightning_hpp.model.units.find_units`), the step calls
  ``self(...)`` with positional arguments only, and ``forward`` is the units applied in order
  (:func:`~lightning_hpp.model.sequential.check_sequential_forward`).
* **traced**: everything else that ``torch.export`` can capture (:mod:`lightning_hpp.model.traced`):
  cut points at any depth, functional code between modules, keyword arguments, values several
  stages read.

``frontend="auto"`` picks the first that applies and says why; ``"sequential"`` / ``"traced"``
force one. :func:`cut_model` returns a :class:`Cut`: per stage, the module bodies to run (for
training, and for forward-only passes: the traced frontend captures the model in each mode), the
parameter and buffer names each stage holds, how the step's ``self(...)`` arguments reach the first
stage and how the last stage's output returns to the step.

:func:`balanced_plan` is the plan for a model without one: cut points spread over the model's
longest list of blocks, balanced by parameter count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from lightning_hpp.errors import PlanError, SequentialForwardError
from lightning_hpp.model import traced as _traced
from lightning_hpp.model.sequential import check_sequential_forward
from lightning_hpp.model.units import find_units, keep_stages, keep_tensors
from lightning_hpp.planning.plan import StagePlan
from lightning_hpp.validation import check_choice

FRONTENDS = ("auto", "sequential", "traced")


@dataclass
class Cut:
    """A model cut into stages by one frontend.

    Attributes:
        frontend: ``"sequential"`` or ``"traced"``.
        plan: The plan with every stage's modules resolved (``meta["frontend"]`` and, traced,
            ``meta["cut_points"]`` recorded).
        bodies: ``bodies[mode][k]``: the modules stage ``k`` applies, for ``mode`` in ``"train"`` /
            ``"eval"`` (sequential: the same user modules in both).
        spread: Whether stage ``k``'s first body takes the stage's inputs as positional arguments.
        params: Names of the parameters each stage uses (tied parameters: under their first name).
        buffers: Names of the buffers each stage uses.
        flatten: ``(args, kwargs)`` of the step's ``self(...)`` → the first stage's inputs (``None``:
            positional arguments only).
        unflatten: The last stage's output → what ``self(...)`` returns (``None``: itself).
        reason: Why this frontend was chosen (logged).
    """

    frontend: str
    plan: StagePlan
    bodies: dict[str, list[list[nn.Module]]]
    spread: list[bool]
    params: list[set[str]]
    buffers: list[set[str]]
    flatten: Callable[[tuple, dict], tuple] | None = None
    unflatten: Callable[[Any], Any] | None = None
    reason: str = ""
    shared: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shared = shared_parameters(self.params)

    def keep_only(self, module: nn.Module, held: list[int]) -> None:
        """Drop from ``module`` (in place) every parameter and buffer of the stages in other ranks."""
        if self.frontend == "sequential":
            keep_stages(module, [s.modules for s in self.plan.stages], held)
            return
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers(remove_duplicate=False))

        def tensors(k: int) -> list[Any]:
            return [*(params[n] for n in self.params[k]), *(buffers[n] for n in self.buffers[k] if n in buffers)]

        stage_of = {id(t): k for k in reversed(range(self.plan.num_stages)) for t in tensors(k)}
        keep_tensors(module, {id(t) for k in held for t in tensors(k)}, stage_of)


def shared_parameters(stage_params: list[set[str]]) -> dict[str, list[int]]:
    """Parameters that several stages use (tied embeddings and heads, shared blocks), with their stages."""
    stages: dict[str, list[int]] = {}
    for k, names in enumerate(stage_params):
        for n in names:
            stages.setdefault(n, []).append(k)
    return {n: ks for n, ks in stages.items() if len(ks) > 1}


def cut_model(module: nn.Module, plan: StagePlan, example: tuple[tuple, dict] | None, *,
              frontend: Literal["auto", "sequential", "traced"] = "auto", modes: tuple[str, ...] = ("train",),
              eval_example: tuple[tuple, dict] | None = None) -> Cut:
    """Cut ``module`` as ``plan`` says (collective-free; every rank computes the same cut).

    Args:
        module: The LightningModule, whole.
        plan: The stage plan.
        example: ``(args, kwargs)`` of the step's ``self(...)`` call on one real micro-batch (``None``
            when the running stage has no data: only the sequential frontend can then be used, unchecked).
        frontend: ``"auto"``, ``"sequential"`` or ``"traced"``.
        modes: ``"train"`` and/or ``"eval"``: the modes the traced frontend captures.
        eval_example: The example for the eval-mode capture (default ``example``).
    """
    check_choice(frontend, "HPPStrategy(frontend=...)", FRONTENDS, error=PlanError)
    reason = "forced" if frontend != "auto" else ""
    if frontend in ("auto", "sequential"):
        why_not = _sequential_obstacle(module, plan, example)
        if why_not is None:
            return _sequential(
                module, plan, example, reason or "the cuts are between top-level units and forward is their chain"
            )
        if frontend == "sequential" or example is None:
            raise why_not
        reason = f"the sequential frontend does not apply: {why_not}"
    if example is None:
        raise PlanError(
            "The traced frontend captures the model on one real micro-batch, but the dataloader gave no batch."
        )
    return _traced_cut(module, plan, example, modes, eval_example or example, reason)


def _sequential_obstacle(module: nn.Module, plan: StagePlan, example: tuple[tuple, dict] | None) -> PlanError | None:
    try:
        units = find_units(module)
    except PlanError as err:
        return err
    names = [n for n, _ in units]
    known = set(names) | {n.rsplit(".", 1)[0] for n in names}
    entries = [e for s in plan.stages for e in s.modules] + list(plan.meta.get("cut_points") or [])
    if not all(e in known or _range_of(e, names) for e in entries):
        return PlanError(f"the cut points lie inside the top-level units ({', '.join(names)})")
    resolved = plan.resolve(names)  # a plan of units that does not fit them is a real error
    if example is None:
        return None
    args, kwargs = example
    if kwargs:
        return PlanError(f"the step calls `self(...)` with keyword arguments {sorted(kwargs)}")
    try:
        check_sequential_forward(module, units, args, [names.index(ms[-1]) for ms in resolved[:-1]])
    except SequentialForwardError as err:
        return err
    return None


def _range_of(entry: str, names: list[str]) -> bool:
    prefix, _, span = entry.rpartition(".")
    lo, _, hi = span.partition("-")
    return bool(prefix) and lo.isdigit() and hi.isdigit() and f"{prefix}.{lo}" in names


def _sequential(module: nn.Module, plan: StagePlan, example: Any, reason: str) -> Cut:
    units = dict(find_units(module))
    resolved = plan.resolve(list(units))
    bodies = [[units[n] for n in ms] for ms in resolved]
    params = [{f"{n}.{p}" for n in ms for p, _ in units[n].named_parameters()} for ms in resolved]
    canonical = {id(p): n for n, p in module.named_parameters()}
    by_name = dict(module.named_parameters(remove_duplicate=False))
    params = [{canonical[id(by_name[n])] for n in ps} for ps in params]
    buffers = [{f"{n}.{b}" for n in ms for b, _ in units[n].named_buffers()} for ms in resolved]
    out = plan.with_modules(resolved)
    out.meta["frontend"] = "sequential"
    return Cut(
        "sequential",
        out,
        {"train": bodies, "eval": bodies},
        [k == 0 for k in range(len(resolved))],
        params,
        buffers,
        reason=reason,
    )


def _traced_cut(
    module: nn.Module,
    plan: StagePlan,
    example: tuple[tuple, dict],
    modes: tuple[str, ...],
    eval_example: tuple[tuple, dict],
    reason: str,
) -> Cut:
    points = plan.cut_points([n for n, _ in module.named_modules()])
    if len(points) + 1 != plan.num_stages:
        raise PlanError(f"The plan has {plan.num_stages} stages but {len(points)} cut points {points}.")
    traces = {}
    for mode in modes:
        args, kwargs = example if mode == "train" else eval_example
        traces[mode] = _traced.trace(module, args, kwargs, points, train=(mode == "train"))
    first = next(iter(traces.values()))
    for other in list(traces.values())[1:]:  # one check of the step's inputs serves both modes
        first.dims = first.dims.merged(other.dims) if first.dims is not None else other.dims
    _check_listed_modules(module, plan, first.stage_params)
    owners = _owners(module, first.stage_params, first.stage_buffers)
    out = plan.with_modules(owners)
    out.meta.update(frontend="traced", cut_points=points)
    shared = shared_parameters(first.stage_params)
    if shared:
        out.meta["shared_parameters"] = shared
    bodies = {mode: [[s] for s in t.stages] for mode, t in traces.items()}
    for mode in ("train", "eval"):
        bodies.setdefault(mode, bodies[next(iter(traces))])
    return Cut(
        "traced",
        out,
        bodies,
        [True] * plan.num_stages,
        first.stage_params,
        first.stage_buffers,
        flatten=first.flatten_inputs,
        unflatten=first.unflatten_output,
        reason=reason or "forced",
    )


def _check_listed_modules(module: nn.Module, plan: StagePlan, stage_params: list[set[str]]) -> None:
    """A module the plan lists in stage k must have its parameters in stage k (the cut points decide)."""
    known = dict(module.named_modules())
    canonical = {id(p): n for n, p in module.named_parameters()}
    for k, spec in enumerate(plan.stages):
        for entry in spec.modules:
            if entry not in known:
                continue
            mine = {canonical[id(p)] for p in known[entry].parameters()}
            elsewhere = sorted(
                j for j, ps in enumerate(stage_params) if j != k and mine & ps and not (mine & stage_params[k])
            )
            if mine and elsewhere:
                raise PlanError(
                    f"Stage {k} lists {entry!r}, but with the cut points {plan.cut_points(list(known))} forward runs "
                    "it in "
                    f"stage {elsewhere[0]}. A stage begins at its first module; list modules in the stage where "
                    "forward runs them."
                )


def _owners(module: nn.Module, stage_params: list[set[str]], stage_buffers: list[set[str]]) -> list[list[str]]:
    """Per stage, the largest modules whose parameters and buffers all belong to it (registration order)."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    holders: list[list[str]] = [[] for _ in stage_params]

    def visit(name: str, mod: nn.Module) -> None:
        ps = {canonical[id(p)] for p in mod.parameters()}
        bs = {f"{name}.{b}" if name else b for b, _ in mod.named_buffers()}
        if not ps and not bs:
            return
        mine = [k for k in range(len(stage_params)) if (ps <= stage_params[k]) and (bs <= stage_buffers[k])]
        others = [
            j for j in range(len(stage_params)) if j not in mine and (ps & stage_params[j] or bs & stage_buffers[j])
        ]
        if name and mine and not others:  # a module shared by several stages (a tied head) is listed in the first
            holders[mine[0]].append(name)
            return
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    return holders


def planning_units(
    module: nn.Module, example: tuple[tuple, dict]
) -> tuple[list[tuple[str, nn.Module]], tuple, Callable[[StagePlan], StagePlan]]:
    """What ``plan="auto"`` profiles and partitions, as ``(units, example inputs, plan → plan to cut)``.

    Where the sequential frontend applies, the model's top-level units. Elsewhere the model traced at
    every block of its longest block list: unit ``i`` is everything from block ``i`` to block ``i + 1``
    (unit 0 also holds what runs before the blocks, the last unit what runs after them), named after
    its block, and the plan the partitioner makes of them becomes a ``split_at`` plan at the first
    block of every stage.
    """
    args, kwargs = example
    try:
        units = find_units(module)
    except PlanError:
        units = []
    if (
        len(units) >= 2
        and not kwargs
        and _sequential_obstacle(module, StagePlan.split_at([units[1][0]]), example) is None
    ):
        return units, args, lambda plan: plan
    name, blocks = _blocks(module, 2)
    points = [f"{name}.{i}" for i in range(1, len(blocks))]
    traced = _traced.trace(module, args, kwargs, points, train=True)
    units = [(f"{name}.{i}", stage) for i, stage in enumerate(traced.stages)]

    def to_cut(plan: StagePlan) -> StagePlan:
        cut = StagePlan.split_at(
            [s.modules[0] for s in plan.stages[1:]],
            **{
                f: [getattr(s, f) for s in plan.stages]
                for f in ("device", "precision", "clip_norm", "activation_checkpointing")
            },
        )
        cut.meta.update({k: v for k, v in plan.meta.items() if k != "cut_points"})
        return cut

    return units, traced.flatten_inputs(args, kwargs), to_cut


def _blocks(module: nn.Module, num_stages: int) -> tuple[str, nn.Module]:
    containers = [
        (n, m)
        for n, m in module.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= num_stages
    ]
    if not containers:
        raise PlanError(
            f"`{type(module).__name__}` has no list of at least {num_stages} blocks (an `nn.ModuleList` / "
            "`nn.Sequential`) to "
            f"cut into {num_stages} stages. Pass `HPPStrategy(plan=StagePlan.split_at([...]))` with the modules where "
            "the "
            f"stages begin."
        )
    return max(containers, key=lambda nm: (len(nm[1]), -nm[0].count(".")))


def block_names(module: nn.Module) -> list[str]:
    """The names of the blocks of ``module``'s longest ``ModuleList`` / ``Sequential`` (of at least 2), or ``[]``."""
    try:
        name, blocks = _blocks(module, 2)
    except PlanError:
        return []
    return [f"{name}.{i}" if name else str(i) for i in range(len(blocks))]


def balanced_plan(module: nn.Module, num_stages: int) -> StagePlan:
    """Cut points for a model without a plan: over its longest ``ModuleList`` / ``Sequential`` of blocks,
    balanced by parameter count (the modules before the blocks count towards the first stage, those
    after towards the last)."""
    name, blocks = _blocks(module, num_stages)
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    inside = {id(p) for p in blocks.parameters()}
    first_block = next((i for i, (n, p) in enumerate(module.named_parameters()) if id(p) in inside), 0)
    before = sum(
        p.numel() for i, (_, p) in enumerate(module.named_parameters()) if i < first_block and id(p) not in inside
    )
    after = sum(p.numel() for _, p in module.named_parameters() if id(p) not in inside) - before
    costs = [before + sizes[0], *sizes[1:]]
    costs[-1] += after
    total, points, acc = sum(costs), [], 0.0
    for i, c in enumerate(costs[:-1]):
        acc += c
        k = len(points) + 1
        remaining_blocks = len(costs) - (i + 1)
        if k < num_stages and (acc >= total * k / num_stages or remaining_blocks == num_stages - k):
            points.append(f"{name}.{i + 1}")
    plan = StagePlan.split_at(points[: num_stages - 1])
    plan.meta["balanced"] = f"{num_stages} stages over {name} ({len(blocks)} blocks) by parameter count"
    return plan
