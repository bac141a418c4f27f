"""Conformance scenarios for ordinary Lightning usage beyond the listed behaviours: every hook with its arguments,
frozen stages, tied weights in plain modules, a step's returned dict, Lightning's tuner and callbacks.

Registered in the same table as :mod:`tests.conformance.scenarios` (one job per layout runs them all).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpp.check.hooks import HookLog, callback_hooks, datamodule_hooks, describe, module_hooks, record_hooks
from tests.conformance.harness import Ctx, scenario, seeded, snapshot
from tests.conformance.scenarios import Net


class Data(L.LightningDataModule):
    """The context's loaders as a LightningDataModule (so that its hooks are called too), with its own batch
    transfer hooks (Lightning then calls them instead of the module's) and state."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx

    def prepare_data(self):
        pass

    def train_dataloader(self):
        return self.ctx.train_loader()

    def val_dataloader(self):
        return self.ctx.eval_loader()

    def test_dataloader(self):
        return self.ctx.eval_loader()

    def predict_dataloader(self):
        return self.ctx.eval_loader()

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch

    def state_dict(self):
        return {"seen": 1}


class HookedNet(Net):
    """Net with a per-epoch scheduler and the hooks Lightning calls only where a module defines them."""

    def __init__(self, ctx: Ctx | None = None) -> None:
        super().__init__(scheduler="epoch")
        self.ctx = ctx

    def prepare_data(self):
        pass

    def configure_model(self):
        pass

    def on_validation_model_train(self):
        super().on_validation_model_train()

    def on_test_model_train(self):
        super().on_test_model_train()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["hooked"] = True

    def on_load_checkpoint(self, checkpoint):
        pass

    def train_dataloader(self):
        return self.ctx.train_loader()

    def val_dataloader(self):
        return self.ctx.eval_loader()

    def test_dataloader(self):
        return self.ctx.eval_loader()

    def predict_dataloader(self):
        return self.ctx.eval_loader()


class LegacyHookedNet(HookedNet):
    """Defines the deprecated ``configure_sharded_model`` instead (Lightning refuses a module that defines both)."""

    configure_model = L.LightningModule.configure_model

    def configure_sharded_model(self):
        pass


class CallbackWithState(L.Callback):
    def state_dict(self):
        return {"kept": 1}


def hooked(ctx: Ctx, log: HookLog, datamodule: bool, cls: type = HookedNet) -> tuple:
    """The recording module, callback and (``datamodule``) data module of one run."""
    model = record_hooks(seeded(cls, ctx=ctx), "module", module_hooks(), log)
    data = record_hooks(Data(ctx), "datamodule", datamodule_hooks(), log) if datamodule else None
    callback = record_hooks(CallbackWithState(), "callback", callback_hooks(), log)
    return model, data, callback


@scenario()
def every_hook(ctx):
    """Every module, callback and datamodule hook Lightning calls in ``fit`` (a sanity check, validation, a
    scheduler, checkpoints), ``validate``, ``test`` and ``predict`` on one Trainer, and in a second ``fit`` resumed
    from its last checkpoint, with its arguments, in order, on every rank."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    log, resumed = HookLog(), HookLog()
    model, data, callback = hooked(ctx, log, datamodule=True)
    limits = {"limit_train_batches": 3, "limit_val_batches": 2, "limit_test_batches": 2, "limit_predict_batches": 2}
    checkpoint = ModelCheckpoint(dirpath=ctx.path("checkpoints"), save_last=True)
    trainer = ctx.trainer(callbacks=[callback, checkpoint], max_epochs=1, num_sanity_val_steps=1, **limits)
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data, verbose=False)
    trainer.test(model, datamodule=data, verbose=False)
    trainer.predict(model, datamodule=data)
    model2, data2, callback2 = hooked(ctx, resumed, datamodule=True)
    checkpoint2 = ModelCheckpoint(dirpath=ctx.path("checkpoints"), save_last=True)
    again = ctx.trainer(callbacks=[callback2, checkpoint2], max_epochs=2, num_sanity_val_steps=0, **limits)
    again.fit(model2, datamodule=data2, ckpt_path="last")
    return snapshot(again, model2, hooks=list(log), resumed_hooks=list(resumed))


@scenario()
def every_hook_with_the_module_s_own_loaders(ctx):
    """The same without a data module: the module's own ``*_dataloader`` and batch transfer hooks (and the deprecated
    ``configure_sharded_model``)."""
    log = HookLog()
    model, _, callback = hooked(ctx, log, datamodule=False, cls=LegacyHookedNet)
    trainer = ctx.trainer(callbacks=[callback], max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                          limit_test_batches=1, limit_predict_batches=1)
    trainer.fit(model)
    trainer.test(model, verbose=False)
    trainer.predict(model)
    return snapshot(trainer, model, hooks=list(log))


class RaisesAtBatch(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            raise ValueError("raised by the test at batch 1")


@scenario()
def hooks_when_a_hook_raises(ctx):
    """A callback raises in ``on_train_batch_end`` at batch 1 on every rank: ``on_exception`` of the module, the
    callbacks and the data module, and what ran before it, as in one process; the error reaches the caller."""
    log = HookLog()
    model, data, callback = hooked(ctx, log, datamodule=True)
    trainer = ctx.trainer(callbacks=[callback, RaisesAtBatch()], max_epochs=1, limit_train_batches=3)
    try:
        trainer.fit(model, datamodule=data)
        raised = None
    except ValueError as e:
        raised = str(e)
    return {**snapshot(trainer, model, hooks=list(log)), "raised": raised}


# ---------------------------------------------------------------------------------------------- step outputs, state
class Outputs(Net):
    """Returns a dict with more keys than the loss from every step; records what ``on_*_batch_end`` receives, collects
    the steps' predictions for the epoch ends, which log them and write a file on global rank zero only."""

    def __init__(self, out_dir: str = "") -> None:
        super().__init__()
        self.out_dir = out_dir
        self.batch_outputs: list = []
        self.train_losses: list[torch.Tensor] = []
        self.val_preds: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_losses.append(loss.detach())
        return {"loss": loss, "acc": (logits.argmax(1) == y).float().mean(), "correct": (logits.argmax(1) == y).sum(),
                "preds": logits.argmax(1), "tag": "train"}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_preds.append(logits.argmax(1))
        return {"val_loss": F.cross_entropy(logits, y), "probs": logits.softmax(1)}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_outputs.append(("train", describe(outputs)))

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.batch_outputs.append(("val", describe(outputs)))

    def on_train_epoch_end(self):
        self.log("epoch_train_loss", torch.stack(self.train_losses).mean(), sync_dist=True)
        self.train_losses.clear()

    def on_validation_epoch_end(self):
        preds = torch.cat(self.val_preds)
        self.log("val_pred_mean", preds.float().mean(), sync_dist=True)
        gathered = self.all_gather(preds)
        if self.trainer.is_global_zero and self.out_dir:
            with open(f"{self.out_dir}/val_preds_epoch{self.current_epoch}.txt", "w") as f:
                f.write(" ".join(str(int(v)) for v in gathered.flatten()))
        self.val_preds.clear()


