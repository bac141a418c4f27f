"""Rank of a 3-stage job loading checkpoints saved under other layouts (resharding).

Argument: OUT_DIR holding config.json {"urls": [CKPT_URL, ...]}. Rank r holds stage r of layout
"pp3"; it writes OUT_DIR/rank<r>.json with what it found.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from lightning_hpp.checkpoint import load_sharded
from lightning_hpp.checkpoint.commit import read_metadata
from lightning_hpp.errors import CheckpointError
from tests.ckpt_workers.common import compare_stage, rng_equal, rng_state, stage_names, stage_state


def template(rank: int, saved_world: int) -> dict:
    shapes = stage_state("pp3", rank, rank, 0)
    state = {
        "model": {n: torch.zeros_like(t) for n, t in shapes["model"].items()},
        "optimizer": {
            "state": {
                n: {"exp_avg": torch.zeros_like(s["exp_avg"]), "step": None}
                for n, s in shapes["optimizer"]["state"].items()
            },
            "param_groups": None,
        },
        "loops": None,
        "hyper_parameters": None,
        "epoch": 0,
        "global_step": 0,
    }
    if rank < saved_world:
        state["rng"] = {f"rank{rank}": None}
    return state


def main() -> None:
    out_dir = sys.argv[1]
    with open(os.path.join(out_dir, "config.json")) as f:
        urls = json.load(f)["urls"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"rank": rank, "names": stage_names("pp3", rank), "checks": []}

    # one rank asking for a key the checkpoint lacks: every rank raises, none hangs
    bad = {"model": {"no.such.weight": torch.zeros(2)}} if rank == 2 else {"model": None}
    try:
        load_sharded(urls[0], bad)
        results["missing"] = "not refused"
    except CheckpointError as exc:
        results["missing"] = str(exc)

    for url in urls:
        saved_world = read_metadata(url)["world_size"]
        state = template(rank, saved_world)
        before = dict(state["model"])
        loaded = load_sharded(url, state)
        problems = compare_stage(loaded, "pp3", rank, step=loaded["global_step"])
        in_place = all(loaded["model"][n] is t for n, t in before.items())
        rng_ok = rank >= saved_world or rng_equal(loaded["rng"][f"rank{rank}"], rng_state(rank))
        results["checks"].append({"url": url, "problems": problems, "in_place": in_place, "rng_ok": rng_ok,
                                  "n_model": len(loaded["model"])})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
