"""The traced frontend: any model ``torch.export`` can capture, cut at modules of any depth.

``torch.distributed.pipelining``'s tracer (``torch.export`` + ``Pipe``, what ``pipeline()`` runs)
splits the captured graph at the cut points (``SplitPoint.BEGINNING``): the functional code between
modules (an embedding plus a position add, a flatten, residuals), keyword arguments of ``forward``
and model inputs read by later stages all survive, and the stage modules keep the user's parameter
names.

torch's traced stages form a DAG: a value computed on stage 0 and read by stages 1 and 2 (Llama's
RoPE ``cos``/``sin``, a causal mask, a residual) is sent to both, and ``PipelineStage`` cannot
back-propagate an output with two destinations. This module turns the DAG into a chain instead:
stage ``k`` receives every value produced before it that it *or a later stage* reads, and passes on
what later stages need. Values without gradients travel without one; differentiable values are
routed through the stages in between, whose pass-through is an identity in autograd. Both
frontends then feed the same ``PipelineStage`` / schedule machinery (precision, guards, telemetry,
every schedule)::

    DAG (torch)                           chain (here)
    s0 -> h  -> s1 -> h' -> s2            s0 -> (h, cos, sin, mask) -> s1 -> (h', cos, sin, mask) -> s2
    s0 -> cos, sin, mask -> s1, s2

Tied parameters (an embedding and its LM head) are one ``Parameter`` in the user's model; the tracer
replicates it into each stage that uses it. Every stage module's registries are linked to the user's
parameter and buffer slots (:class:`LinkedRegistry`), so the optimizer, checkpoints and the user's own
code see one tensor per name, whatever moves or casts either module afterwards, and
:func:`shared_parameters` reports which parameters several stages use (their gradients are summed
across those stages each step).

Shapes. Every dimension of every tensor input is captured as ``torch.export``'s ``Dim.AUTO``: the dimensions
the model lets vary (the batch, a sequence padded to each batch's longest) stay symbolic, so one capture runs
every length, and those the model fixes (a parameter or a reshape of that size, sizes 0 and 1) are
specialised. :class:`InputDims` keeps which is which and checks each new set of input shapes before the first
stage runs: a fixed dimension, a size out of the captured range or two tied dimensions that differ are refused
with a :class:`~lightning_hpp.errors.ShapeError` naming the input, the dimension, both shapes and the fix. A
model ``torch.export`` cannot capture that way is captured with the batch dimension alone left free.
"""

from __future__ import annotations

import inspect
import operator
import traceback
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from lightning.pytorch.utilities.seed import isolate_rng
from torch import nn
from torch.distributed.pipelining._IR import (
    MultiUseParameterConfig,
    Pipe,
    SplitPoint,
    annotate_split_points,
)
from torch.export import Dim

from lightning_hpp.errors import PlanError, TraceError
from lightning_hpp.model.input_dims import InputDims
from lightning_hpp.validation import is_int


class TracedStage(nn.Module):
    """One stage of a traced model as a link of a chain.

    ``forward(*values)`` takes the values the previous stage passed on (stage 0: the model's flat
    inputs), runs the stage's graph module and returns what the later stages need (the last stage:
    the model's flat outputs).
    """

    def __init__(self, graph: nn.Module, inputs: list[str], call_args: list[str],
                 binds: list[tuple[str, int | None]], outputs: list[str], ints: set[str], last: bool) -> None:
        super().__init__()
        self.graph = graph
        self.inputs = inputs
        self.call_args = call_args
        self.binds = binds
        self.outputs = outputs
        self.ints = ints  # sizes computed on one stage and read on a later one (a dynamic batch dim)
        self.last = last

    def forward(self, *values: Any) -> Any:
        env = {n: (v.shape[0] if n in self.ints else v) for n, v in zip(self.inputs, values)}
        result = self.graph(*[env[a] for a in self.call_args])
        for name, index in self.binds:
            env[name] = result if index is None else result[index]
        passed = set(self.inputs)
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
        out = tuple(_encode_int(env[n], device) if n in self.ints and not self.last
                    else _pass_through(env[n]) if n in passed else env[n] for n in self.outputs)
        return out[0] if len(out) == 1 else out

    def place(self, device: torch.device) -> None:
        """Put the stage on ``device``: its own tensors (constants the tracer lifted out of ``forward``; the
        user's parameters and buffers it links to move with them), and the ops that name a device
        (``torch.arange(..., device=)``, ``.to(device)``) name this one: the trace burnt in the device it
        ran on (the CPU, or the meta device for a model built there)."""
        self.to(device)
        _retarget_devices(self.graph, device)