@scenario()
def step_outputs_and_collected_state(ctx):
    """A step's returned dict reaches ``on_train_batch_end`` / ``on_validation_batch_end`` with every key on every
    rank (per-sample tensors whole, means and counts over the batch); what the steps append is there for the
    epoch-end hooks on every rank, which log it and write a file on global rank zero (``all_gather`` over the
    replicas)."""
    model = seeded(Outputs, out_dir=str(ctx.out))
    trainer = ctx.trainer(max_epochs=2, limit_train_batches=4, limit_val_batches=3)
    trainer.fit(model, ctx.train_loader(), ctx.eval_loader())
    files = {p.name: p.read_text() for p in sorted(ctx.out.glob("val_preds_epoch*.txt"))}
    return snapshot(trainer, model, batch_outputs=model.batch_outputs, files=files)


# ---------------------------------------------------------------------------------------------- frozen stages
class FineTune(L.LightningModule):
    """A backbone (stage 0 of the pipeline layouts) and a head (stage 1); an optimizer over what trains."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        if frozen:
            self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def finetune_strategy(ctx):
    from lightning_hpp import StagePlan, StageSpec

    plan = StagePlan([StageSpec(modules=["backbone"]), StageSpec(modules=["head"])])
    return ctx.strategy(plan=plan) if ctx.hpp else None


@scenario()
def frozen_stage_then_unfrozen_for_a_second_fit(ctx):
    """A frozen backbone that is the whole first stage (an empty optimizer on its ranks), then unfrozen for a second
    ``fit`` with a new Trainer on the same module."""
    model = seeded(FineTune)
    first = ctx.trainer(strategy=finetune_strategy(ctx), max_epochs=1, limit_train_batches=4)
    first.fit(model, ctx.train_loader())
    after_first = snapshot(first, model)
    model.backbone.requires_grad_(True)
    second = ctx.trainer(strategy=finetune_strategy(ctx), max_epochs=1, limit_train_batches=4)
    second.fit(model, ctx.train_loader())
    return snapshot(second, model, first=after_first)


@scenario()
def backbone_finetuning_unfreezes_in_a_hook(ctx):
    """Lightning's ``BackboneFinetuning``: the backbone (stage 0) frozen at the start, unfrozen at epoch 1 with a param
    group added to the optimizer, in a hook during the run."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    model = seeded(FineTune, frozen=False)
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5,
                                  backbone_initial_ratio_lr=0.5)
    trainer = ctx.trainer(strategy=finetune_strategy(ctx), callbacks=[callback], max_epochs=3, limit_train_batches=3)
    trainer.fit(model, ctx.train_loader())
    return snapshot(trainer, model)


