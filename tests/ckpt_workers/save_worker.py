"""Rank of a 2-rank job saving the same model under two layouts, then once asynchronously.

Argument: OUT_DIR holding config.json {"root": ROOT, "step": STEP}. Writes
  ROOT/pp2/step-STEP    pipeline layout: rank r holds stage r of "pp2" (half the keys each)
  ROOT/dp2/step-STEP    data-parallel layout: both ranks hold every key (identical replicas)
  ROOT/pp2/step-STEP+1  async save of the pp2 state, which is changed right after the call
and OUT_DIR/rank<r>.json with what each rank observed.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from lightning_hpp.checkpoint import checkpoint_url, save_sharded
from lightning_hpp.errors import CheckpointError
from tests.ckpt_workers.common import stage_state


def main() -> None:
    out_dir = sys.argv[1]
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    root, step = config["root"], int(config["step"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pp2 = stage_state("pp2", rank, rank, step)
    dp2 = stage_state("pp1", 0, rank, step)
    meta = {"plan": {"layout": "pp2"}, "metrics": {"val/loss": 0.5}}

    # ranks disagreeing on a shared key are refused on every rank, before anything is written
    bad = copy.deepcopy(pp2)
    bad["loops"]["fit_loop"]["batch_idx"] = rank
    try:
        save_sharded(bad, checkpoint_url(f"{root}/bad", step), step=step)
        conflict = "not refused"
    except CheckpointError as exc:
        conflict = str(exc)

    info = save_sharded(pp2, checkpoint_url(f"{root}/pp2", step), step=step, extra_metadata=meta)
    save_sharded(dp2, checkpoint_url(f"{root}/dp2", step), step=step, extra_metadata=meta)

    # async: what is saved is the state at the call, whatever training does afterwards
    pending = save_sharded(pp2, checkpoint_url(f"{root}/pp2", step + 1), step=step + 1, async_save=True)
    with torch.no_grad():
        for tensor in pp2["model"].values():
            tensor.add_(1)
    async_info = pending.result()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"conflict": conflict, "shards": info.metadata["shards"], "async_step": async_info.step}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
