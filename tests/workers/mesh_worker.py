"""One rank of the mesh test: every layout of ``OUT/cases.json`` built on 4 gloo ranks, and what this rank
sees of it. Writes ``OUT/rank{r}.json``: per case, the error raised or the rank's place, the ranks an
all-reduce over each group reached, what the ``DeviceMesh`` says, and what the step's exchange
(:class:`~lightning_hpp.pipeline.exchange.StepExchange`) over the layout gave this rank in a few steps.

Usage (RANK, WORLD_SIZE, MASTER_ADDR/PORT set): python tests/workers/mesh_worker.py OUT
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the mesh needs only lightning_hpp.errors: a bare package skips lightning_hpp/__init__.py, which imports
# Lightning (seconds per rank, four ranks on a shared machine)
_pkg = types.ModuleType("lightning_hpp")
_pkg.__path__ = [str(ROOT / "lightning_hpp")]
sys.modules.setdefault("lightning_hpp", _pkg)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_hpp.errors import PlanError  # noqa: E402
from lightning_hpp.pipeline.dims import ParallelDims  # noqa: E402
from lightning_hpp.pipeline.exchange import StepExchange  # noqa: E402
from lightning_hpp.pipeline.mesh import Mesh  # noqa: E402
from lightning_hpp.pipeline.steps import StepLogs  # noqa: E402

SCHEMA = [("plain", {}), ("mean", {"sync_dist": True}), ("max", {"sync_dist": True, "reduce_fx": "max"}),
          ("sum", {"sync_dist": True, "reduce_fx": "sum"})]


def exchange_steps(mesh: Mesh) -> list:
    """Four steps of a training exchange: a new schema (values through the object gather), the same schema (values
    through the buffer), the last stage of pipeline 0 failing to reduce its logs, synced values that only
    pipeline 0 logs (the others log a plain value only). Each holder of a last stage logs values made from its
    pipeline (column) and the step; each rank flags ``[rank + 1, step]`` on rank 3 only, and ``[0, 0]``
    elsewhere."""
    ex = StepExchange(mesh, mesh.step_group, torch.device("cpu"))
    last = mesh.position == mesh.pp - 1
    c, rank = mesh.column, mesh.rank
    out = []
    for step in range(4):
        schema = SCHEMA if step < 3 or c == 0 else SCHEMA[:1]
        logs = StepLogs(schema, torch.tensor([10.0 * c + step + i for i in range(len(schema))]))
        error = "pipeline 0 cannot reduce its logs" if step == 2 and c == 0 else None
        flags = [torch.tensor(float(rank + 1 if rank == 3 else 0)), torch.tensor(float(step if rank == 3 else 0))]
        ex.start(torch.tensor(100.0 * c + step) if last else None, logs if last else None, error if last else None,
                 flags, last=last)
        try:
            loss, got, rows = ex.finish()
        except PlanError as e:
            out.append({"error": str(e)})
            continue
        out.append({"loss": float(loss), "schema": [[n, {k: str(v) for k, v in kw.items()}] for n, kw in got.schema],
                    "values": got.values.tolist(), "flags": rows})
    return out


def reached(group, world: int) -> list[int]:
    """The global ranks an all-reduce over ``group`` sums: each rank adds a one at its own index."""
    hot = torch.zeros(world)
    hot[dist.get_rank()] = 1.0
    dist.all_reduce(hot, group=group)
    return [r for r in range(world) if hot[r] == 1.0]


def one(case: dict, rank: int, world: int) -> dict:
    try:
        dp = world // case["pp"]
        shard = case.get("dp_shard", 1)
        mesh = Mesh.build(ParallelDims(case["pp"], dp // shard, shard), rank, grid=case.get("grid"))
        mesh.init_groups(**({"device_type": case["device_type"]} if "device_type" in case else {}))
    except PlanError as e:
        return {"error": type(e).__name__, "message": str(e)}
    dm = mesh.device_mesh
    out = {
        "position": mesh.position,
        "replica": mesh.replica,
        "pp_reached": reached(mesh.pp_group, world),
        "dp_reached": reached(mesh.dp_group, world),
        "pp_group_ranks": dist.get_process_group_ranks(mesh.pp_group),
        "pp_group_rank": dist.get_group_rank(mesh.pp_group, rank),
        "dim_names": list(dm.mesh_dim_names),
        "mesh": dm.mesh.tolist(),
        "device_type": dm.device_type,
        "coordinate": list(dm.get_coordinate()),
        "dp_slice_is_dp_group": mesh.dp_mesh.get_group() is mesh.dp_group and dm["dp"].get_group() is mesh.dp_group,
        "pp_slice_is_pp_group": dm["pp"].get_group() is mesh.pp_group,
        "shard_reached": reached(mesh.dp_shard_group, world),
        "replicate_reached": reached(mesh.dp_replicate_group, world),
        "tp_reached": reached(mesh.tp_group, world),
        "shard_mesh_dims": list(mesh.shard_mesh.mesh_dim_names),
    }
    out["exchange"] = exchange_steps(mesh)
    if case.get("position_sets"):
        sets = [tuple(s) for s in case["position_sets"]]
        groups = mesh.groups_over_positions(sets)
        out["over_positions"] = [None if groups[s] is None else reached(groups[s], world) for s in sets]
    return out


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = json.loads((out_dir / "cases.json").read_text())
    results = [one(case, rank, world) for case in cases]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