def _encode_int(value: int, device: torch.device | None) -> torch.Tensor:
    # an int crosses a boundary as the length of an empty-valued uint8 tensor: torch pipelining sends
    # tensors only, and its metadata pass (which sees shapes, not values) still gets the right size
    return torch.empty(int(value), dtype=torch.uint8, device=device)


def _pass_through(value: Any) -> Any:
    # an input sent on unchanged: a view keeps autograd's edge back to the received tensor
    return value.view_as(value) if isinstance(value, torch.Tensor) and value.requires_grad else value


@dataclass
class TracedModel:
    """A model traced and cut into chained stages.

    Attributes:
        stages: Every stage (cheap: their graph modules hold the user's own parameters).
        in_spec: How ``(args, kwargs)`` of the model's call flatten into stage 0's inputs.
        out_spec: How the last stage's flat outputs rebuild the model's output.
        constants: Non-tensor inputs the trace specialised on, by flat index (a different value at run
            time would be silently ignored, so it is refused).
        stage_params: For each stage, the names (the user's, first name of a tied parameter) of the
            parameters it uses.
        stage_buffers: Likewise for buffers.
        carried: For each boundary ``k`` (after stage ``k``), the values it carries.
        dims: Which dimensions of the flat inputs may vary (:class:`InputDims`; ``None``: unchecked).
    """

    stages: list[TracedStage]
    in_spec: Any
    out_spec: Any
    constants: dict[int, Any] = field(default_factory=dict)
    stage_params: list[set[str]] = field(default_factory=list)
    stage_buffers: list[set[str]] = field(default_factory=list)
    carried: list[list[str]] = field(default_factory=list)
    dims: InputDims | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def flatten_inputs(self, args: tuple, kwargs: dict) -> tuple:
        """``(args, kwargs)`` of the user's ``self(...)`` call as stage 0's positional inputs."""
        try:
            flat = fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), self.in_spec)
        except Exception as err:  # noqa: BLE001 - pytree raises several types for a structure mismatch
            raise PlanError(
                f"The step calls `self(...)` with a different structure of arguments than the traced call "
                f"({pytree.tree_structure((tuple(args), dict(kwargs)))} vs {self.in_spec}): {err}. Call `self(...)` "
                f"the same way in every step."
            ) from None
        for i, value in self.constants.items():
            if flat[i] != value:
                raise PlanError(
                    f"Input {i} of `self(...)` is {flat[i]!r}, but the model was traced with {value!r}; the traced "
                    f"graph is specialised on non-tensor inputs. Pass it as a tensor, or keep it constant."
                )
        if self.dims is not None:
            self.dims.check(flat)
        return tuple(flat)

    def unflatten_output(self, output: Any) -> Any:
        """The last stage's flat output as the structure the model's ``forward`` returns."""
        flat = list(output) if isinstance(output, (tuple, list)) else [output]
        return pytree.tree_unflatten(flat, self.out_spec)


def check_points(module: nn.Module, points: list[str]) -> None:
    """Every cut point must name a submodule of ``module``."""
    names = dict(module.named_modules())
    for p in points:
        if p not in names or p == "":
            near = sorted(n for n in names if n and (n.startswith(p.rsplit(".", 1)[0]) or p.startswith(n)))[:8]
            raise PlanError(
                f"Cut point {p!r} is not a submodule of `{type(module).__name__}`. Cut points are module names at any "
                f"depth, as in `named_modules()`; near it: {near or sorted(n for n in names if n and '.' not in n)}."
            )


