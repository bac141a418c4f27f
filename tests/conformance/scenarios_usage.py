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
    """The context's loaders as a LightningDataModule (so that its hooks are called too)."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx

    def train_dataloader(self):
        return self.ctx.train_loader()

    def val_dataloader(self):
        return self.ctx.eval_loader()

    def test_dataloader(self):
        return self.ctx.eval_loader()

    def predict_dataloader(self):
        return self.ctx.eval_loader()


@scenario()
def every_hook(ctx):
    """Every module, callback and datamodule hook Lightning calls in ``fit`` (with validation), ``validate``,
    ``test`` and ``predict`` on one Trainer, with its arguments, in order, on every rank."""
    log = HookLog()
    model = record_hooks(seeded(Net), "module", module_hooks(), log)
    data = record_hooks(Data(ctx), "datamodule", datamodule_hooks(), log)
    callback = record_hooks(L.Callback(), "callback", callback_hooks(), log)
    trainer = ctx.trainer(callbacks=[callback], max_epochs=1, limit_train_batches=3, limit_val_batches=2,
                          limit_test_batches=2, limit_predict_batches=2)
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data, verbose=False)
    trainer.test(model, datamodule=data, verbose=False)
    trainer.predict(model, datamodule=data)
    return snapshot(trainer, model, hooks=list(log))


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
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, backbone_initial_ratio_lr=0.5)
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
@scenario()
def tuner_lr_find_then_fit(ctx):
    """``Tuner(trainer).lr_find`` (it saves and restores a checkpoint around its trial steps), the suggested rate set
    on the module, then ``fit``; no checkpoint of the finder left behind."""
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
