"""FSDP2 on pipeline stages: each stage sharded over its replicas (``ShardingOptions(data_parallel="fsdp")``),
or sharded over groups of them and replicated over the groups (``"hsdp"``, a 2-D mesh).

:func:`shard_stages` calls torch's ``fully_shard`` bottom-up: on each block of the model's longest block
list and each unit of the plan that a stage holds (the user's modules: the sequential frontend runs them
as written, the traced frontend's graph holds them under their names), deepest first, and then on the
stage module, which becomes the root of its units and keeps whatever parameters no unit owns. A unit whose parameters
other modules of the stage use too (a tied embedding and head in
one stage) is left to the root: FSDP2 keeps a shared parameter in the group of the modules' common
ancestor. The parameters become ``DTensor`` shards on the module itself (and, through the traced
stages' linked registries, on the user's modules), so the optimizer Lightning builds afterwards, the
state dict and clipping see this rank's shards only.

torch pipelining knows FSDP2 stages (``PipelineStage.backward_maybe_with_nosync``): every micro-batch's
backward accumulates the unsharded gradients without a reduction, and the schedule's ``REDUCE_GRAD``
(``perform_reduce_grad``, after the stage's last backward) reduce-scatters them once per step, then
frees the gathered parameters. The data-parallel gradient hand-over therefore reduces nothing of a
sharded stage (FSDP averages over the shard mesh, and over the replicas under hsdp).

:class:`ShardedStages` is what the runner needs around a schedule step: forward-only passes gather every
FSDP module of the held stages first (a traced frontend's evaluation graphs read the user's parameter
slots, which hold the full parameters only while they are gathered) and free them after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

REDUCE_DTYPE = torch.float32
"""What low-precision stages reduce-scatter their gradients in (fp32 stages reduce in fp32 anyway)."""


def default_reshard_after_forward(value: bool | None) -> bool:
    """``reshard_after_forward`` for a stage under a micro-batched schedule: ``None`` means ``False``.

    A pipeline stage runs ``n_microbatches`` forwards and backwards per step. With ``False`` the parameters
    are gathered once, at the stage's first forward, and freed unit by unit in its last backward: one
    all-gather per step, at the cost of holding the stage's full parameters during the step (the optimizer
    state stays sharded). With ``True`` FSDP2 frees them after every forward and gathers them again for the
    next forward or backward; with several micro-batches that lowers only what the forwards hold (GPipe's,
    with many micro-batches of activations), since every backward but the last keeps its units gathered
    and their gradients unsharded; with one micro-batch a step it keeps one unit gathered at a time, as FSDP
    alone does (:mod:`lightning_hpp.planning.memory`; measured in benchmarks/memory). torchtitan chooses
    ``False`` for pipelines too."""
    return False if value is None else bool(value)


def unit_modules(stage_module: nn.Module, names: list[str], root: nn.Module) -> list[nn.Module]:
    """The modules of ``stage_module`` to shard one by one, deepest first: those of ``names`` (the user's module
    names: the model's blocks and the plan's units) inside the stage, each once and only if no module
    outside it uses its parameters.

    The sequential frontend's stage holds the user's modules themselves (looked up in ``root``); a traced stage
    (one captured graph) holds them as submodules of its graph under their own names (``units[0].graph``).
    """
    units = list(getattr(stage_module, "units", []))
    graph = getattr(units[0], "graph", None) if getattr(stage_module, "captured", False) and units else None
    lookup = dict((graph if graph is not None else root).named_modules())
    held = {id(m) for m in stage_module.modules()}
    found = sorted(
        ((n, lookup[n]) for n in dict.fromkeys(names) if n in lookup and id(lookup[n]) in held),
        key=lambda nm: -nm[0].count("."),
    )
    uses: dict[int, int] = {}
    for m in stage_module.modules():
        for p in m._parameters.values():
            if p is not None:
                uses[id(p)] = uses.get(id(p), 0) + 1
    chosen, seen = [], set()
    for _, unit in found:
        if id(unit) in seen or unit is stage_module:
            continue
        seen.add(id(unit))
        inside: dict[int, int] = {}
        for m in unit.modules():
            for p in m._parameters.values():
                if p is not None:
                    inside[id(p)] = inside.get(id(p), 0) + 1
        if inside and all(uses[i] == n for i, n in inside.items()):
            chosen.append(unit)
    return chosen


def _slots(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every parameter under ``module`` (by id) and the slots holding it, ``(owner, name)``."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, name))
    return slots


def untie_across_stages(stages: dict[int, nn.Module]) -> list[list[tuple[int, nn.Module, str]]]:
    """Give every stage but the first of this rank's stages that use one parameter (a tied embedding and head on
    a V schedule's rank) a copy of its own in its slots (a traced stage's entry linked to the user's module becomes
    the stage's own): FSDP2 manages a parameter in one group, and each stage is a group of its own (two groups
    sharding one parameter install their own shard in turn at every reshard). The copies start equal; each step
    their gradients are summed into the parameter the optimizer steps and the copies take its values before the
    next (:class:`~lightning_hpp.pipeline.grads.GradHandover`), so they stay equal.

    Returns:
        Per tied parameter, one slot ``(stage, owner, name)`` of each stage holding it (read again after sharding).
    """
    users: dict[int, list[int]] = {}
    for k, sm in sorted(stages.items()):
        for pid in {id(p) for p in sm.parameters()}:
            users.setdefault(pid, []).append(k)
    ties: list[list[tuple[int, nn.Module, str]]] = []
    for pid, ks in users.items():
        if len(ks) < 2:
            continue
        tie = []
        for k in ks:
            held = _slots(stages[k]).get(pid, [])
            if k != ks[0]:
                original = held[0][0]._parameters[held[0][1]]
                copy = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
                for owner, name in held:
                    registry = owner._parameters
                    if not isinstance(registry, dict):  # a traced stage's link to a user's slot: its own entry now
                        del registry[name]
                    registry[name] = copy
            tie.append((k, *held[0]))
        ties.append(tie)
    return ties


def shard_stages(
    root: nn.Module,
    stages: dict[int, nn.Module],
    unit_names: dict[int, list[str]],
    mesh: Any,
    reshard_after_forward: bool | None,
) -> ShardedStages:
    """Shard this rank's stages with FSDP2 over ``mesh`` (collective over the shard mesh; every replica of a
    stage calls it in the same order).

    A parameter the user's model holds under several names (tied weights) is a shard under all of them
    afterwards, also where this rank's stages use it under one name only: FSDP2 replaces the parameter in
    the slots of the modules it shards, and the others are pointed at the same shard. Where several of this
    rank's stages use it, each holds a copy of its own (:func:`untie_across_stages`): ``ShardedStages.ties``,
    each list the one the optimizer steps first.
    A tensor-parallel stage's ``DTensor`` parameters become 2-D shards (``dp_shard`` × ``tp``): tensor parallel
    first, then FSDP2, as torchtitan composes them.

    Args:
        root: The LightningModule holding the stages' modules.
        stages: This rank's training stage modules, by stage index.
        unit_names: Each stage's modules to shard one by one, by the user's names (the model's blocks, the plan's
            units: :func:`unit_modules`).
        mesh: The 1-D ``dp_shard`` mesh (fsdp), or the 2-D ``(dp_replicate, dp_shard)`` mesh (hsdp).
        reshard_after_forward: As given in ``ShardingOptions`` (``None``: :func:`default_reshard_after_forward`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = default_reshard_after_forward(reshard_after_forward)
    # parameters keep the dtype the stage's precision stores them in (the precision plugin cast them before):
    # gathered in it, computed in it or under the stage's autocast as on unsharded stages; gradients of
    # bf16/fp16 parameters are reduced in fp32
    policy = MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=REDUCE_DTYPE, output_dtype=None, cast_forward_inputs=False
    )
    tied = untie_across_stages(stages)
    slots = _slots(nn.ModuleList([root, *stages.values()]))  # the user's slots and the stages' own
    before = {pid: aliases[0][0]._parameters[aliases[0][1]] for pid, aliases in slots.items()}
    for k, sm in sorted(stages.items()):
        for unit in unit_modules(sm, unit_names.get(k, []), root):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(sm, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    for pid, aliases in slots.items():  # FSDP2's shard in the slots it did not shard itself
        sharded = next((m._parameters[n] for m, n in aliases if m._parameters[n] is not before[pid]), None)
        if sharded is not None:
            for m, n in aliases:
                if m._parameters[n] is before[pid]:
                    m._parameters[n] = sharded
    stepped = {id(p) for p in root.parameters()}  # the copy the optimizer steps first: the others follow it
    ties = [
        sorted((owner._parameters[name] for _, owner, name in tie), key=lambda p: id(p) not in stepped) for tie in tied
    ]
    return ShardedStages(stages, ties)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class ShardedStages:
    """This rank's FSDP2 stages, and what a forward-only pass needs of them.

    Args:
        stages: The sharded training stage modules, by stage index.
        ties: The copies of each parameter several of these stages use (:func:`untie_across_stages`).
    """

    def __init__(self, stages: dict[int, nn.Module], ties: list[list[nn.Parameter]] = ()) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.stages = dict(stages)
        self.ties = [list(t) for t in ties]
        # leaves first, each module once: the order every replica gathers and frees in
        self.modules: list[Any] = [
            m
            for _, sm in sorted(self.stages.items())
            for m in reversed(list(sm.modules()))
            if isinstance(m, FSDPModule)
        ]

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every FSDP module of the held stages gathered (collective over each shard group), freed after."""
        try:
            for m in self.modules:
                m.unshard()
            yield
        finally:
            self.reshard()

    def reshard(self) -> None:
        """Free every gathered parameter (the shards are registered again on the modules)."""
        for m in self.modules:
            m.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (a view of its storage: in-place changes reach the ``DTensor``), else ``t``."""
    return t.to_local() if _is_dtensor(t) else t
