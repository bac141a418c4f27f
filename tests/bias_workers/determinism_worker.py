"""Seeded 2-rank HPPStrategy fits with the determinism switch; every rank writes OUT/rank{r}.pt.

Usage: ``python -m tests.bias_workers.determinism_worker '{"out": DIR, "seeds": [7, 8]}'``; Lightning
relaunches the module for rank 1. ``enable_determinism`` runs in every process before the first
``Trainer.fit``, so the launched rank inherits PYTHONHASHSEED. The data adds random noise inside a
dataloader worker, so the result also depends on how the workers are seeded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from lightning_hpp.bias.determinism import enable_determinism
from lightning_hpp.bias.fingerprint import HASH_PROBE
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, make_dataset

TWO = [["layers.0-3"], ["layers.4-6"]]


class NoisyDataset(Dataset):
    """``make_dataset`` with Gaussian noise added to the inputs at every access (an augmentation)."""

    def __init__(self, n: int = 64) -> None:
        self.base = make_dataset(n)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x + 0.1 * torch.randn_like(x), y


def run(seed: int, out: Path) -> dict:
    settings = enable_determinism(seed)
    model = MLP(depth=4, seed=seed)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = HPPStrategy(plan=StagePlan([StageSpec(modules=m) for m in TWO]), schedule="gpipe",
                           n_microbatches=2, timeout=60)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=6, num_sanity_val_steps=0,
                            default_root_dir=str(out))
    loader = DataLoader(NoisyDataset(), batch_size=16, shuffle=True, num_workers=1, drop_last=True)
    trainer.fit(model, loader)
    held = list(model.state_dict())  # units held by other ranks were replaced by parameterless stand-ins
    return {
        "state": {k: model.state_dict()[k].clone() for k in held},
        "initial": {k: initial[k] for k in held},
        "global_step": trainer.global_step,
        "settings": settings.__dict__,
        "worker_init_fn": repr(trainer.train_dataloader.worker_init_fn),
    }


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    out = Path(spec["out"])
    runs = {seed: run(seed, out) for seed in spec["seeds"]}
    rank = torch.distributed.get_rank()
    torch.save({
        "runs": runs,
        "env_hash_seed": os.environ.get("PYTHONHASHSEED"),
        "hash_probe": hash(HASH_PROBE),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "pl_seed_workers": os.environ.get("PL_SEED_WORKERS"),
    }, out / f"rank{rank}.pt")
