"""The pp × dp layout on torch's ``DeviceMesh``: four real gloo processes build every layout below, and
each rank's place, its groups (what an all-reduce over each reaches) and the ``("pp", "dp_replicate",
"dp_shard", "tp")`` mesh are checked against the grid; a grid whose pipeline does not ascend is refused
on every rank. Over each layout the step's exchange runs four steps, checked against what the grid says
each rank must receive.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.launch import Job, run_job
from tests.harness.results import rank_results

WORLD = 4
CASES = [
    {"name": "default pp=2", "pp": 2},  # grid [[0, 1], [2, 3]]
    {"name": "replicas interleaved", "pp": 2, "grid": [[0, 2], [1, 3]], "device_type": "cpu"},
    {"name": "a row out of rank order", "pp": 2, "grid": [[0, 1], [3, 2]]},
    {"name": "pp=1", "pp": 1},
    {"name": "dp=1", "pp": 4, "position_sets": [[0, 3], [1, 2]]},
    {"name": "pp=2 fsdp", "pp": 2, "dp_shard": 2},  # each stage sharded over its 2 replicas
    {"name": "hsdp 2x2", "pp": 1, "dp_shard": 2},  # 2 replica groups of 2 shards
    {"name": "fsdp interleaved", "pp": 2, "dp_shard": 2, "grid": [[0, 2], [1, 3]]},
    {"name": "pipeline descends", "pp": 2, "grid": [[1, 3], [0, 2]]},
]


def _grid(case: dict) -> list[list[int]]:
    pp = case["pp"]
    dp = WORLD // pp
    return case.get("grid") or [[r * dp + d for d in range(dp)] for r in range(pp)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[list[dict]]:
    out = tmp_path_factory.mktemp("mesh")
    (out / "cases.json").write_text(json.dumps(CASES))
    run_job(Job(Path(__file__).parent / "workers" / "mesh_worker.py", str(out), ranks=WORLD, start="per_rank",
                script=True, cwd=out, timeout=120))
    per_rank = rank_results(out, WORLD)
    return [[per_rank[rank][i] for rank in range(WORLD)] for i in range(len(CASES))]


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c["name"] != "pipeline descends"],
                         ids=[c["name"] for c in CASES if c["name"] != "pipeline descends"])
def test_every_rank_sees_its_place_and_groups(results, i):
    case, grid = CASES[i], _grid(CASES[i])
    pp = len(grid)
    for rank, got in enumerate(results[i]):
        assert "error" not in got, got
        position = next(r for r, row in enumerate(grid) if rank in row)
        replica = grid[position].index(rank)
        assert (got["position"], got["replica"]) == (position, replica)
        pipeline = [grid[r][replica] for r in range(pp)]
        assert got["pp_reached"] == sorted(pipeline)
        assert got["dp_reached"] == sorted(grid[position])
        # torch pipelining addresses peers by group rank: the pipeline group's rank is the position
        assert got["pp_group_ranks"] == pipeline
        assert got["pp_group_rank"] == position
        shard = case.get("dp_shard", 1)
        dp = len(grid[0])
        assert got["dim_names"] == ["pp", "dp_replicate", "dp_shard", "tp"]
        assert got["mesh"] == [[[[rank_] for rank_ in row[g * shard:(g + 1) * shard]] for g in range(dp // shard)]
                               for row in grid]
        assert got["device_type"] == "cpu"  # gloo's default, or given
        assert got["coordinate"] == [position, replica // shard, replica % shard, 0]
        # the shard group: this position's replicas of one replica group; the replicate group: one shard index
        group = replica // shard
        assert got["shard_reached"] == sorted(grid[position][group * shard:(group + 1) * shard])
        assert got["replicate_reached"] == sorted(grid[position][replica % shard::shard])
        assert got["tp_reached"] == [rank]
        assert got["shard_mesh_dims"] == (["dp_shard"] if shard == dp else ["dp_replicate", "dp_shard"])
        assert got["dp_slice_is_dp_group"] and got["pp_slice_is_pp_group"]
        if "position_sets" in case:
            expected = [sorted(grid[r][replica] for r in s) for s in case["position_sets"]]
            assert got["over_positions"] == [e if rank in e else None for e in expected]


def test_a_descending_pipeline_is_refused_on_every_rank(results):
    i = next(i for i, c in enumerate(CASES) if c["name"] == "pipeline descends")
    for got in results[i]:
        assert got["error"] == "PlanError"
        assert "out of order" in got["message"] and "must ascend" in got["message"]


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c["name"] != "pipeline descends"],
                         ids=[c["name"] for c in CASES if c["name"] != "pipeline descends"])
def test_the_step_exchange_brings_each_pipeline_its_loss_and_every_rank_the_flags(results, i):
    grid = _grid(CASES[i])
    pp, dp = len(grid), len(grid[0])
    for rank, got in enumerate(results[i]):
        column = grid[next(r for r, row in enumerate(grid) if rank in row)].index(rank)
        steps = got["exchange"]
        for step in (0, 1):  # a new schema, then the same one: each pipeline's own loss and plain value
            s = steps[step]
            assert s["loss"] == 100.0 * column + step
            mine = [10.0 * column + step + k for k in range(4)]  # what this pipeline's last stage logged
            every = [[10.0 * c + step + k for k in range(4)] for c in range(dp)]
            assert s["values"] == pytest.approx([mine[0], sum(v[1] for v in every) / dp, max(v[2] for v in every),
                                                 sum(v[3] for v in every)])
            # every value is replayed as reduced with one replica; with several, the synced ones only
            reduced = [kw.get("sync_dist_group") == "REDUCED" for _, kw in s["schema"]]
            assert reduced == [dp == 1, True, True, True]
            # the flags of rank 3, at its position, on every rank; nothing elsewhere
            where = next(r for r, row in enumerate(grid) if 3 in row)
            assert s["flags"] == [[4.0, float(step)] if p == where else [0.0, 0.0] for p in range(pp)]
        assert steps[2] == {"error": "pipeline 0 cannot reduce its logs"}  # raised on every rank alike
        if dp > 1:  # pipeline 0 logs a synced value the other replicas do not: refused on every rank, naming them
            assert f"was logged by replica 0 and not by replica(s) {list(range(1, dp))}" in steps[3]["error"]
        else:
            assert steps[3]["values"] == pytest.approx([3.0, 4.0, 5.0, 6.0])
