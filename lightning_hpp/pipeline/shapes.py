"""Boundary shapes that change from step to step: sequences padded to each batch's longest, evaluation
batches of another length.

torch pipelining infers a stage's boundary shapes once, at its schedule's first step, and allocates the
receive buffers for them. Here they follow the batch (the dtypes stay the plan's):

* **One id a step.** Before the schedule runs, the first stage's rank names the shapes of the step's
  pipeline input with an id (a new one for shapes it has not seen) and sends it to the pipeline's other ranks:
  one int64 each, which they receive while they wait for their first activation anyway (a send is posted in
  ~20 µs; gloo's asynchronous broadcast took 140 µs of the first stage's rank).
* **Shapes seen before** are installed from what each stage recorded for that id: its boundary metadata,
  and receive buffers that are views of one storage per receive slot, grown to the largest shape seen
  (a shape seen before, or a smaller one, allocates nothing). The previous step's id changes nothing.
* **New shapes** are handed over in band, as Megatron-Core's ``variable_seq_lengths`` does, but once per
  boundary and step: before its first activation of the step a stage sends the shapes of its outputs (a
  header of int64 dimensions) to the next stage's rank, which sizes its receive buffers before posting the
  receive. Gradients have the shapes of their activations, so they need no header.

Micro-batches of one batch share their shapes: they are equal slices of the batch's tensors, which the
collate pads as a whole. A stage whose output shape differs between the micro-batches of one batch, or from
what earlier batches with the same input shapes gave (a shape that depends on values), is refused before it
sends, with both shapes: gloo and NCCL receive into buffers of a fixed size. A stage whose forward fails on
new shapes (a dimension the model fixes) raises :class:`~lightning_hpp.errors.ShapeError` naming the
dimension, both shapes and the fix; the other ranks end with it (:mod:`lightning_hpp.launch`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from lightning_hpp._dist import group_device
from lightning_hpp.errors import ShapeError

CACHE_SIZE = 1024
"""Sets of shapes a schedule's stages keep the boundary metadata of (least recently used dropped first)."""


def signature(values: Any) -> tuple:
    """The shapes and dtypes of the tensors in ``values`` (the first stage's inputs of a step)."""
    if not all(isinstance(v, torch.Tensor) for v in values):
        values = pytree.tree_leaves(values)
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values)


@dataclasses.dataclass
class ShapeStats:
    """What one step cost this rank's stages in shape hand-over.

    Attributes:
        new: The step's shapes were new to the schedule (handed over in band).
        ns: Host time spent on them: headers posted and read, metadata rebuilt, buffers viewed or allocated
            (not the wait for the previous stage's header, which stands in for the wait for its activation).
        alloc_bytes: Receive storage allocated because a shape was larger than any before.
    """

    new: bool = False
    ns: int = 0
    alloc_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class StageShapes:
    """One stage's boundary metadata (torch's ``TensorMeta`` tuples) for one set of shapes."""

    inputs: tuple
    outputs: tuple
    input_grads: tuple | None
    output_grads: tuple | None

    @classmethod
    def of(cls, stage: Any) -> StageShapes:
        m = stage._stage_meta
        return cls(m.inputs, m.outputs, m.input_grads, m.output_grads)


def _reshaped(meta: Any, shape: tuple[int, ...]) -> Any:
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(d, 1)
    return dataclasses.replace(meta, shape=torch.Size(shape), stride=tuple(reversed(stride)))


def _shapes(metas: tuple | None) -> list[tuple[int, ...]]:
    return [tuple(m.shape) for m in metas or ()]


