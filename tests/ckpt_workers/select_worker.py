"""Rank of a 2-rank job choosing a checkpoint with ``select_and_load`` while the ranks see different listings.

Argument: OUT_DIR holding config.json {"roots": [A, B]}. Both ranks save step-1..3 into A and step-9
into B; rank 1 then flips a byte of its own shard of A/step-3 and searches B, rank 0 searches A.
Rank r writes OUT_DIR/rank<r>.json: the checkpoint chosen, whether the values loaded are step 2's,
and the checkpoint warnings it emitted.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_hpp.checkpoint import CheckpointWarning, load_sharded, save_sharded
from lightning_hpp.checkpoint.resume import PendingResume, select_and_load


def state(rank: int, step: int) -> dict:
    return {"model": {f"w{rank}": torch.full((256,), float(step))}, "global_step": step}


def main() -> None:
    out_dir = sys.argv[1]
    with open(os.path.join(out_dir, "config.json")) as f:
        a, b = json.load(f)["roots"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in (1, 2, 3):
        save_sharded(state(rank, step), f"{a}/step-{step}", step=step)
    save_sharded(state(rank, 9), f"{b}/step-9", step=9)
    if rank == 1:
        shard = Path(a) / "step-3" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        request = PendingResume(a if rank == 0 else b, roots=[a if rank == 0 else b], what="resume='auto'")
        chosen = select_and_load(
            request, lambda url: load_sharded(url, {"model": {f"w{rank}": torch.zeros(256)}, "global_step": None})
        )
    loaded = chosen.loaded if chosen else {}
    result = {
        "rank": rank,
        "chosen": chosen.url if chosen else None,
        "values_ok": bool(chosen)
        and loaded["global_step"] == 2
        and torch.equal(loaded["model"][f"w{rank}"], state(rank, 2)["model"][f"w{rank}"]),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
