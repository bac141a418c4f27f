"""Correct and skewed data setups under HPPStrategy pp=2 × dp=2 with both guard policies "error".

Usage: ``python -m tests.bias_workers.catalogue_worker '{"out": DIR}'``, launched with PYTHONHASHSEED
unset (Lightning relaunches the module for ranks 1-3, which inherit that). Every rank writes
``DIR/<case>_rank{r}.json``. Cases, in this order:

* ``wrs`` — a plain ``WeightedRandomSampler`` (Lightning wraps it) and a ``BiasMonitor``, two epochs:
  correct, also from the second epoch on, though only stage 0 has dropout;
* ``dws`` — ``DistributedWeightedSampler``: correct;
* ``skew`` — the field report's "fix", a ``WeightedRandomSampler`` seeded ``seed + rank``: skew;
* ``deterministic`` — ``wrs`` under ``BiasOptions(deterministic=True)``: its reproducibility findings
  now stop the run (last: determinism stays switched on in the process).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, WeightedRandomSampler

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from lightning_hpp.bias.fingerprint import CodedBiasWarning
from lightning_hpp.bias.guard import BiasGuard
from lightning_hpp.bias.monitor import BiasMonitor
from lightning_hpp.bias.samplers import DistributedWeightedSampler
from lightning_hpp.errors import CodedBiasError, FingerprintMismatchError
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, make_dataset

N = 128
BATCH = 8
TWO = [["layers.0-3"], ["layers.4-6"]]


def weights() -> torch.Tensor:
    w = torch.ones(N)
    w[:16] = 10.0
    return w


class DropoutMLP(MLP):
    """Dropout on stage 0 only: the stages consume torch's global RNG differently."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[1] = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Dropout(0.2))


class Seen(L.Callback):
    """The first feature of every sample of every training batch this rank loads."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([round(float(v), 6) for v in batch[0][:, 0]])


def fit(case: str, out: Path, sampler_of_rank, steps: int, deterministic: bool = False) -> dict:
    L.seed_everything(0)
    monitor, seen = BiasMonitor(), Seen()
    # The correct setups run as a user's script does (any warning reaches stderr); the deterministic one
    # records its warnings (the launching process's own hash seed cannot be fixed any more: it says so).
    with warnings.catch_warnings(record=True) if deterministic else contextlib.nullcontext([]) as caught:
        if deterministic:
            warnings.simplefilter("always")
        strategy = HPPStrategy(
            plan=StagePlan([StageSpec(modules=m) for m in TWO]),
            schedule="1f1b",
            n_microbatches=2,
            timeout=60,
            bias={"audit": "error", "fingerprint": "error", "deterministic": deterministic},
        )
        trainer = quiet_trainer(devices=4, strategy=strategy, max_steps=steps, num_sanity_val_steps=0,
                                limit_val_batches=0, default_root_dir=str(out / case), callbacks=[monitor, seen])
        model = DropoutMLP()
        error = None
        try:
            trainer.fit(model, DataLoader(make_dataset(N), batch_size=BATCH, sampler=sampler_of_rank()))
        except (CodedBiasError, FingerprintMismatchError) as e:
            error = {"type": type(e).__name__, "message": str(e)}
    guard = next(cb for cb in trainer.callbacks if isinstance(cb, BiasGuard))
    return {
        "error": error,
        "global_step": trainer.global_step,
        "hazards": [[h.code, h.severity] for h in guard.hazards],
        "differences": [[d.code, d.severity] for d in guard.differences],
        "audit_path": guard.audit_path,
        "alarms": monitor.alarms,
        "measured_steps": len([h for h in monitor.history if "bias/loss_std" in h]),
        "recorded_warnings": [str(w.message) for w in caught if issubclass(w.category, CodedBiasWarning)],
        "rank": trainer.global_rank,
        "seen": seen.batches,
    }


def main(out: Path) -> None:
    def plain():
        return WeightedRandomSampler(weights(), N)

    def per_rank():  # the field report's fix, which breaks under Lightning's wrapper
        return WeightedRandomSampler(
            weights(), N, generator=torch.Generator().manual_seed(int(os.environ.get("LOCAL_RANK", "0")))
        )

    def dws():
        return DistributedWeightedSampler(weights(), seed=0)

    for case, sampler, steps, det in (
        ("wrs", plain, 16, False),
        ("dws", dws, 2, False),
        ("skew", per_rank, 2, False),
        ("deterministic", plain, 2, True),
    ):
        result = fit(case, out, sampler, steps, deterministic=det)
        (out / f"{case}_rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(json.loads(sys.argv[1])["out"]))