class StageBoundary:
    """The shape side of one pipeline stage (``stage.shapes``): its receive storages and the in-band hand-over
    of new shapes, driven by the stage's ``get_fwd_recv_ops``, ``forward_one_chunk`` and ``get_fwd_send_ops``.

    ``seen`` maps a stage index to the input shapes of the last step it ran (shared by a runner's schedules:
    training and evaluation), what a refusal compares the new shapes with."""

    def __init__(self, stage: Any, seen: dict[int, list[tuple[int, ...]]] | None = None) -> None:
        self.stage = stage
        self.seen = {} if seen is None else seen
        self.storage: dict[tuple, torch.Tensor] = {}
        self.fresh = False
        self.stats = ShapeStats()
        self._inputs_known = self._outputs_known = self._header_sent = False
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._before: StageShapes | None = None

    # ------------------------------------------------------------------ placement
    def _local(self, other: int) -> bool:
        s = self.stage
        return s.stage_index_to_group_rank.get(other) == s.group_rank

    def _peer(self, other: int) -> int:
        return self.stage._resolve_peer_global_rank(other)

    # ------------------------------------------------------------------ buffers
    def adopt(self) -> None:
        """Take the receive buffers torch allocated at the schedule's first step as this stage's storages (a stage fed
        on this rank holds the previous stage's tensors there instead: nothing to take)."""
        s = self.stage
        local_in = s.is_first or self._local(s.stage_index - 1)
        local_out = s.is_last or self._local(s.stage_index + 1)
        for kind, table, local in (("F", s.args_recv_info, local_in), ("B", s.grad_recv_info, local_out)):
            if local:
                continue
            for chunk, infos in table.items():
                for i, info in enumerate(infos):
                    buf = getattr(info, "buffer", None)
                    if not getattr(info, "is_root_arg", False) and buf is not None and buf.is_contiguous():
                        self.storage[(kind, chunk, i)] = buf.detach().view(-1)

    def _view(self, key: tuple, meta: Any) -> torch.Tensor:
        shape = tuple(meta.shape)
        n = math.prod(shape)
        st = self.storage.get(key)
        if st is None or st.numel() < n or st.dtype != meta.dtype:
            st = self.storage[key] = torch.empty(n, dtype=meta.dtype, device=self.stage.device)
            self.stats.alloc_bytes += n * st.element_size()
        return st[:n].view(shape).detach()

    def _rebind_inputs(self) -> None:
        s = self.stage
        metas, local = s._stage_meta.inputs, s.is_first or self._local(s.stage_index - 1)
        for chunk, infos in s.args_recv_info.items():
            for i, info in enumerate(infos):
                info.tensor_meta = metas[i]
                if not local:  # a stage fed on this rank (the V's tip) gets the tensor itself
                    info.buffer = self._view(("F", chunk, i), metas[i])

    def _rebind_grads(self) -> None:
        s = self.stage
        if s.is_last or not s.has_backward:
            return
        metas, local = s._stage_meta.output_grads, self._local(s.stage_index + 1)
        for chunk, infos in s.grad_recv_info.items():
            for i, info in enumerate(infos):
                info.tensor_meta = metas[i]
                if not local:
                    info.buffer = None if metas[i] is None else self._view(("B", chunk, i), metas[i])

    def install(self, shapes: StageShapes) -> None:
        """Use metadata recorded for shapes seen before (no communication)."""
        t0 = time.perf_counter_ns()
        m = self.stage._stage_meta
        m.inputs, m.outputs, m.input_grads, m.output_grads = (shapes.inputs, shapes.outputs, shapes.input_grads,
                                                              shapes.output_grads)
        self._rebind_inputs()
        self._rebind_grads()
        self.stats.ns += time.perf_counter_ns() - t0

    # ------------------------------------------------------------------ new shapes, in band
    def begin_fresh(self) -> None:
        """The coming step's shapes are new: learn them from the step's first activations."""
        self.fresh, self.stats.new = True, True
        self._inputs_known = self._outputs_known = self._header_sent = False
        self._before = StageShapes.of(self.stage)
        if any(type(meta).__name__ == "_DTensorMeta" for meta in (*self._before.inputs, *self._before.outputs)):
            raise ShapeError(
                f"Stage {self.stage.stage_index} passes DTensors across its boundary, whose shapes cannot change "
                f"between steps: this batch's shapes differ from the first one's. Pad every batch to one shape (in "
                f"the collate), or keep tensor-parallel outputs whole at the stage's boundary.")

    def _set_inputs(self, shapes: list[tuple[int, ...]]) -> None:
        m = self.stage._stage_meta
        m.inputs = tuple(_reshaped(meta, s) for meta, s in zip(m.inputs, shapes))
        if m.input_grads is not None:
            m.input_grads = tuple(None if g is None else _reshaped(g, s) for g, s in zip(m.input_grads, shapes))
        self._rebind_inputs()
        self._inputs_known = True

    def receive(self, chunk: int) -> None:
        """Before the first receive of a fresh step: the previous stage's header, then buffers of its shapes."""
        s = self.stage
        if not self.fresh or self._inputs_known or s.is_first or self._local(s.stage_index - 1):
            return  # the first stage and the V's tip learn theirs in forward_one_chunk (local_inputs)
        if chunk != 0:
            raise RuntimeError(f"internal: stage {s.stage_index} receives micro-batch {chunk} first; the shape header "
                               f"goes with micro-batch 0")
        ndims = [len(m.shape) for m in s._stage_meta.inputs]
        header = torch.empty(sum(ndims), dtype=torch.int64, device=s.device)
        if header.numel():
            dist.recv(header, src=self._peer(s.stage_index - 1), group=s.group)
        t0 = time.perf_counter_ns()
        dims, shapes = header.tolist(), []
        for n in ndims:
            shapes.append(tuple(dims[:n]))
            dims = dims[n:]
        self._set_inputs(shapes)
        self.stats.ns += time.perf_counter_ns() - t0

    def local_inputs(self, chunk: int, args: Any) -> None:
        """A fresh step's inputs of a stage that receives nothing over the network (the first stage, the V's tip)."""
        if not self.fresh or self._inputs_known:
            return
        s = self.stage
        if s.is_first:
            values = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        else:
            values = [info.buffer for info in s.args_recv_info[chunk]]
        if len(values) == len(s._stage_meta.inputs):
            t0 = time.perf_counter_ns()
            self._set_inputs([tuple(v.shape) for v in values])
            self.stats.ns += time.perf_counter_ns() - t0

    def learn_outputs(self, chunk: int) -> None:
        """After the first forward of a fresh step: the outputs' metadata, and gradient buffers of their shapes."""
        if not self.fresh or self._outputs_known:
            return
        t0 = time.perf_counter_ns()
        s = self.stage
        outs, metas = s.fwd_cache[chunk][0], s._stage_meta.outputs
        self._check_structure(outs, metas)
        shapes = [tuple(o.shape) for o in outs]
        m = s._stage_meta
        m.outputs = tuple(_reshaped(meta, sh) for meta, sh in zip(metas, shapes))
        if m.output_grads is not None:
            m.output_grads = tuple(None if g is None else _reshaped(g, sh) for g, sh in zip(m.output_grads, shapes))
        self._rebind_grads()
        self._outputs_known = True
        self.stats.ns += time.perf_counter_ns() - t0

    def _check_structure(self, outs: tuple, metas: tuple) -> None:
        s = self.stage
        got = [tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outs]
        if len(outs) != len(metas) or any(not isinstance(o, torch.Tensor) or o.dim() != len(mt.shape)
                                          for o, mt in zip(outs, metas)):
            raise ShapeError(
                f"Stage {s.stage_index} returns {got} for this batch, but {_shapes(metas)} for the first one: the "
                f"number of values a stage passes on and their numbers of dimensions must stay the same; only sizes "
                f"may change. Return the same structure from every batch.")

    def send(self, chunk: int) -> None:
        """Before a forward send: refuse a shape the next stage does not expect; in a fresh step, send the header."""
        s = self.stage
        outs, metas = s.fwd_cache[chunk][0], s._stage_meta.outputs
        for i, (out, meta) in enumerate(zip(outs, metas)):
            if out.shape != meta.shape:
                source = ("micro-batch 0 of this batch gave it" if self.fresh
                          else "what the pipeline recorded for this batch's input shapes")
                raise ShapeError(
                    f"Stage {s.stage_index} would pass on output {i} of shape {tuple(out.shape)} for micro-batch "
                    f"{chunk}, but the next stage expects {tuple(meta.shape)} ({source}). Boundary shapes must "
                    f"be the same for every micro-batch of a batch and follow from the shapes of the pipeline's input: "
                    f"pad each batch as a whole in the collate (micro-batches are equal slices of it), and keep shapes "
                    f"that depend on values (padding dropped inside the model) within one stage.")
        if self.fresh and not self._header_sent and not s.is_last and not self._local(s.stage_index + 1):
            t0 = time.perf_counter_ns()
            header = torch.tensor([d for o in outs for d in o.shape], dtype=torch.int64, device=s.device)
            if header.numel():
                self._sends.append((dist.isend(header, dst=self._peer(s.stage_index + 1), group=s.group), header))
            self._header_sent = True
            self.stats.ns += time.perf_counter_ns() - t0

    def failed(self, err: BaseException) -> ShapeError | None:
        """The error to raise for a forward that failed on shapes it had not run before (``None``: not a shape's
        doing). The stage's first forward is torch's metadata inference at a schedule's first step."""
        cause = err.__cause__ if isinstance(err.__cause__, BaseException) else err
        if type(cause).__module__.startswith("lightning_hpp"):
            return None  # our own verdicts (a NaN guard, a refusal) say what they are
        k = self.stage.stage_index
        now = _shapes(self.stage._stage_meta.inputs)
        before = _shapes(self._before.inputs) if self.fresh and self._before is not None else self.seen.get(k)
        text = str(cause).strip().splitlines()
        if before is None or before == now:
            last = "the first batch it runs"
        else:
            changed = [f"dim {d} of input {i}: {a[d]} -> {b[d]}" for i, (a, b) in enumerate(zip(before, now))
                       if len(a) == len(b) for d in range(len(a)) if a[d] != b[d]]
            last = f"the last batch it ran had {before}: {'; '.join(changed) or 'other sizes'}"
        return ShapeError(
            f"Stage {k} cannot run on this batch's shapes: its inputs are {now} ({last}), and its forward fails on "
            f"them ({type(cause).__name__}: {text[0] if text else ''}). The model fixes that dimension to the size it "
            f"was built for. Fix: give every batch that size there (pad in the collate to one length, e.g. "
            f"`padding='max_length'`), or change the model so that the dimension may vary.")

    def finish(self) -> None:
        """After a fresh step: its header sends done; the shapes are known now."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self.fresh = False


class _ScheduleShapes:
    """One schedule's stages and the metadata they recorded per id of input shapes."""

    def __init__(self, stages: list[Any], seen: dict[int, list[tuple[int, ...]]]) -> None:
        self.boundaries = []
        for stage in stages:
            stage.shapes = StageBoundary(stage, seen)
            self.boundaries.append(stage.shapes)
        self.cache: OrderedDict[int, dict[int, StageShapes]] = OrderedDict()
        self.current: int | None = None
        self.started = False
        self.last = ShapeStats()

    def begin(self, key: int) -> None:
        for b in self.boundaries:
            b.stats = ShapeStats()
        if not self.started or key == self.current:  # torch infers at the first step; the same shapes change nothing
            return
        known = self.cache.get(key)
        if known is not None:
            self.cache.move_to_end(key)
            for b in self.boundaries:
                b.install(known[b.stage.stage_index])
            self.current = key
            return
        for b in self.boundaries:
            b.begin_fresh()

    def end(self, key: int) -> None:
        if not self.started:
            self.started = True
            for b in self.boundaries:
                b.adopt()
        for b in self.boundaries:
            if b.fresh:
                b.finish()
            b.seen[b.stage.stage_index] = _shapes(b.stage._stage_meta.inputs)
        if key not in self.cache:
            self.cache[key] = {b.stage.stage_index: StageShapes.of(b.stage) for b in self.boundaries}
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        self.current = key
        stats = [b.stats for b in self.boundaries]
        self.last = ShapeStats(any(x.new for x in stats), sum(x.ns for x in stats), sum(x.alloc_bytes for x in stats))


