"""The conformance scenarios: one Lightning behaviour each, run under HPPStrategy (pp=2 on 2 ranks, pp=2 × dp=2
on 4 ranks) and under one process with Lightning's default strategy (the reference).

Each scenario is the same code on every layout (:class:`~tests.conformance.harness.Ctx` gives it the
layout's Trainer and loaders) and returns what this rank recorded. Where the reference needs more than
the same run to say what a replica of dp=2 computes (a value logged without ``sync_dist``, what each
replica predicts), it records that too: :class:`ReplicaProbe` evaluates the step's loss on replica
``r``'s rows ``r::2`` of the reference batch, with the parameters the step sees. Resumed runs are
compared with the reference run that was never interrupted; the reference also records the same two
fits under Lightning's default strategy (``lightning_resumed``).

Most models log with ``sync_dist=True``, so that every rank of both layouts holds the reference's value;
:func:`sync_dist` covers the values logged without it.
"""

from __future__ import annotations

import os
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch import nn

from tests.conformance.harness import Ctx, checkpoint_state, rank, replica_loader, scenario, seeded, snapshot
from tests.harness.zoo import MLP

# ---------------------------------------------------------------------------------------------- models


class Net(MLP):
    """tests.harness.zoo.MLP of depth 3 (units ``layers.0`` … ``layers.4``), SGD with momentum, values logged with
    ``sync_dist=True``; ``scheduler``: ``None``, ``"epoch"`` (StepLR every epoch), ``"step"`` (StepLR, interval
    "step") or ``"plateau"`` (ReduceLROnPlateau on ``val_loss``)."""

    def __init__(self, lr: float = 0.1, seed: int = 0, scheduler: str | None = None) -> None:
        super().__init__(depth=3, lr=lr, seed=seed)
        self.scheduler = scheduler

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("test_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.scheduler == "epoch":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        if self.scheduler == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.scheduler == "plateau":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}
        return opt


class ReplicaProbe(Callback):
    """Reference only: the loss replica ``r`` of ``dp`` computes on each batch, from rows ``r::dp`` of the reference
    batch (its share, see tests.conformance.harness), with the parameters the step sees (before the step)."""

    def __init__(self, dp: int = 2) -> None:
        self.dp = dp
        self.train: list[list[float]] = []
        self.val: list[list[list[float]]] = []  # per validation run, per batch, per replica

    def _losses(self, module, batch) -> list[float]:
        x, y = batch
        with torch.no_grad():
            return [float(F.cross_entropy(module(x[r :: self.dp]), y[r :: self.dp])) for r in range(self.dp)]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train.append(self._losses(pl_module, batch))

    def on_validation_epoch_start(self, trainer, pl_module):
        self.val.append([])

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val[-1].append(self._losses(pl_module, batch))

    def record(self) -> dict:
        return {"dp": self.dp, "train": self.train, "val": self.val}


def probe_for(ctx: Ctx) -> list[Callback]:
    return [] if ctx.hpp else [ReplicaProbe()]


def probe_record(callbacks: list[Callback]) -> dict | None:
    return callbacks[0].record() if callbacks else None


def fit_once(ctx: Ctx, model: L.LightningModule, *, val: bool = True, callbacks: list | tuple = (),
             train_kw: dict | None = None,
             **trainer_kw) -> L.Trainer:
    trainer = ctx.trainer(callbacks=callbacks, **trainer_kw)
    trainer.fit(model, ctx.train_loader(**(train_kw or {})), ctx.eval_loader() if val else None)
    return trainer


# ---------------------------------------------------------------------------------------------- fit


@scenario()
def fit(ctx):
    """Two epochs: final parameters, the loss of every step (logged and handed to ``on_train_batch_end``)."""
    model = seeded(Net)
    probe = probe_for(ctx)
    trainer = fit_once(ctx, model, callbacks=probe)
    return snapshot(trainer, model, probe=probe_record(probe))


@scenario()
def accumulate(ctx):
    """``accumulate_grad_batches=2``."""
    model = seeded(Net)
    trainer = fit_once(ctx, model, accumulate_grad_batches=2)
    return snapshot(trainer, model)


@scenario()
def gradient_clip(ctx):
    """``Trainer(gradient_clip_val=0.05)``: Lightning clips the norm of all the model's gradients together."""
    model = seeded(Net)
    trainer = fit_once(ctx, model, val=False, max_epochs=1, gradient_clip_val=0.05)
    return snapshot(trainer, model)


@scenario()
def limit_batches(ctx):
    """``limit_train_batches=5``, ``limit_val_batches=2``, three epochs."""
    model = seeded(Net)
    trainer = fit_once(ctx, model, max_epochs=3, limit_train_batches=5, limit_val_batches=2)
    return snapshot(trainer, model)


@scenario()
def val_every_n_epochs(ctx):
    """``check_val_every_n_epoch=2`` over four epochs: validation after epochs 1 and 3 only."""
    model = seeded(Net)
    trainer = fit_once(ctx, model, max_epochs=4, check_val_every_n_epoch=2, limit_train_batches=4)
    return snapshot(trainer, model)


@scenario()
def val_check_interval(ctx):
    """``val_check_interval=0.5``: validation in the middle and at the end of each epoch."""
    model = seeded(Net)
    trainer = fit_once(ctx, model, val_check_interval=0.5)
    return snapshot(trainer, model)


@scenario()
def drop_last_false(ctx):
    """100 samples, ``drop_last=False``: every epoch ends with a smaller batch (4 samples of 8)."""
    model = seeded(Net)
    trainer = fit_once(ctx, model, train_kw={"n": 100, "drop_last": False})
    return snapshot(trainer, model)


@scenario()
def max_steps(ctx):
    """``max_steps=7``: stops in the middle of the first epoch."""
    model = seeded(Net)
    trainer = fit_once(ctx, model, max_steps=7, max_epochs=-1)
    return snapshot(trainer, model)


class Pace(Callback):
    """Every training step takes at least ``seconds``: a run's length in steps then does not depend on how fast
    the machine is (200 steps of 30 ms outlast a ``max_time`` of 2 s on any machine)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args, **kwargs) -> None:
        time.sleep(self.seconds)


@scenario()
def max_time(ctx):
    """``max_time`` of 2 s (and at most 200 steps of at least 30 ms each): every rank stops at the same step, every
    step before and the parameters at the stop equal the reference's at that step (it runs the 200 steps and keeps
    the parameters after each; a small learning rate keeps 200 steps of summation-order differences within the
    tolerance)."""
    model, states = seeded(Net, lr=0.02), StateAt()
    stop = {"max_time": {"seconds": 2}, "callbacks": [Pace(0.03)]} if ctx.hpp else {"callbacks": [states]}
    start = time.monotonic()
    trainer = fit_once(ctx, model, val=False, max_steps=200, max_epochs=-1, **stop)
    return snapshot(trainer, model, wall=time.monotonic() - start, **({} if ctx.hpp else {"states": states.states}))


class StateAt(Callback):
    """The module's parameters after every optimizer step, by global step."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.states[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