# ---------------------------------------------------------------------------------------------- tied weights
class TiedLM(L.LightningModule):
    """Plain PyTorch modules whose embedding weight is the head's (a tied LM head), cut between them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 16)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        loss = F.cross_entropy(self(ids).flatten(0, 1), ids.roll(1, dims=1).flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@scenario()
def tied_weights_in_plain_modules(ctx):
    """An ``nn.Embedding`` in stage 0 whose weight is the head's ``nn.Linear`` weight in stage 1 (sequential
    frontend): both copies take the one process's update every step."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_hpp import StagePlan, StageSpec

    ids = TensorDataset(torch.randint(0, 16, (96, 6), generator=torch.Generator().manual_seed(0)))
    model = seeded(TiedLM)
    strategy = None
    if ctx.hpp:
        plan = StagePlan([StageSpec(modules=["embed", "body"]), StageSpec(modules=["head"])])
        strategy = ctx.strategy(plan=plan, frontend="sequential")
        loader = DataLoader(ids, batch_size=8 // ctx.dp, drop_last=True)
    else:
        loader = DataLoader(ids, batch_size=8, sampler=DistributedSampler(ids, num_replicas=1, rank=0, seed=0),
                            drop_last=True)
    trainer = ctx.trainer(strategy=strategy, max_epochs=1)
    trainer.fit(model, loader)
    return snapshot(trainer, model)


# ---------------------------------------------------------------------------------------------- Lightning's tools
@scenario("pp2")
def tuner_lr_find_then_fit(ctx):
    """``Tuner(trainer).lr_find`` (it saves and restores a checkpoint around its trial steps), the suggested rate set
    on the module, then ``fit``; no checkpoint of the finder left behind. On pp=2 only: the finder reads each
    process's own loss, which under dp=2 is a replica's (as under DDP), not one process's."""
    from lightning.pytorch.tuner import Tuner

    model = seeded(Net)
    trainer = ctx.trainer(max_epochs=1)
    found = Tuner(trainer).lr_find(model, ctx.train_loader(n=320), min_lr=1e-4, max_lr=1.0, num_training=30)
    suggestion = found.suggestion()
    trainer.fit(model, ctx.train_loader())
    left = sorted(p.name for p in ctx.out.iterdir() if p.name.startswith(".lr_find"))
    return snapshot(trainer, model, suggestion=suggestion, module_lr=model.lr, lr_find_losses=found.results["loss"],
                    left_behind=left)


@scenario()
def stochastic_weight_averaging(ctx):
    """``StochasticWeightAveraging`` from the second epoch: the averaged weights replace the trained ones at the end."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    model = seeded(Net)
    trainer = ctx.trainer(callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)], max_epochs=3,
                          limit_train_batches=4)
    trainer.fit(model, ctx.train_loader())
    return snapshot(trainer, model)


@scenario()
def ema_weight_averaging(ctx):
    """``EMAWeightAveraging``: validation runs on the averaged weights (swapped in and out), which the module holds at
    the end."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    model = seeded(Net)
    trainer = ctx.trainer(callbacks=[EMAWeightAveraging(decay=0.9)], max_epochs=2, limit_train_batches=4,
                          limit_val_batches=2)
    trainer.fit(model, ctx.train_loader(), ctx.eval_loader())
    return snapshot(trainer, model)


# ---------------------------------------------------------------------------------------- loggers, writers, summary
def logged_files(root) -> dict:
    """What the offline loggers wrote under ``root``: ``metrics.csv`` rows, TensorBoard scalars, MLflow metrics and
    params, each by name with its steps and values."""
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for path in sorted(root.rglob("metrics.csv")):
        with open(path) as f:
            out["csv"] = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    for path in sorted(root.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path.parent))
        acc.Reload()
        out["tensorboard"] = {tag: [(e.step,
                                     float(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    for metrics in sorted(root.rglob("mlruns/*/*/metrics")):
        out["mlflow"] = {p.name: [(int(line.split()[2]), float(line.split()[1])) for line in p.read_text().splitlines()]
                         for p in sorted(metrics.iterdir())}
        out["mlflow_params"] = {p.name: p.read_text() for p in sorted((metrics.parent / "params").iterdir())}
    return out


@scenario()
def loggers(ctx):
    """CSVLogger, TensorBoardLogger and MLFlowLogger (a file store) together: the files global rank zero writes hold
    what one process's hold (every rank reads them)."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

    class Hparams(Net):
        def __init__(self, lr: float = 0.1, width: int = 16) -> None:
            super().__init__(lr=lr)
            self.save_hyperparameters()

    import os

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # the file store, kept by MLflow on request
    root = ctx.out / "logs"
    loggers = [CSVLogger(str(root), name="csv"), TensorBoardLogger(str(root), name="tb"),
               MLFlowLogger(experiment_name="conformance", tracking_uri=f"file:{root / 'mlruns'}")]
    model = seeded(Hparams)
    trainer = ctx.trainer(logger=loggers, max_epochs=2, limit_train_batches=4, limit_val_batches=2)
    trainer.fit(model, ctx.train_loader(), ctx.eval_loader())
    trainer.strategy.barrier()  # every rank reads once global rank zero has written
    return snapshot(trainer, model, files=logged_files(root))


@scenario()
def prediction_writer(ctx):
    """A ``BasePredictionWriter`` writing per batch and per epoch to files named by the global rank: every prediction
    is written once, by the ranks of the pipeline's first position, in the files DDP with one process per replica
    writes."""
    from lightning.pytorch.callbacks import BasePredictionWriter

    out = ctx.out / "predictions"

    class FileWriter(BasePredictionWriter):
        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            torch.save(prediction, out / f"rank{trainer.global_rank}_batch{batch_idx}.pt")

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            torch.save((predictions, batch_indices), out / f"rank{trainer.global_rank}_epoch.pt")

    out.mkdir(exist_ok=True)
    model = seeded(Net)
    trainer = ctx.trainer(callbacks=[FileWriter(write_interval="batch_and_epoch")])
    trainer.predict(model, ctx.eval_loader(), return_predictions=False)
    trainer.strategy.barrier()
    return {"files": {p.name: torch.load(p, weights_only=False) for p in sorted(out.iterdir())}}


@scenario()
def model_summary(ctx):
    """``ModelSummary(max_depth=2)`` and ``RichModelSummary``: global rank zero prints the table of the whole model
    (layers, types, parameters, modes, totals) with a frozen stage, as one process prints it."""
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    tables = {}
    for callback in (ModelSummary(max_depth=2), RichModelSummary()):
        captured = {}

        def keep(summary_data, total, trainable, size, modes, total_flops=0, _captured=captured, **kwargs):
            _captured.update(data=[(k, list(v)) for k, v in summary_data], total=total, trainable=trainable,
                             size=round(size, 6), modes=modes)

        callback.summarize = keep
        model = seeded(FineTune)
        trainer = ctx.trainer(strategy=finetune_strategy(ctx), callbacks=[callback], enable_model_summary=True,
                              max_epochs=1, limit_train_batches=1)
        trainer.fit(model, ctx.train_loader())
        tables[type(callback).__name__] = dict(captured)
    return {"tables": tables}


# ---------------------------------------------------------------------------------------------- refused at setup
def _refusal(ctx, make_trainer, model=None) -> dict:
    """Fit on a Trainer of ``make_trainer()``: one process trains; under the pipeline every rank raises at setup (the
    error's text recorded, and whether any step ran)."""
    model = model if model is not None else seeded(Net)
    trainer = make_trainer()
    try:
        trainer.fit(model, ctx.train_loader())
        return {"refused": None, "global_step": trainer.global_step}
    except Exception as e:  # noqa: BLE001 - recorded for the test
        return {"refused": f"{type(e).__name__}: {e}", "global_step": trainer.global_step}


@scenario()
def refused_setups(ctx):
    """``ModelPruning``, ``Trainer(sync_batchnorm=True)`` and a ``backward`` override: refused at setup on every rank
    (one process runs them)."""
    from lightning.pytorch.callbacks import ModelPruning

    class OwnBackward(Net):
        def backward(self, loss, *args, **kwargs):
            loss.backward()

    limits = {"max_epochs": 1, "limit_train_batches": 2}
    return {
        "pruning": _refusal(ctx,
                            lambda: ctx.trainer(callbacks=[ModelPruning("l1_unstructured", amount=0.2)], **limits)),
        "sync_batchnorm": _refusal(ctx, lambda: ctx.trainer(sync_batchnorm=True, **limits)),
        "backward": _refusal(ctx, lambda: ctx.trainer(**limits), model=seeded(OwnBackward)),
    }
