"""Lightning hooks under HPPStrategy (pp=2): manual optimization, and ``configure_gradient_clipping`` overrides.

Usage: python -m tests.workers.run_hooks '<json: {"out": DIR}>'. Lightning relaunches the module for rank 1.
Every rank writes OUT/<case>/rank{r}.pt with its stages' parameters, the hook calls it saw and, for the
manual-optimization case, the error it raised.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch

from lightning_hpp import HPPPrecision, HPPStrategy, PlanError, StagePlan, StageSpec
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders

TWO = [["layers.0-3"], ["layers.4-6"]]
STEPS = 3
BATCH = 16


def step_limit(step: int) -> float:
    """A clipping threshold that changes with the step: no Trainer option expresses it."""
    return 0.02 * (1 + step)


class ClipsThroughLightning(MLP):
    """Clips each stage it is handed with ``self.clip_gradients`` and a step-dependent threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.calls.append((self.global_step, getattr(optimizer, "stage", None), len(params), gradient_clip_val))
        self.clip_gradients(optimizer, gradient_clip_val=step_limit(self.global_step), gradient_clip_algorithm="norm")


class ClipsWithTorch(MLP):
    """Clips each stage's gradients by value with torch directly, over the optimizer's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.calls.append((self.global_step, getattr(optimizer, "stage", None), len(params), gradient_clip_val))
        torch.nn.utils.clip_grad_value_(params, 0.004)


class GlobalAfterFirstStep(MLP):
    """Leaves step 0 unclipped, then forwards the Trainer's value (Lightning's documented pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.calls.append((self.global_step, getattr(optimizer, "stage", None), None, gradient_clip_val))
        if self.global_step >= 1:
            self.clip_gradients(
                optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
            )


class Manual(MLP):
    """Manual optimization, as Lightning documents it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.calls: list[tuple] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


CASES = {
    "manual": (Manual, {}, {}),
    "lightning_clip": (ClipsThroughLightning, {"clip": "per-stage"},
                       {}),  # the stage's own norm; "global" is the default
    "torch_clip": (ClipsWithTorch, {}, {}),
    "global_clip": (GlobalAfterFirstStep, {"clip": "global"}, {"gradient_clip_val": 0.03}),
}


def run(case: str, out: str) -> None:
    cls, precision, trainer_kw = CASES[case]
    L.seed_everything(0)
    model = cls()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strategy = HPPStrategy(
        plan=StagePlan([StageSpec(modules=m) for m in TWO]),
        schedule="1f1b",
        n_microbatches=4,
        timeout=60,
        precision_plugin=HPPPrecision(**precision),
    )
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=STEPS, num_sanity_val_steps=0, limit_val_batches=0,
                            **trainer_kw)
    error = None
    try:
        trainer.fit(model, loaders(BATCH)[0])
    except PlanError as e:
        error = str(e)
    state = model.state_dict()
    result = {
        "error": error,
        "global_step": trainer.global_step,
        "unchanged": all(torch.equal(before[k], state[k]) for k in state if k in before),
        "state": {k: v.detach().clone() for k, v in state.items() if "layers" in k},
        "calls": model.calls,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    os.makedirs(os.path.join(out, case), exist_ok=True)
    torch.save(result, os.path.join(out, case, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    for name in CASES:
        run(name, spec["out"])