def trace(module: nn.Module, args: tuple, kwargs: dict, points: list[str], *, train: bool) -> TracedModel:
    """Capture ``module(*args, **kwargs)`` with ``torch.export`` and cut it before each cut point.

    Args:
        module: The LightningModule (its ``forward`` is what is traced).
        args, kwargs: One micro-batch's arguments of the user's ``self(...)`` call.
        points: Module names where stages 1, 2, ... begin, in the order ``forward`` reaches them.
        train: Capture in training mode (dropout, BatchNorm statistics) or eval mode.

    Raises:
        TraceError: ``torch.export`` cannot capture the model (data-dependent control flow, an
            untraceable op, ...), with the place and the fix.
        PlanError: a cut point that is no submodule, never runs, or runs out of order.
    """
    check_points(module, points)
    was_training = module.training
    patched = [module.get_submodule(p) for p in points]
    module.train(train)
    try:
        with isolate_rng():
            annotate_split_points(module, {p: SplitPoint.BEGINNING for p in points})
            ep, note = _export(module, args, kwargs)
            pipe = Pipe._from_traced(module, ep, MultiUseParameterConfig.REPLICATE)
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_orig_forward", None)
        module.train(was_training)
    if pipe.num_stages != len(points) + 1:
        raise PlanError(
            f"Cutting at {points} gave {pipe.num_stages} stages instead of {len(points) + 1}: a cut point whose module "
            f"`forward` never calls, calls more than once, or reaches out of order. Give the cut points in the order "
            f"`forward` runs them, each a module called exactly once."
        )
    for stage_module in pipe.split_gm.children():
        _unshadow_self(stage_module)
        _drop_metadata_checks(stage_module)
    traced = _chain(pipe)
    traced.in_spec, traced.out_spec = ep.call_spec.in_spec, ep.call_spec.out_spec
    flat = pytree.tree_leaves((tuple(args), dict(kwargs)))
    traced.constants = {i: v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)}
    traced.dims = InputDims.of(ep, flat, note)
    _point_at_user_tensors(module, traced)
    return traced


def _retarget_devices(root: nn.Module, device: torch.device) -> None:
    """Every device an op of ``root``'s graphs names, as a keyword (``torch.arange(..., device=)``) or a positional
    argument (``aten.to.device(mask, cpu, bool)``: a ``.to(x.device)`` the trace burnt in), becomes ``device``."""

    def swap(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value != device else value

    for mod in root.modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = False
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            args, kwargs = pytree.tree_map(swap, node.args), pytree.tree_map(swap, dict(node.kwargs))
            if args != node.args or kwargs != dict(node.kwargs):
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            _regenerate(mod)


def _drop_metadata_checks(root: nn.Module) -> None:
    """Remove the checks ``torch.export`` writes before a ``.to(...)`` (``_assert_tensor_metadata``: the dtype and
    device the input had while tracing): a stage is moved to its device and cast to its precision afterwards, as
    the user's module would be, and its tensors then rightly differ from the trace's (a bf16 Llama's RoPE
    ``inv_freq`` before its ``.float()``)."""
    check = torch.ops.aten._assert_tensor_metadata.default
    for mod in root.modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        found = [n for n in graph.nodes if n.op == "call_function" and n.target is check and not n.users]
        for node in found:
            graph.erase_node(node)
        if found:
            _regenerate(mod)


def _regenerate(mod: nn.Module) -> None:
    if isinstance(mod, torch.fx.GraphModule):
        mod.recompile()
    elif hasattr(mod, "finalize"):  # torch.export's unflattened InterpreterModule
        mod.finalize()


def _unshadow_self(root: nn.Module) -> None:
    """Rename graph values called ``self`` (a submodule named ``self``, as BERT's ``attention.self``, names the
    value of its call so), which the generated ``forward`` would bind over its own ``self``."""
    for mod in root.modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph) or not any(n.name == "self" for n in graph.nodes):
            continue
        for node in graph.nodes:
            if node.name == "self":
                node._rename("self_value")
        _regenerate(mod)