class MultiVal(Net):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)


@scenario()
def val_dataloaders(ctx):
    """Two validation loaders (48 and 32 samples): ``val_loss/dataloader_idx_{0,1}``."""
    model = seeded(MultiVal)
    trainer = ctx.trainer()
    trainer.fit(model, ctx.train_loader(), [ctx.eval_loader(), ctx.eval_loader(n=32, seed=2)])
    return snapshot(trainer, model)


class ReduceFx(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        epoch = {"on_step": False, "on_epoch": True, "sync_dist": True}
        self.log("t_mean", loss, reduce_fx="mean", **epoch)
        self.log("t_sum", y.float().sum(), reduce_fx="sum", **epoch)
        self.log("t_max", logits.max(), reduce_fx="max", **epoch)
        self.log("t_min", logits.min(), reduce_fx=torch.min, **epoch)
        self.log("s_sum", (y == 0).float().sum(), reduce_fx="sum", on_step=True, on_epoch=False, sync_dist=True)
        self.log("s_max", logits.max(), reduce_fx=torch.max, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("v_mean", F.cross_entropy(logits, y), reduce_fx="mean", sync_dist=True)
        self.log("v_sum", y.float().sum(), reduce_fx="sum", sync_dist=True)
        self.log("v_max", logits.max(), reduce_fx="max", sync_dist=True)
        self.log("v_min", logits.min(), reduce_fx="min", sync_dist=True)


@scenario()
def reduce_fx(ctx):
    """``reduce_fx`` mean / sum / max / min, per step and per epoch, in training and validation."""
    model = seeded(ReduceFx)
    trainer = fit_once(ctx, model)
    return snapshot(trainer, model)


class StepEpoch(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("a_step", loss, on_step=True, on_epoch=False, sync_dist=True)
        self.log("b_epoch", loss * 2, on_step=False, on_epoch=True, sync_dist=True)
        self.log("c_both", loss * 3, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("v_step", loss, on_step=True, on_epoch=False, sync_dist=True)
        self.log("v_both", loss * 2, on_step=True, on_epoch=True, sync_dist=True)
        self.log("v_epoch", loss * 3, sync_dist=True)


@scenario()
def on_step_on_epoch(ctx):
    """``on_step`` / ``on_epoch`` combinations (``_step`` / ``_epoch`` names when both), training and validation."""
    model = seeded(StepEpoch)
    trainer = fit_once(ctx, model)
    return snapshot(trainer, model)


class SyncDist(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss_sync", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("loss_local", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_sync", loss, sync_dist=True)
        self.log("val_local", loss)


@scenario()
def sync_dist(ctx):
    """``sync_dist=True`` values are the replicas' reduction (the reference's value); without it each replica logs its
    own, as under DDP (the reference's :class:`ReplicaProbe`)."""
    model = seeded(SyncDist)
    probe = probe_for(ctx)
    trainer = fit_once(ctx, model, callbacks=probe)
    return snapshot(trainer, model, probe=probe_record(probe))


class Mixed(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("hidden", loss * 2, logger=False, sync_dist=True)
        self.log("bar_only", loss * 3, prog_bar=True, logger=False, sync_dist=True)
        self.log_dict({"d_one": loss * 4, "d_two": loss * 5}, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log_dict({"val_loss": loss, "val_acc": (logits.argmax(1) == y).float().mean()}, prog_bar=True,
                      sync_dist=True)
        self.log("val_hidden", loss * 2, logger=False, sync_dist=True)


@scenario()
def metrics_dicts(ctx):
    """``callback_metrics``, ``logged_metrics``, ``progress_bar_metrics`` and what the logger receives, whole, on every
    rank (values with ``prog_bar``, ``logger=False``, ``log_dict``)."""
    model = seeded(Mixed)
    trainer = fit_once(ctx, model)
    return snapshot(trainer, model)


# ---------------------------------------------------------------------------------------------- callbacks


@scenario()
def checkpoint_top_k(ctx):
    """``ModelCheckpoint(monitor="val_loss", mode="max", save_top_k=2)`` over four epochs. On this random data
    ``val_loss`` rises every epoch, so with ``mode="max"`` epochs 2 and 3 each displace the worst kept checkpoint
    (rank 0 deletes it) and every rank's top-k bookkeeping changes twice. (A learning rate that made ``val_loss``
    fall and rise diverges on this model, and divergence grows the micro-batches' rounding past any bound.)"""
    model = seeded(Net)
    cb = ModelCheckpoint(dirpath=ctx.path("ckpt"), monitor="val_loss", mode="max", save_top_k=2)
    trainer = fit_once(ctx, model, callbacks=[cb], max_epochs=4, limit_train_batches=6)
    trainer.strategy.barrier()  # rank 0 removes what top-k drops; list the directory once it has
    return snapshot(trainer, model, checkpoint=checkpoint_state(cb))


@scenario()
def checkpoint_every_n_steps(ctx):
    """``ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)`` over one epoch."""
    model = seeded(Net)
    cb = ModelCheckpoint(dirpath=ctx.path("ckpt"), every_n_train_steps=3, save_top_k=-1)
    trainer = fit_once(ctx, model, val=False, callbacks=[cb], max_epochs=1)
    trainer.strategy.barrier()
    return snapshot(trainer, model, checkpoint=checkpoint_state(cb))


@scenario()
def early_stopping(ctx):
    """``EarlyStopping(monitor="val_loss", patience=1)`` (``min_delta=0.05``): stops at the reference's epoch."""
    model = seeded(Net)
    cb = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05)
    trainer = fit_once(ctx, model, callbacks=[cb], max_epochs=12, limit_train_batches=4)
    early = {"stopped_epoch": cb.stopped_epoch, "wait_count": cb.wait_count, "best_score": float(cb.best_score)}
    return snapshot(trainer, model, early=early)


@scenario()
def lr_monitor(ctx):
    """``LearningRateMonitor(logging_interval="step")`` with an epoch StepLR: the ``lr-SGD`` the logger receives."""
    model = seeded(Net, scheduler="epoch")
    trainer = fit_once(ctx, model, val=False, callbacks=[LearningRateMonitor(logging_interval="step")], max_epochs=3,
                       limit_train_batches=4)
    return snapshot(trainer, model)


@scenario()
def reduce_lr_on_plateau(ctx):
    """``ReduceLROnPlateau`` monitoring ``val_loss`` (patience 0, threshold 10 %): the LR of every epoch."""
    model = seeded(Net, scheduler="plateau")
    trainer = fit_once(ctx, model, max_epochs=5, limit_train_batches=4)
    return snapshot(trainer, model)


@scenario()
def step_scheduler(ctx):
    """A StepLR with ``{"interval": "step"}`` (every 3 steps): the LR of every step."""
    model = seeded(Net, scheduler="step")
    trainer = fit_once(ctx, model, val=False, max_epochs=1)
    return snapshot(trainer, model)


# ---------------------------------------------------------------------------------------------- entry points

PREDICT = {"n": 44, "seed": 3}  # 44 samples: a last batch of 4 (dp=1) or 2 (each of dp=2)


@scenario()
def predict(ctx):
    """``trainer.predict`` after one epoch: the ordered list of per-batch predictions (on dp=2, each replica's
    share)."""
    model = seeded(Net)
    trainer = fit_once(ctx, model, val=False, max_epochs=1)
    if ctx.hpp:
        predictions = [p.clone() for p in trainer.predict(model, ctx.eval_loader(**PREDICT))]
    else:
        predictions = {
            dp: [[p.clone() for p in trainer.predict(model, replica_loader(dp, r, **PREDICT))] for r in range(dp)]
                       for dp in (1, 2)}
    return snapshot(trainer, model, predictions=predictions)


@scenario()
def validate_around_fit(ctx):
    """``trainer.validate`` before and after ``fit`` (one epoch) with the same Trainer: the returned metrics."""
    model = seeded(Net)
    trainer = ctx.trainer(max_epochs=1)
    before = trainer.validate(model, ctx.eval_loader(), verbose=False)
    trainer.fit(model, ctx.train_loader(), ctx.eval_loader())
    after = trainer.validate(model, ctx.eval_loader(), verbose=False)
    return snapshot(trainer, model, before=before, after=after)


@scenario()
def trainer_test_around_fit(ctx):
    """``trainer.test`` before and after ``fit`` (one epoch), 44 test samples (a smaller last batch)."""
    model = seeded(Net)
    trainer = ctx.trainer(max_epochs=1)
    before = trainer.test(model, ctx.eval_loader(n=44, seed=4), verbose=False)
    trainer.fit(model, ctx.train_loader(), ctx.eval_loader())
    after = trainer.test(model, ctx.eval_loader(n=44, seed=4), verbose=False)
    return snapshot(trainer, model, before=before, after=after)


# ---------------------------------------------------------------------------------------------- resume


def two_fits(ctx: Ctx, first: dict, second: dict, ckpt_path=lambda d: None, callbacks=lambda d: [],
             strategy=lambda: None,
             val: bool = True, train_kw: dict | None = None, directory: str = "ckpt") -> dict:
    """Fit a fresh model with Trainer arguments ``first``, then another fresh model with ``second`` from
    ``ckpt_path(dir)``; ``callbacks(dir)`` for each, ``dir`` a directory of this scenario's."""
    results, where = [], ctx.path(directory)
    for i, kw in enumerate((first, second)):
        model = seeded(Net)
        hpp = strategy()
        extra = {} if hpp is None else {"strategy": hpp, "enable_checkpointing": True}
        trainer = ctx.trainer(callbacks=callbacks(where), **extra, **kw)
        trainer.fit(model, ctx.train_loader(**(train_kw or {})), ctx.eval_loader() if val else None,
                    ckpt_path=ckpt_path(where) if i else None)
        results.append(snapshot(trainer, model))
    return {**results[1], "first": results[0]}


def resumed(ctx: Ctx, uninterrupted: dict, **two: object) -> dict:
    """The resumed run (:func:`two_fits`) on a pipeline; on the reference the run without interruption and, for the
    record, the same two fits under Lightning's default strategy (``lightning_resumed``, in a directory of its own)."""
    if ctx.hpp:
        return two_fits(ctx, **two)
    model = seeded(Net)
    trainer = ctx.trainer(callbacks=two.get("callbacks", lambda d: [])(ctx.path("uninterrupted")), **uninterrupted)
    trainer.fit(model, ctx.train_loader(**(two.get("train_kw") or {})),
                ctx.eval_loader() if two.get("val", True) else None)
    out = snapshot(trainer, model)
    if "strategy" not in two:  # the HPPStrategy checkpoint options have no counterpart under the default strategy
        out["lightning_resumed"] = two_fits(ctx, **two, directory="lightning_resumed")
    return out


def _every_5(d: str) -> list:
    return [ModelCheckpoint(dirpath=d, every_n_train_steps=5, save_top_k=-1)]


def _last(d: str) -> list:
    return [ModelCheckpoint(dirpath=d, save_last=True)]


def _step_5(d: str) -> str:
    return f"{d}/epoch=0-step=5.ckpt"


def _named_last(d: str) -> str:
    return "last"


@scenario()
def resume_last(ctx):
    """``ModelCheckpoint(save_last=True)``, two epochs; then ``fit(max_epochs=3, ckpt_path="last")``: equal to three
    epochs without interruption."""
    return resumed(ctx, {"max_epochs": 3}, first={"max_epochs": 2}, second={"max_epochs": 3}, ckpt_path=_named_last,
                   callbacks=_last)


@scenario()
def resume_auto(ctx):
    """``HPPStrategy(checkpoint=CheckpointOptions(dir=..., resume="auto"))``: two epochs, then ``max_epochs=3``."""
    from lightning_hpp import CheckpointOptions

    options = CheckpointOptions(dir=ctx.path("steps"), resume="auto")
    run = resumed(ctx, {"max_epochs": 3}, first={"max_epochs": 2}, second={"max_epochs": 3},
                  strategy=lambda: ctx.strategy(checkpoint=options) if ctx.hpp else None)
    if ctx.hpp:
        run["checkpoints"] = sorted(os.listdir(ctx.path("steps")))
    return run


@scenario()
def resume_mid_epoch(ctx):
    """``ModelCheckpoint(every_n_train_steps=5)`` in one epoch; resumed from its step-5 checkpoint (mid-epoch) for two
    epochs: equal to two epochs without interruption."""
    return resumed(ctx, {"max_epochs": 2}, first={"max_epochs": 1}, second={"max_epochs": 2}, ckpt_path=_step_5,
                   callbacks=_every_5)


@scenario()
def resume_max_steps(ctx):
    """``max_steps=5`` with ``ModelCheckpoint(save_last=True)`` (no validation: it saves when the stopped epoch ends);
    then ``max_steps=10`` from "last": equal to ten steps without interruption."""
    return resumed(ctx, {"max_steps": 10, "max_epochs": -1}, first={"max_steps": 5, "max_epochs": -1},
                   second={"max_steps": 10, "max_epochs": -1}, ckpt_path=_named_last, val=False, callbacks=_last)


@scenario()
def resume_workers(ctx):
    """The mid-epoch resume with ``DataLoader(num_workers=2)``."""
    return resumed(ctx, {"max_epochs": 2}, first={"max_epochs": 1}, second={"max_epochs": 2}, ckpt_path=_step_5,
                   train_kw={"num_workers": 2}, callbacks=_every_5)


# ---------------------------------------------------------------------------------------------- models and setups


class Unseeded(Net):
    """Built without a common seed: each rank's weights differ (``1000 + LOCAL_RANK``), as with no
    ``seed_everything``."""

    def __init__(self) -> None:
        super().__init__(seed=1000 + rank())


@scenario()
def unseeded(ctx):
    """A model whose weights differ per rank: replicas end equal to each other and to the reference started from rank
    0's weights (``initial``: the whole model before the cut)."""
    L.seed_everything(0, verbose=False)
    model = Unseeded()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = fit_once(ctx, model)
    return snapshot(trainer, model, initial=initial)


@scenario("single")
def single_device(ctx):
    """``devices=1`` with ``HPPStrategy()`` and no plan: one stage, equal to the reference."""
    model = seeded(Net)
    trainer = fit_once(ctx, model)
    return snapshot(trainer, model, stage_ids=list(getattr(trainer.strategy, "stage_ids", []) or []))


class DropoutNet(Net):
    """Units ``layers.0`` … ``layers.4`` with a dropout in the last stage: ``Linear, Tanh | Linear, Dropout,
    Linear``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 4))


@scenario("pp2")
def traced_dropout(ctx):
    """``validate()`` then ``fit()`` with one Trainer on the traced frontend: training runs in train mode (dropout on).

    One micro-batch of the whole batch (GPipe), so the last stage draws the same dropout mask as the reference's
    step from the same RNG state (both seeded just before each entry point, as DDP reseeds each run); on dp=2 the
    replicas would draw masks for their half-batches, which one process cannot reproduce, so pp=2 only.
    """
    model = DropoutNet()
    extra = {}
    if not ctx.hpp:  # the first batch's loss without dropout: what a run that trained in eval mode would log first
        x, y = next(iter(ctx.train_loader()))
        with torch.no_grad():
            extra["eval_mode_first_loss"] = float(F.cross_entropy(model.eval()(x), y))
        model.train()
    strategy = ctx.strategy(frontend="traced", schedule="gpipe", n_microbatches=1) if ctx.hpp else None
    trainer = ctx.trainer(strategy=strategy, max_epochs=1, limit_train_batches=6)
    L.seed_everything(0, verbose=False)
    before = trainer.validate(model, ctx.eval_loader(), verbose=False)
    L.seed_everything(0, verbose=False)
    trainer.fit(model, ctx.train_loader(), ctx.eval_loader())
    return snapshot(trainer, model, before=before, **extra)


# ---------------------------------------------------------------------------------------------- epoch-level state


class EpochEnd(Net):
    """Collects per-sample losses in the steps and logs their mean in the epoch-end hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.train_outs: list[torch.Tensor] = []
        self.val_outs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        self.train_outs.append(losses.detach())
        return losses.mean()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_outs.append(F.cross_entropy(self(x), y, reduction="none"))

    @staticmethod
    def _mean(outs: list[torch.Tensor]) -> torch.Tensor:
        # empty where the steps did not run the user's code: a plain torch.cat(outs) would raise there
        return (torch.cat(outs) if outs else torch.zeros(0)).mean()

    def on_train_epoch_end(self):
        self.log("train_epoch_loss", self._mean(self.train_outs), sync_dist=True)
        self.train_outs.clear()

    def on_validation_epoch_end(self):
        self.log("val_epoch_loss", self._mean(self.val_outs), sync_dist=True)
        self.val_outs.clear()


@scenario()
def epoch_end_outputs(ctx):
    """Outputs collected in ``training_step`` / ``validation_step`` and logged in ``on_*_epoch_end``."""
    model = seeded(EpochEnd)
    trainer = fit_once(ctx, model)
    return snapshot(trainer, model)


class Metrics(Net):
    """torchmetrics objects logged with ``self.log(name, metric)``: forward in training, ``update`` in validation."""

    def __init__(self) -> None:
        from torchmetrics import SumMetric
        from torchmetrics.classification import MulticlassAccuracy

        super().__init__()
        self.train_acc = MulticlassAccuracy(num_classes=4, average="macro")
        self.val_acc_macro = MulticlassAccuracy(num_classes=4, average="macro")
        self.val_loss_sum = SumMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc_macro.update(logits, y)
        self.val_loss_sum.update(F.cross_entropy(logits, y, reduction="none"))
        self.log("val_acc_macro", self.val_acc_macro)
        self.log("val_loss_sum", self.val_loss_sum)


@scenario()
def torchmetrics_logged(ctx):
    """A macro accuracy (not a mean of batch values) and a sum, as torchmetrics objects: Lightning computes them over
    the epoch (synced over the replicas) and resets them."""
    model = seeded(Metrics)
    trainer = fit_once(ctx, model)
    return snapshot(trainer, model)
