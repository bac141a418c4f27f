"""A pp=2 × dp=2 HPPStrategy job in which one rank's stage produces NaN at one step.

Global rank 0 (stage 0 of replica 0) fills ``layers.0.bias`` with NaN before batch ``poison_step``;
the job runs once with ``HPPPrecision(nonfinite="warn")`` and once with ``"raise"``, in the same
processes; a third run (``gradient``, ``"raise"``) leaves the forward finite and makes global rank 2
(stage 1 of replica 0) send NaN gradients back to stage 0 at that batch. Every rank writes what
happened to OUT/<run>/rank{r}.json: the error it raised (type and message), the global step it
stopped at, and the boundary warnings it printed.

Usage: python -m tests.workers.run_nonfinite '<json: {"out": DIR, "poison_step": K, "steps": N}>'
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning as L
import torch

from lightning_hpp import HPPPrecision, HPPStrategy
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders
from tests.workers.run_cases import TWO


class Poison(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step and trainer.global_rank == 0:
            with torch.no_grad():
                pl_module.layers[0].bias.fill_(float("nan"))


class PoisonGradient(L.Callback):
    """From batch ``step`` on, stage 1's first unit on global rank 2 hands back NaN input gradients."""

    def __init__(self, step: int) -> None:
        self.step, self.on = step, False

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 2:
            pl_module.layers[4].register_full_backward_hook(
                lambda m, grad_in,
                grad_out: tuple(None if g is None else torch.full_like(g, float("nan")) for g in grad_in)
                if self.on else None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.on = batch_idx >= self.step


def run(cfg: dict, policy: str, poison: str = "forward") -> None:
    L.seed_everything(0)
    model = MLP()
    strategy = HPPStrategy(plan=TWO, pp_degree=2, schedule="1f1b", n_microbatches=2, timeout=60,
                           precision_plugin=HPPPrecision(nonfinite=policy))
    trainer = quiet_trainer(devices=4, strategy=strategy, max_steps=cfg["steps"],
                            callbacks=[(Poison if poison == "forward" else PoisonGradient)(cfg["poison_step"])],
                            num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=cfg["out"])
    train, _ = loaders(8)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, train)
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            error = {"type": type(e).__name__, "message": str(e)}
    out = os.path.join(cfg["out"], policy if poison == "forward" else poison)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({
            "error": error,
            "global_step": trainer.global_step,
            "warnings": [str(w.message) for w in caught if "NaN/Inf" in str(w.message)],
            "stage_ids": strategy.stage_ids,
            "replica": strategy.mesh.replica,
            "finite_params": all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.device.type != "meta"),
        }, f)


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    for policy in ("warn", "raise"):
        run(cfg, policy)
    run(cfg, "raise", poison="gradient")