def _export(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, str]:
    """``torch.export`` with every dimension of every tensor input ``Dim.AUTO``; where that fails, with the batch
    dimension alone (the sizes the model then sees are fixed, and :class:`InputDims` refuses others), and why
    (``""`` when the first capture worked).

    Raises:
        TraceError: the model cannot be captured either way.
    """
    try:
        return torch.export.export(module, tuple(args), dict(kwargs), dynamic_shapes=_dynamic(module, args, kwargs)), ""
    except Exception as err:  # noqa: BLE001 - tried again below, whose error is reported
        lines = str(err).strip().splitlines()
        note = f"{type(err).__name__}: {lines[0] if lines else ''}"
    try:
        ep = torch.export.export(module, tuple(args), dict(kwargs),
                                 dynamic_shapes=_dynamic(module, args, kwargs, every_dim=False))
    except Exception as err:  # noqa: BLE001 - export raises many types; all become one clear error
        raise TraceError(_describe_export_failure(module, err)) from err
    return ep, note


def _dynamic(module: nn.Module, args: tuple, kwargs: dict, every_dim: bool = True) -> dict[str, Any]:
    """``Dim.AUTO`` for every dimension of every tensor input (``every_dim``), else for dim 0 (the micro-batch:
    forward-only passes may use micro-batches of another size). ``Dim.AUTO`` keeps a dimension static where
    the model needs that."""

    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {d: Dim.AUTO for d in range(v.dim() if every_dim else min(v.dim(), 1))} or None
        if isinstance(v, (tuple, list)):
            return type(v)(spec(x) for x in v)
        if isinstance(v, dict):
            return {k: spec(x) for k, x in v.items()}
        return None

    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    return {name: spec(value) for name, value in bound.arguments.items()}


