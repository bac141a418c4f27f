"""BiasGuard in real 2-rank fits (HPPStrategy and DDPStrategy); every rank writes OUT/<case>_rank{r}.json.

Usage: ``python -m tests.bias_workers.guard_worker '{"case": "bad" | "good", "out": DIR}'``; Lightning
relaunches the module for rank 1.

* ``bad`` is launched without PYTHONHASHSEED. The launching process calls ``ensure_hash_seed`` (as
  the strategy's determinism switch does), so rank 1 starts with PYTHONHASHSEED=0 and rank 0 keeps
  its random hash seed. Fits: fingerprint policy "error" in a deterministic run; audit policy "error"
  in a deterministic run with a ``WeightedRandomSampler`` that Lightning wraps (pp=2 × dp=1); the same
  with both policies "error" but not deterministic (notes only: it trains); audit policy "error" with
  the field report's sampler and ``use_distributed_sampler=False`` (pp=1 × dp=2).
* ``good`` is launched with PYTHONHASHSEED=0 for every rank and a ``DistributedWeightedSampler``:
  an HPP fit with both policies "error", then DDP fits that save a Lightning checkpoint and resume
  from it, unchanged and with a saved fingerprint altered.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, WeightedRandomSampler

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from lightning_hpp.bias.determinism import ensure_hash_seed
from lightning_hpp.bias.guard import BiasGuard
from lightning_hpp.bias.samplers import DistributedWeightedSampler
from lightning_hpp.errors import CodedBiasError, FingerprintMismatchError
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, make_dataset

N = 64
BATCH = 8
TWO = [["layers.0-3"], ["layers.4-6"]]
ONE = [["layers.0-6"]]


def weights() -> torch.Tensor:
    w = torch.ones(N)
    w[:8] = 10.0
    return w


class StepProbe(L.Callback):
    """Counts the training batches that started."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1


def trainer_for(strategy, out: Path, steps: int, **kw) -> L.Trainer:
    return quiet_trainer(devices=2, strategy=strategy, max_steps=steps, num_sanity_val_steps=0,
                         default_root_dir=str(out), **kw)


def hpp(stages) -> HPPStrategy:
    return HPPStrategy(plan=StagePlan([StageSpec(modules=m) for m in stages]), schedule="gpipe",
                       n_microbatches=2, timeout=60)


def fit(strategy, out: Path, guard: BiasGuard, sampler, steps: int = 2, ckpt_path=None, save_to=None, **kw) -> dict:
    """Fit MLP once (then save a checkpoint to ``save_to``); report what the guard found and whether it raised."""
    L.seed_everything(0)
    model = MLP(depth=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = StepProbe()
    trainer = trainer_for(strategy, out, steps, callbacks=[guard, probe], **kw)
    loader = DataLoader(make_dataset(N), batch_size=BATCH, sampler=sampler)
    error = None
    try:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    except (FingerprintMismatchError, CodedBiasError) as e:
        error = {"type": type(e).__name__, "message": str(e)}
    if save_to is not None:
        trainer.save_checkpoint(str(save_to))
    after = model.state_dict()
    return {
        "error": error,
        "global_step": trainer.global_step,
        "batches_started": probe.batches,
        "params_unchanged": all(torch.equal(before[k], after[k]) for k in after if k in before),
        "hazards": [h.code for h in guard.hazards],
        "hazard_text": [str(h) for h in guard.hazards],
        "differences": [str(d) for d in guard.differences],
        "resume_differences": None if guard.resume_differences is None else [str(d) for d in guard.resume_differences],
        "fingerprints": guard.fingerprints,
        "fingerprint_path": guard.fingerprint_path,
        "audit_path": guard.audit_path,
        "audited_at_step": guard.audited_at_step,
        "stage_of_rank": guard.stage_of_rank,
        "device_kinds": guard.device_kinds,
        "rank": trainer.global_rank,
    }


def bad(out: Path) -> dict:
    res = {}
    # The hash seeds differ between the ranks: a reproducibility finding, which stops a deterministic run ...
    guard = BiasGuard(fingerprint="error", audit="off", deterministic=True)
    res["fingerprint"] = fit(hpp(TWO), out / "fp", guard, DistributedWeightedSampler(weights(), seed=0))
    guard = BiasGuard(fingerprint="off", audit="error", deterministic=True)
    res["wrapped"] = fit(hpp(TWO), out / "wrapped", guard, WeightedRandomSampler(weights(), N))
    # ... and is a note in any other run, which trains.
    guard = BiasGuard(fingerprint="error", audit="error")
    res["notes"] = fit(hpp(TWO), out / "notes", guard, WeightedRandomSampler(weights(), N))
    guard = BiasGuard(fingerprint="off", audit="error")
    res["identical"] = fit(hpp(ONE), out / "identical", guard, WeightedRandomSampler(weights(), N),
                           use_distributed_sampler=False)
    return res


def good(out: Path) -> dict:
    res = {}
    guard = BiasGuard(fingerprint="error", audit="error")
    res["hpp"] = fit(hpp(TWO), out / "hpp", guard, DistributedWeightedSampler(weights(), seed=0))
    res["hpp"]["resume_same"] = [str(d) for d in guard.check_resume(guard.checkpoint_metadata())]
    altered = json.loads(json.dumps(guard.checkpoint_metadata()))
    altered["ranks"][1]["torch"] = "0.0.0"
    try:
        guard.check_resume(altered)
        res["hpp"]["resume_altered"] = None
    except FingerprintMismatchError as e:
        res["hpp"]["resume_altered"] = str(e)

    # A Lightning checkpoint under DDP: the guard's fingerprints travel in it and are compared on resume.
    ckpt = out / "ddp" / "last.ckpt"
    guard = BiasGuard(fingerprint="error", audit="error")
    res["ddp"] = fit(DDPStrategy(), out / "ddp", guard, DistributedWeightedSampler(weights(), seed=0), save_to=ckpt)
    if dist.get_rank() == 0:
        state = torch.load(ckpt, weights_only=False)
        res["ddp"]["ckpt_has_fingerprints"] = len(state["callbacks"]["BiasGuard"]["fingerprints"])
        state["callbacks"]["BiasGuard"]["fingerprints"][1]["torch"] = "0.0.0"
        torch.save(state, out / "ddp" / "altered.ckpt")
    dist.barrier()
    res["resume_same"] = fit(DDPStrategy(), out / "ddp", BiasGuard(fingerprint="error", audit="error"),
                             DistributedWeightedSampler(weights(), seed=0), steps=3, ckpt_path=str(ckpt))
    res["resume_altered"] = fit(DDPStrategy(), out / "ddp", BiasGuard(fingerprint="error", audit="error"),
                                DistributedWeightedSampler(weights(), seed=0), steps=3,
                                ckpt_path=str(out / "ddp" / "altered.ckpt"))
    return res


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    out = Path(spec["out"])
    if "LOCAL_RANK" not in os.environ and spec["case"] == "bad":
        ensure_hash_seed(0)  # only the ranks launched from here inherit it
    result = bad(out) if spec["case"] == "bad" else good(out)
    result["env_hash_seed"] = os.environ.get("PYTHONHASHSEED")
    rank = dist.get_rank()
    (out / f"{spec['case']}_rank{rank}.json").write_text(json.dumps(result, default=str))
