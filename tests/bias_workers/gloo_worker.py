"""One rank of the coded-bias gloo run: fingerprints and data-loading audits over a real group.

The launcher starts rank 0 with PYTHONHASHSEED=1 and rank 1 with PYTHONHASHSEED=2, so the
interpreters hash strings differently. Each rank writes ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from lightning_hpp.bias.audit import audit_dataloader
from lightning_hpp.bias.fingerprint import HASH_PROBE, compare_fingerprints, enforce, gather_fingerprints
from lightning_hpp.bias.samplers import DistributedWeightedSampler
from lightning_hpp.errors import FingerprintMismatchError

N = 64


def fingerprints() -> dict:
    per_rank = gather_fingerprints()
    diffs = compare_fingerprints(per_rank)
    enforce(diffs, "error")  # hash-seed differences alone are reproducibility notes: nothing raised
    try:
        enforce(diffs, "error", deterministic=True)
        raised = None
    except FingerprintMismatchError as e:
        raised = str(e)
    return {"diffs": [str(d) for d in diffs], "codes": [d.code for d in diffs], "raised": raised,
            "severities": [d.severity for d in diffs],
            "fingerprints": per_rank, "own_probe": hash(HASH_PROBE)}


def audit(loader: DataLoader, use_ds: bool, check_hash_seed: bool = False) -> list:
    hazards = audit_dataloader(loader, rank=dist.get_rank(), world_size=dist.get_world_size(),
                               use_distributed_sampler=use_ds, check_hash_seed=check_hash_seed)
    return [[h.code for h in hazards], [str(h) for h in hazards]]


def audits() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # as seed_everything(0) does on every rank
    rng_before = torch.get_rng_state()
    ds = TensorDataset(torch.arange(N))
    w = torch.ones(N)
    w[:8] = 10.0
    res = {}
    res["bug"] = audit(DataLoader(ds, batch_size=8, sampler=WeightedRandomSampler(w, N)), use_ds=False)
    per_rank = WeightedRandomSampler(w, N, generator=torch.Generator().manual_seed(42 + rank))
    res["report_fix_before_wrap"] = audit(DataLoader(ds, batch_size=8, sampler=per_rank), use_ds=True)
    wrapped = DistributedSamplerWrapper(per_rank, num_replicas=world, rank=rank, shuffle=False)
    res["report_fix_after_wrap"] = audit(DataLoader(ds, batch_size=8, sampler=wrapped), use_ds=True)
    dws = DistributedWeightedSampler(w, seed=0)  # rank and replicas from torch.distributed
    res["dws_on"] = audit(DataLoader(ds, batch_size=8, sampler=dws), use_ds=True)
    res["dws_off"] = audit(DataLoader(ds, batch_size=8, sampler=dws), use_ds=False)
    res["hash_differs"] = audit(DataLoader(ds, batch_size=8, sampler=dws), use_ds=True, check_hash_seed=True)
    os.environ.pop("PYTHONHASHSEED")
    res["hash_unset"] = audit(DataLoader(ds, batch_size=8, sampler=dws), use_ds=True, check_hash_seed=True)
    os.environ["PYTHONHASHSEED"] = "0"  # too late: this interpreter already chose its hash seed
    res["hash_late"] = audit(DataLoader(ds, batch_size=8, sampler=dws), use_ds=True, check_hash_seed=True)
    res["rng_untouched"] = bool(torch.equal(rng_before, torch.get_rng_state()))
    shards = [None] * world
    dist.all_gather_object(shards, list(DistributedWeightedSampler(w, replacement=False, seed=3)))
    res["dws_no_replacement_shards"] = shards
    return res


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    result = {"fingerprint": fingerprints(), "audit": audits()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
