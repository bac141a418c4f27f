"""Conformance scenarios for the rows of Lightning's surface (tests/lightning_coverage.py) that the listed behaviours
do not cover: Trainer arguments and Lightning's callbacks, each once, on pp=2 (the replicas' share of a batch is
covered by the scenarios that run on pp=2 × dp=2 too)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from tests.conformance.harness import Ctx, scenario, seeded, snapshot
from tests.conformance.scenarios import Net, fit_once


def _fit(ctx: Ctx, model: L.LightningModule | None = None, callbacks: tuple = (), **kw) -> tuple:
    model = model if model is not None else seeded(Net)
    trainer = fit_once(ctx, model, callbacks=callbacks, **{"max_epochs": 2, "limit_train_batches": 4,
                                                            "limit_val_batches": 2, **kw})
    return trainer, model


# ---------------------------------------------------------------------------------------------- Trainer arguments
@scenario("pp2")
def overfit_batches(ctx):
    """``overfit_batches=2``: the same two training batches every epoch, unshuffled, validated on."""
    trainer, model = _fit(ctx, overfit_batches=2, max_epochs=3, limit_train_batches=None, limit_val_batches=None)
    return snapshot(trainer, model)


@scenario("pp2")
def fast_dev_run(ctx):
    """``fast_dev_run=2``: two batches of each loop, no logger, no checkpoint."""
    trainer, model = _fit(ctx, fast_dev_run=2, limit_train_batches=None, limit_val_batches=None)
    return snapshot(trainer, model)


@scenario("pp2")
def min_epochs_and_min_steps(ctx):
    """``min_epochs=2`` / ``min_steps=6`` against an ``EarlyStopping`` that would stop after the first epoch."""
    from lightning.pytorch.callbacks import EarlyStopping

    stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)
    trainer, model = _fit(ctx, callbacks=(stop,), min_epochs=2, min_steps=6, max_epochs=4)
    return snapshot(trainer, model)


@scenario("pp2")
def log_every_n_steps(ctx):
    """``log_every_n_steps=3``: the logger receives every third step."""
    trainer, model = _fit(ctx, log_every_n_steps=3)
    return snapshot(trainer, model)


@scenario("pp2")
def limit_test_and_predict_batches(ctx):
    """``limit_test_batches=2`` and ``limit_predict_batches=3``."""
    model = seeded(Net)
    trainer = ctx.trainer(limit_test_batches=2, limit_predict_batches=3)
    tested = trainer.test(model, ctx.eval_loader(), verbose=False)
    predicted = trainer.predict(model, ctx.eval_loader())
    return snapshot(trainer, model, tested=tested, predicted=[p.detach() for p in predicted])


@scenario("pp2")
def reload_dataloaders_every_n_epochs(ctx):
    """``reload_dataloaders_every_n_epochs=1`` with a module whose loaders grow each epoch."""

    class Growing(Net):
        def train_dataloader(self):
            return ctx.train_loader(n=64 + 16 * self.current_epoch)

        def val_dataloader(self):
            return ctx.eval_loader()

    model = seeded(Growing)
    trainer = ctx.trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1)
    trainer.fit(model)
    return snapshot(trainer, model)


@scenario("pp2")
def detect_anomaly_and_inference_mode_off(ctx):
    """``detect_anomaly=True`` (autograd's anomaly mode around the steps) and ``inference_mode=False`` (evaluation
    under ``no_grad``)."""
    trainer, model = _fit(ctx, detect_anomaly=True, inference_mode=False)
    validated = trainer.validate(model, ctx.eval_loader(), verbose=False)
    return snapshot(trainer, model, validated=validated)


@scenario("pp2")
def profiler_simple(ctx):
    """``profiler="simple"``: the run is profiled (the report is written) and trains as without it."""
    from lightning.pytorch.profilers import SimpleProfiler

    profiler = SimpleProfiler(dirpath=ctx.path("profile"), filename="report")
    trainer, model = _fit(ctx, profiler=profiler)
    return snapshot(trainer, model, profiled=sorted(profiler.recorded_durations) != [])


@scenario("pp2")
def barebones(ctx):
    """``barebones=True``: no logger, progress bar, model summary or checkpointing; trains as one process."""
    model = seeded(Net)
    trainer = L.Trainer(accelerator="cpu", devices=ctx.layout.devices, max_epochs=1, barebones=True,
                        limit_train_batches=4, num_sanity_val_steps=0,
                        **({"strategy": ctx.strategy()} if ctx.hpp else {}))
    trainer.fit(model, ctx.train_loader())
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "global_step": trainer.global_step}


@scenario("pp2")
def deterministic_and_benchmark(ctx):
    """``deterministic=True`` and ``benchmark=False``: torch's deterministic algorithms on every rank."""
    trainer, model = _fit(ctx, deterministic=True, benchmark=False)
    return snapshot(trainer, model, deterministic=torch.are_deterministic_algorithms_enabled())


class BatchNormNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 16), nn.Tanh(),
                                    nn.Linear(16, 4))


@scenario("pp2")
def enable_autolog_hparams_and_default_root_dir(ctx):
    """``save_hyperparameters`` logged to the logger (``enable_autolog_hparams``) under ``default_root_dir``."""

    class Hparams(Net):
        def __init__(self, lr: float = 0.1, width: int = 16) -> None:
            super().__init__(lr=lr)
            self.save_hyperparameters()

    model = seeded(Hparams)
    trainer = ctx.trainer(max_epochs=1, limit_train_batches=2, enable_autolog_hparams=True)
    trainer.fit(model, ctx.train_loader())
    return snapshot(trainer, model, hparams=dict(model.hparams))


# ---------------------------------------------------------------------------------------------- callbacks
@scenario("pp2")
def gradient_accumulation_scheduler(ctx):
    """``GradientAccumulationScheduler({0: 1, 1: 2})``: accumulate two batches from the second epoch."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trainer, model = _fit(ctx, callbacks=(GradientAccumulationScheduler({0: 1, 1: 2}),))
    return snapshot(trainer, model)


@scenario("pp2")
def lambda_callback(ctx):
    """``LambdaCallback``: its functions run on every rank with the arguments one process hands them."""
    from lightning.pytorch.callbacks import LambdaCallback

    seen: list = []
    callback = LambdaCallback(on_train_batch_end=lambda t, m, outputs, batch,
                              i: seen.append((i, float(outputs["loss"]))),
                              on_train_epoch_end=lambda t, m: seen.append(("epoch", t.current_epoch)))
    trainer, model = _fit(ctx, callbacks=(callback,))
    return snapshot(trainer, model, seen=seen)


@scenario("pp2")
def learning_rate_finder_callback(ctx):
    """``LearningRateFinder`` as a callback at the start of ``fit``."""
    from lightning.pytorch.callbacks import LearningRateFinder

    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=20)
    trainer, model = _fit(ctx, callbacks=(finder,), limit_train_batches=None, max_epochs=1)
    return snapshot(trainer, model, suggestion=finder.optimal_lr.suggestion(), module_lr=model.lr)


@scenario("pp2")
def scale_batch_size(ctx):
    """``Tuner(trainer).scale_batch_size`` (what ``BatchSizeFinder`` runs): Lightning refuses it under every distributed
    strategy (DDP included); the refusal reaches every rank before any trial step."""
    from lightning.pytorch.tuner import Tuner

    class Sized(Net):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2

        def train_dataloader(self):
            from torch.utils.data import DataLoader

            from tests.harness.zoo import make_dataset

            return DataLoader(make_dataset(96), batch_size=self.batch_size, drop_last=True)

        def val_dataloader(self):
            return ctx.eval_loader()

    model = seeded(Sized)
    trainer = ctx.trainer(max_epochs=1, limit_train_batches=3)
    try:
        found, refused = Tuner(trainer).scale_batch_size(model, mode="power", max_trials=3, steps_per_trial=2), None
    except ValueError as e:
        found, refused = None, str(e)
    return {"found": found, "refused": refused, "global_step": trainer.global_step}


@scenario("pp2")
def device_stats_and_throughput_monitors(ctx):
    """``DeviceStatsMonitor(cpu_stats=True)`` and ``ThroughputMonitor``: every rank logs the same keys one process logs
    (the values are measurements of each run)."""
    from lightning.pytorch.callbacks import DeviceStatsMonitor, ThroughputMonitor

    monitors = (DeviceStatsMonitor(cpu_stats=True), ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0)))
    trainer, model = _fit(ctx, callbacks=monitors)
    logged = sorted({k for _, metrics in trainer.logger.records for k in metrics})  # the monitors write to the logger
    return {"keys": logged, "callback_keys": sorted(trainer.callback_metrics),
            "state": snapshot(trainer, model)["state"]}


@scenario("pp2")
def spike_detection(ctx):
    """``SpikeDetection`` watching the training loss (no spike in this run: training goes on as one process)."""
    from lightning.pytorch.callbacks import SpikeDetection

    trainer, model = _fit(ctx, callbacks=(SpikeDetection(window=3, warmup=2, atol=100.0),))
    return snapshot(trainer, model)


@scenario("pp2")
def on_exception_checkpoint(ctx):
    """``OnExceptionCheckpoint``: an error at batch 2 (after its step) on every rank writes the checkpoint; resumed from
    it, the run ends as the uninterrupted run does (a resume continues the interrupted epoch)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    class Fails(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("raised by the test")

    limits = {"max_epochs": 1, "limit_train_batches": 5}
    out = {}
    if not ctx.hpp:  # what the resumed run must end as
        model = seeded(Net)
        ctx.trainer(**limits).fit(model, ctx.train_loader())
        out["uninterrupted"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return out
    model = seeded(Net)
    trainer = ctx.trainer(callbacks=[OnExceptionCheckpoint(dirpath=ctx.path("exc"), filename="on_exception"), Fails()],
                          enable_checkpointing=True, **limits)
    try:
        trainer.fit(model, ctx.train_loader())
    except RuntimeError as e:
        out["raised"] = str(e)
    resumed = seeded(Net)
    again = ctx.trainer(**limits)
    again.fit(resumed, ctx.train_loader(), ckpt_path=ctx.path("exc/on_exception.ckpt"))
    return {**out, "state": {k: v.detach().clone() for k, v in resumed.state_dict().items()},
            "global_step": again.global_step, "written": sorted(p.name for p in (ctx.out / "exc").iterdir())}


@scenario("pp2")
def progress_bars(ctx):
    """``TQDMProgressBar`` and ``RichProgressBar``: the metrics each shows, on every rank."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    shown = {}
    for bar in (TQDMProgressBar(refresh_rate=1), RichProgressBar()):
        model = seeded(Net)
        trainer = ctx.trainer(callbacks=[bar], enable_progress_bar=True, max_epochs=1, limit_train_batches=3,
                              limit_val_batches=2)
        trainer.fit(model, ctx.train_loader(), ctx.eval_loader())
        shown[type(bar).__name__] = {k: float(v) if isinstance(v, (int, float, torch.Tensor)) else v
                                     for k, v in bar.get_metrics(trainer, model).items()}
    return {**snapshot(trainer, model), "shown": shown}


@scenario("pp2")
def gradient_clip_by_value(ctx):
    """``gradient_clip_val=0.01, gradient_clip_algorithm="value"``: every gradient entry clamped, on every stage."""
    trainer, model = _fit(ctx, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    return snapshot(trainer, model)


@scenario("pp2")
def without_the_distributed_sampler(ctx):
    """``use_distributed_sampler=False`` with a plain, unshuffled loader: every rank reads the loader as built, as one
    process does (the pipeline's ranks then see the same batches)."""
    from torch.utils.data import DataLoader

    from tests.harness.zoo import make_dataset

    model = seeded(Net)
    trainer = ctx.trainer(use_distributed_sampler=False, max_epochs=1, limit_train_batches=6)
    trainer.fit(model, DataLoader(make_dataset(96), batch_size=8, drop_last=True))
    return snapshot(trainer, model)
