"""The step's one collective: the last stage's loss and logs to every rank, every rank's check flags to all.

Every rank of the job adds its part to one float32 buffer and the buffer is summed over a group of all
ranks (:attr:`~lightning_hpp.pipeline.mesh.Mesh.step_group`, a communicator of its own, so that the
collective may run beside the pipeline's sends and the gradients' all-reduce). The buffer holds one block
per pipeline (``column``: a replica, or a replica's tensor-parallel rank) and one slot row per rank::

    [status, loss, values...] of pipeline 0 | ... | of pipeline C-1 | flags of rank 0 | ... | of rank W-1

Only the rank holding its pipeline's last stage fills that pipeline's block; a rank fills its own flags.
After the sum each rank reads its pipeline's loss and values, reduces the ``sync_dist=True`` values over the
replicas with their ``reduce_fx``, and takes each pipeline position's flags as the maximum over every rank at
that position: the data-parallel reduction of values and flags rides on the same collective.

The names and options of the values (each pipeline's schema) travel only when they change, and what the step
returned besides its loss (the keys of a returned dict, merged over the micro-batches) only when there is
any: the pipeline's status then has bit 1 (a new schema), 2 (the last stage's logs or outputs could not be
reduced; the error is raised on every rank) or 4 (returned outputs), and every rank joins one object gather
that brings them.

:meth:`StepExchange.start` posts the collective without waiting; the runner starts it as soon as this
rank's part is final, before the rank's last backward of the step (its flags and, on the last stage, its
losses are known by then), so the collective runs during that backward and :meth:`StepExchange.finish`
finds it done.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_hpp._dist import group_device
from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.mesh import Mesh
from lightning_hpp.pipeline.steps import REDUCED, StepLogs, reduce_fx_name

_NEW_SCHEMA, _ERROR, _OUTPUTS = 1, 2, 4


class StepExchange:
    """One kind of step's exchange (training and evaluation keep separate ones: their schemas differ).

    Args:
        mesh: The world layout (pipelines, positions, replicas).
        group: A group of every rank (``None`` with one process).
        device: Where the returned loss and values go (this rank's device).
    """

    def __init__(self, mesh: Mesh, group: Any, device: torch.device) -> None:
        self.mesh = mesh
        self.group = group
        self.device = device
        self.columns = mesh.dp * mesh.tp
        self.world = mesh.pp * self.columns
        self._schemas: list[list[tuple[str, dict]]] = [[] for _ in range(self.columns)]
        self._sync_index: list[tuple[int, str, list[int | None]]] | None = None
        self._pending: tuple | None = None
        self.outputs: Any = None  # what the last finished step returned besides its loss, for this rank's pipeline

    @property
    def started(self) -> bool:
        return self._pending is not None

    def _layout(self) -> tuple[list[int], int]:
        offsets, at = [], 0
        for schema in self._schemas:
            offsets.append(at)
            at += 2 + len(schema)
        return offsets, at

    def start(self, loss: torch.Tensor | None, logs: StepLogs | None, error: str | None, flags: list[torch.Tensor],
              last: bool, outputs: Any = None) -> None:
        """Post this rank's part: its pipeline's ``loss``, ``logs`` and returned ``outputs`` (the step's extras,
        ``None`` for none; or the ``error`` that reducing them raised) when ``last`` (it holds the pipeline's last
        stage), and its check ``flags`` (0-dim tensors; as many on every rank)."""
        n_flags = len(flags)
        column = self.mesh.column
        offsets, flags_at = self._layout()
        device = group_device(self.group)
        buf = torch.zeros(flags_at + self.world * n_flags, dtype=torch.float32, device=device)
        status, payload = 0, None
        if last:
            at = offsets[column]
            if error is not None:
                status, payload = _ERROR, {"error": error}
            else:
                payload = {}
                if logs.schema != self._schemas[column]:
                    status, payload["logs"] = _NEW_SCHEMA, (logs.schema, logs.values.tolist())
                elif logs.schema:
                    buf[at + 2 : at + 2 + len(logs.schema)] = logs.values.to(device)
                if outputs is not None:
                    status, payload["outputs"] = status | _OUTPUTS, _to_cpu(outputs)
            buf[at] = float(status)
            if loss is not None:
                buf[at + 1] = loss.detach().to(device, torch.float32)
        if flags:
            row = flags_at + self.mesh.rank * n_flags
            buf[row : row + n_flags] = torch.stack([f.to(device, torch.float32) for f in flags])
        work = dist.all_reduce(buf, group=self.group, async_op=True) if self.world > 1 else None
        self._pending = (buf, work, offsets, flags_at, n_flags, payload if status else None)

    def abandon(self) -> None:
        """Forget a started exchange (the step failed on this rank; its peers end with their own errors)."""
        self._pending = None

    def finish(self) -> tuple[torch.Tensor, StepLogs, list[list[float]]]:
        """Wait for the collective and read it.

        Returns:
            This pipeline's loss (a 0-dim tensor on :attr:`device`), its logs with the ``sync_dist=True`` values
            reduced over the replicas (replayed with ``sync_dist_group=REDUCED``, and every value so with one
            replica), and every pipeline position's flags (the maximum over the ranks there).

        Raises:
            PlanError: The last stage of some pipeline could not reduce its logs (on every rank alike), or a
                ``sync_dist=True`` value is not logged by every replica.
        """
        assert self._pending is not None, "internal: finish() without start()"
        buf, work, offsets, flags_at, n_flags, payload = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        host = buf.tolist()  # the step's one host read: the statuses and the flags
        statuses = [host[at] for at in offsets]
        values: dict[int, torch.Tensor] = {}
        self.outputs = None
        if any(statuses):
            errors = []
            for got in self._gather(payload):
                if got is None:
                    continue
                column, content = got
                if "error" in content:
                    errors.append(content["error"])
                    continue
                if "logs" in content:
                    self._schemas[column] = content["logs"][0]
                    values[column] = torch.tensor(content["logs"][1], dtype=torch.float32, device=buf.device)
                    self._sync_index = None
                if column == self.mesh.column and "outputs" in content:
                    self.outputs = move_data_to_device(content["outputs"], self.device)
            if errors:  # after every schema is taken: the exchange stays usable for a later step
                raise PlanError(errors[0])
        for c, at in enumerate(offsets):
            values.setdefault(c, buf[at + 2 : at + 2 + len(self._schemas[c])])
        column = self.mesh.column
        loss = buf[offsets[column] + 1].to(self.device)
        logs = self._logs(column, values)
        rows = []
        for position in range(self.mesh.pp):
            ranks = self.mesh.grid[position]
            rows.append([max(host[flags_at + r * n_flags + i] for r in ranks) for i in range(n_flags)])
        return loss, logs, rows

    def _gather(self, payload: Any) -> list[Any]:
        mine = None if payload is None else (self.mesh.column, payload)
        if self.world == 1:
            return [mine]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, mine, group=self.group)
        return out

    def _logs(self, column: int, values: dict[int, torch.Tensor]) -> StepLogs:
        """``column``'s logs, its ``sync_dist=True`` values reduced over the replicas with their ``reduce_fx``.

        Those are replayed with ``sync_dist_group=REDUCED``: Lightning still sees the user's ``sync_dist=True`` (no
        warning to add it), and the strategy's ``reduce`` returns such values as they are (Lightning would reduce
        over the world, where each replica's value sits on every one of its pipeline ranks). With one replica every
        value is already the job's: all are replayed so (Lightning's advice to add ``sync_dist=True`` would be wrong
        there, and the value is the same either way)."""
        schema = self._schemas[column]
        dp = self.mesh.dp
        marked = [(name, {**kw, "sync_dist": True, "sync_dist_group": REDUCED}) if kw.get("sync_dist") or dp == 1
                  else (name, kw) for name, kw in schema]
        own = values[column]
        if dp == 1:
            return StepLogs(marked, own.to(self.device))
        entries = self._sync_entries(column)  # checks every pipeline's synced values, on every rank alike
        if not entries:
            return StepLogs(marked, own.to(self.device))
        out = own.clone()
        for i, fx, where in entries:
            parts = torch.stack([values[c][j] for c, j in enumerate(where) if j is not None])
            out[i] = parts.sum() / dp if fx == "mean" else getattr(parts, fx)()
        return StepLogs(marked, out.to(self.device))

    def _sync_entries(self, column: int) -> list[tuple[int, str, list[int | None]]]:
        """For each ``sync_dist=True`` value of ``column``: its index, its ``reduce_fx`` and its index in each
        pipeline of the same tensor-parallel rank (``None`` elsewhere); checked once per schema change on every
        rank alike (every replica must log every synced value)."""
        if self._sync_index is not None:
            return self._sync_index
        tp = self.mesh.tp
        names = [{name: j for j, (name, _) in enumerate(s)} for s in self._schemas]
        for c, schema in enumerate(self._schemas):
            for name, kw in schema:
                if not kw.get("sync_dist"):
                    continue
                missing = [c2 // tp for c2 in range(c % tp, self.columns, tp) if name not in names[c2]]
                if missing:
                    raise PlanError(
                        f"`self.log({name!r}, ..., sync_dist=True)` was logged by replica {c // tp} and not by "
                        f"replica(s) {missing} in the same step; `sync_dist=True` reduces a value over every replica, "
                        f"so every replica must log it. Log it on every batch, or without `sync_dist`."
                    )
        entries = []
        for i, (name, kw) in enumerate(self._schemas[column]):
            if kw.get("sync_dist"):
                where = [names[c].get(name) if c % tp == column % tp else None for c in range(self.columns)]
                entries.append((i, reduce_fx_name(name, kw.get("reduce_fx", "mean")), where))
        self._sync_index = entries
        return entries


def _to_cpu(obj: Any) -> Any:
    """``obj`` with its tensors on the CPU (an object gather pickles them; a device tensor would land on the
    sender's device index)."""
    return move_data_to_device(obj, torch.device("cpu"))
