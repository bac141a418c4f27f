"""What the last stage logs, as rank 0's Trainer sees it, with every collective's device checked.

One launch of pp=2 × dp=2: ``LoggedMLP`` logs values with each ``reduce_fx`` (over micro-batches
and, with ``sync_dist=True``, over replicas) and a torchmetrics ``Accuracy`` that syncs on every
step; the whole fit runs under :func:`tests.placement_check.device_placement_check`. Then the
check's own controls (a host tensor and a host device handed to collectives must be refused) and
a custom ``reduce_fx``, which every rank must refuse.

Usage: python -m tests.workers.run_logging '<json: {"out": DIR, "devices": 4}>'
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torchmetrics.classification import MulticlassAccuracy

from tests.harness.zoo import MLP

STAGES = [["layers.0-3"], ["layers.4-6"]]


class LoggedMLP(MLP):
    def __init__(self, custom_fx: bool = False) -> None:
        super().__init__()
        self.acc = MulticlassAccuracy(num_classes=4, average="micro", dist_sync_on_step=True)
        self.custom_fx = custom_fx

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss, prog_bar=True)
        self.log("loss_sync", loss, sync_dist=True)
        self.log("ysum", y.float().sum(), reduce_fx="sum", sync_dist=True, on_step=True, on_epoch=True)
        self.log("logit_max", logits.max(), reduce_fx="max", sync_dist=True)
        self.log("logit_min", logits.min(), reduce_fx=torch.min, sync_dist=True, on_step=True, on_epoch=True)
        self.log("count", float(len(y)), reduce_fx="sum", sync_dist=True)
        self.acc(logits.argmax(1), y)
        self.log("acc", self.acc, on_step=True, on_epoch=False)
        if self.custom_fx:
            self.log("median", loss, reduce_fx=torch.median)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_ysum", y.float().sum(), reduce_fx="sum", sync_dist=True)
        self.log("val_max", logits.max(), reduce_fx="max", sync_dist=True)


class StepMetrics(Callback):
    """``trainer.callback_metrics`` after every training batch, and at the end."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def trainer_kwargs(devices: int, out: str) -> dict:
    return {
        "accelerator": "cpu",
        "devices": devices,
        "max_epochs": 2,
        "limit_train_batches": 3,
        "limit_val_batches": 2,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": out,
    }


def main(spec: dict) -> None:
    from lightning_hpp import HPPStrategy, PlanError, StagePlan, StageSpec
    from tests.harness.zoo import loaders
    from tests.placement_check import DevicePlacementError, device_placement_check

    out, devices = spec["out"], spec["devices"]
    result: dict = {}

    def strategy() -> HPPStrategy:
        return HPPStrategy(
            plan=StagePlan([StageSpec(modules=m) for m in STAGES]),
            schedule="1f1b",
            n_microbatches=2,
            pp_degree=2,
            timeout=60,
        )

    from lightning_hpp.pipeline import steps

    # how each replayed value reached Lightning: the short path (a key Lightning took before) or its whole `log`
    replays = {"short": 0, "whole": 0}
    log_again = steps._log_again

    def counted(*args, **kwargs):
        short = log_again(*args, **kwargs)
        replays["short" if short else "whole"] += 1
        return short

    steps._log_again = counted
    L.seed_everything(0)
    metrics = StepMetrics()
    hpp = strategy()
    trainer = L.Trainer(strategy=hpp, callbacks=[metrics], **trainer_kwargs(devices, out))
    with device_placement_check() as counts:
        trainer.fit(LoggedMLP(), *loaders(8))
    steps._log_again = log_again
    result.update(
        steps=metrics.steps, final={k: float(v) for k, v in trainer.callback_metrics.items()}, checked=dict(counts),
        replays=replays,
    )

    # the check's controls: what it must refuse (raised before the collective runs, so no rank waits)
    import torch.distributed as dist

    from lightning_hpp import _dist

    group = hpp.mesh.pp_group
    refused = []
    with device_placement_check():
        for name, call in (
            ("host tensor", lambda: dist.all_reduce(torch.zeros(1), group=group)),
            ("host number", lambda: dist.all_reduce(torch.tensor([float(trainer.global_step)]), group=group)),
            (
                "cpu copy",
                lambda: dist.broadcast(torch.ones(2).to(_dist.group_device(group)).cpu(), group_src=0, group=group),
            ),
            (
                "object device",
                lambda: dist.broadcast_object_list([1], group_src=0, group=group, device=torch.device("cpu")),
            ),
        ):
            try:
                call()
            except DevicePlacementError:
                refused.append(name)
        placed = torch.ones(1).to(_dist.group_device(group))
        dist.all_reduce(placed, group=group)  # placed by group_device: accepted (and really reduced)
        result["placed_sum"] = float(placed)
    result["refused"] = refused

    # a reduction Lightning does not know: refused on every rank, not only on the last stage that logged it
    trainer = L.Trainer(strategy=strategy(), **{**trainer_kwargs(devices, out), "max_epochs": 1})
    try:
        trainer.fit(LoggedMLP(custom_fx=True), *loaders(8))
    except PlanError as e:
        result["custom_fx_error"] = str(e)
    with open(os.path.join(out, f"result{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