def _chain(pipe: Pipe) -> TracedModel:
    nodes = list(pipe.split_gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_module"]
    stage_of: dict[str, int] = {n.name: -1 for n in nodes if n.op == "placeholder"}
    binds: list[list[tuple[str, int | None]]] = []
    ints: set[str] = set()
    for k, call in enumerate(calls):
        items = [(u.name, u.args[1]) for u in call.users if u.op == "call_function" and u.target is operator.getitem]
        binds.append(items or [(call.name, None)])
        produced = _output_values(getattr(pipe.split_gm, call.target))
        for name, index in binds[-1]:
            stage_of[name] = k
            value = produced[0 if index is None else index] if produced else None
            if is_int(value) or isinstance(value, torch.SymInt):
                ints.add(name)
    reader = {call.name: k for k, call in enumerate(calls)}
    last_use: dict[str, int] = {}
    for n in nodes:
        if n.op in ("call_module", "output"):
            for a in n.all_input_nodes:
                last_use[a.name] = max(last_use.get(a.name, -1), reader.get(n.name, len(calls)))
    values = [v for v in stage_of]  # graph order: placeholders, then each stage's results

    def carry(k: int) -> list[str]:  # what crosses the boundary before stage k
        return [v for v in values if stage_of[v] < k <= last_use.get(v, -1)]

    output = next(n for n in nodes if n.op == "output")
    results = [a.name for a in pytree.tree_leaves(output.args[0]) if isinstance(a, torch.fx.Node)]
    stages, carried = [], []
    for k, call in enumerate(calls):
        inputs = [v for v in values if stage_of[v] == -1] if k == 0 else carry(k)
        outputs = results if k == len(calls) - 1 else carry(k + 1)
        if k < len(calls) - 1:
            carried.append(outputs)
        call_args = [a.name for a in call.args]
        graph = getattr(pipe.split_gm, call.target)
        # run the generated code, not torch.fx.Interpreter node by node (several times faster)
        for sub in graph.modules():
            if hasattr(sub, "_run_with_interpreter"):
                sub._run_with_interpreter = False
        stages.append(TracedStage(graph, inputs, call_args, binds[k], outputs, ints, last=(k == len(calls) - 1)))
    return TracedModel(stages, None, None, carried=carried)


def _output_values(graph_module: nn.Module) -> list[Any]:
    """The traced values (``meta["val"]``) a stage's graph returns, in order."""
    graph = getattr(graph_module, "graph", None)
    output = next((n for n in graph.nodes if n.op == "output"), None) if graph is not None else None
    if output is None:
        return []
    args = output.args[0]
    args = args if isinstance(args, (tuple, list)) else [args]
    return [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]


def _point_at_user_tensors(module: nn.Module, traced: TracedModel) -> None:
    """Make every stage use the user's own parameter and buffer *slots* (the tracer replicates tied
    parameters and keeps its own registries), and record which user parameters each stage uses.

    Each registry entry of a stage's graph that the user's model also has becomes a link to the user's
    entry (:class:`LinkedRegistry`): a move or cast of either module (``Module.to`` replaces buffers with new
    tensors, a meta model's materialization replaces parameters) is seen by both, so the stage always reads
    the tensors the user's model, its ``state_dict`` and the optimizer hold."""
    params = dict(module.named_parameters(remove_duplicate=False))
    canonical = {id(p): n for n, p in module.named_parameters()}
    buffers = dict(module.named_buffers(remove_duplicate=False))
    for stage in traced.stages:
        used_p, used_b = set(), set()
        for registry, source, used in (("_parameters", params, used_p), ("_buffers", buffers, used_b)):
            for owner_name, owner in stage.graph.named_modules(remove_duplicate=False):
                links = {}
                for key in getattr(owner, registry):
                    full = f"{owner_name}.{key}" if owner_name else key
                    if full not in source:
                        continue  # a constant the tracer lifted out of forward: the stage's own
                    user_owner, _, leaf = full.rpartition(".")
                    links[key] = (getattr(module.get_submodule(user_owner), registry), leaf)
                    used.add(canonical[id(source[full])] if registry == "_parameters" else full)
                if links:
                    owner.__dict__[registry] = LinkedRegistry(getattr(owner, registry), links)
        traced.stage_params.append(used_p)
        traced.stage_buffers.append(used_b)


class LinkedRegistry(MutableMapping):
    """A module's ``_parameters`` or ``_buffers`` whose entries ``links`` names are slots of other
    registries: ``registry[key]`` reads, and assigning writes, ``target[name]`` of ``links[key] = (target,
    name)``; the other entries are the module's own. Key order is the original registry's."""

    def __init__(self, own: dict, links: dict[str, tuple[dict, str]]) -> None:
        self._order = list(own)
        self._own = {k: v for k, v in own.items() if k not in links}
        self._links = dict(links)

    def __getitem__(self, key: str) -> Any:
        if key in self._links:
            target, name = self._links[key]
            return target[name]
        return self._own[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self._links:
            target, name = self._links[key]
            target[name] = value
            return
        if key not in self._own:
            self._order.append(key)
        self._own[key] = value

    def __delitem__(self, key: str) -> None:
        if key not in self._links and key not in self._own:
            raise KeyError(key)
        self._links.pop(key, None)
        self._own.pop(key, None)
        self._order.remove(key)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._links or key in self._own


def _describe_export_failure(module: nn.Module, err: BaseException) -> str:
    cause: BaseException = err
    while cause.__cause__ is not None and not _user_frames(cause):
        cause = cause.__cause__
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    where = ""
    frames = _user_frames(cause) or _user_frames(err)
    if frames:
        f = frames[-1]
        where = f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"
    return (
        f"torch.export cannot capture `{type(module).__name__}.forward` for the traced frontend{where}: "
        f"{type(cause).__name__}: {first}. Typical causes are control flow on tensor values (`if x.sum() > 0:`), "
        f"`.item()` / `.tolist()` / `.nonzero()`, or an op without a meta kernel. Fix: write that code with "
        f"`torch.where` / `torch.cond`, or cut the model only between modules its forward applies as a chain, "
        f"so that `HPPStrategy(frontend='sequential')` runs it as written."
    )


def _user_frames(err: BaseException) -> list[traceback.FrameSummary]:
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ else []
    skip = ("/torch/", "/lightning/", "/lightning_hpp/", "/transformers/utils/", "<frozen", "/contextlib.py")
    return [f for f in frames if not any(s in f.filename for s in skip)]