class BoundaryShapes:
    """A runner's hand-over of boundary shapes: ``instrument`` is a ``PipelineRunner.schedule_observers`` entry.

    Args:
        group: The pipeline group (``None`` or one rank: nothing crosses a boundary, nothing is done).
        holds_first: Whether this rank holds the first stage (it names each step's shapes).
    """

    def __init__(self, group: Any, holds_first: bool) -> None:
        self.group = group
        self.holds_first = holds_first
        self.enabled = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
        self._peers = range(1, dist.get_world_size(group)) if self.enabled else range(0)
        self._box: torch.Tensor | None = None  # the id sent or received (a step's sends are waited for before the next)
        self._ids: dict[tuple, int] = {}
        self._seen: dict[int, list[tuple[int, ...]]] = {}

    def instrument(self, schedule: Any) -> None:
        """Give the schedule's stages their :class:`StageBoundary` and its ``step`` the id of each step's shapes."""
        if not self.enabled or getattr(schedule, "_hpp_shapes", None) is not None:
            return
        stages = list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]
        state = schedule._hpp_shapes = _ScheduleShapes(stages, self._seen)
        step = schedule.step

        def step_with_shapes(*args: Any, **kwargs: Any) -> Any:
            key, sent = self._step_id(args)
            state.begin(key)
            out = step(*args, **kwargs)
            state.end(key)
            for work in sent:
                work.wait()
            return out

        schedule.step = step_with_shapes

    def _step_id(self, args: tuple) -> tuple[int, list[Any]]:
        """The id of this step's input shapes, sent by the first stage's rank (pipeline position 0) to every other
        rank of the pipeline before any other message of the step, and the sends to wait for."""
        if self._box is None:
            self._box = torch.zeros(1, dtype=torch.int64, device=group_device(self.group))
        box = self._box
        if self.holds_first:
            sig = signature(args)
            key = self._ids.get(sig)
            if key is None:
                key = self._ids[sig] = len(self._ids)
            box.fill_(key)
            return key, [dist.isend(box, group_dst=peer, group=self.group) for peer in self._peers]
        dist.recv(box, group_src=0, group=self.group)
        return int(box.item()), []


def step_shape_stats(schedule: Any) -> ShapeStats | None:
    """What the schedule's last step cost this rank in shape hand-over (``None``: shapes are not handed over)."""
    state = getattr(schedule, "_hpp_shapes", None)
    return None if state is None else state.last
