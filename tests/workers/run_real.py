"""Train a real model (tests.harness.zoo.real) under HPPStrategy, for one or more configurations in one launch.

Every rank saves, per configuration, to OUT/<name>/rank{r}.pt: the parameters it holds, the loss
logged at every step (as rank 0's loggers see it), the plan and the frontend, its optimizer state
(by parameter name), the global step and the checkpoint it resumed from.
Usage: python -m tests.workers.run_real '<tests.harness.runs.Runs of RealRun, as JSON>'

Config fields (tests.harness.runs.RealRun): ``model`` (a tests.harness.zoo.real kind, or ``"mlp"``:
tests.harness.zoo.MLP), ``points`` (cut points, or None), ``precision`` (one per stage, with ``points``),
``schedule``, ``n_micro``, ``pp``, ``frontend``, ``steps``, ``batch``, ``n``, ``limit_val_batches``, ``out``,
``model_kw`` (for the model, e.g. ``{"in_configure_model": true}``), ``wrapper`` (``"split_mlp"``:
tests.harness.zoo.real.SplitMLP), ``strategy`` (more HPPStrategy keyword arguments), and for checkpoints
``ckpt_dir``, ``every`` (steps between saves), ``resume`` (``"auto"`` or a path), ``fp8_backend``
(``HPPPrecision(fp8_backend=...)``; the rank then also saves its fp8 scaling state at the start and at
the end of training, ``fp8_start`` / ``fp8_end``: layer or weight name -> tensor name -> tensor), and
``fp8_capable`` (``true``: every device counts as able to run Transformer Engine fp8, as an H100 with
TE installed would, so that what is refused *because of the frontend* can be checked on CPUs). A
rank whose run raises writes ``<out>/rank{r}_error.txt`` (the exception's type and message) and
exits with it, unless the config has ``refused=True`` (a bad setup): then every rank records its
error (:mod:`tests.workers.refusals`) and goes on to the next configuration, and the job exits with
status 1 at the end.
"""

import os
import sys

import lightning as L
import torch

from lightning_hpp import HPPPrecision, HPPStrategy, StagePlan
from lightning_hpp.options import CheckpointOptions
from tests.harness.runs import RealRun, Runs
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo.real import LMWrapper, loader


class StepLosses(L.Callback):
    def __init__(self, key: str = "train/loss") -> None:
        self.key = key
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics[self.key]))


class FP8States(L.Callback):
    """This rank's fp8 scaling state (copies) when training starts (after a resume's load) and ends."""

    def __init__(self) -> None:
        self.at: dict[str, dict] = {}

    def _take(self, trainer, pl_module, when: str) -> None:
        from lightning_hpp.checkpoint.fp8_state import fp8_state
        from lightning_hpp.precision.fp8_slots import fp8_slots

        plugin = trainer.precision_plugin
        state = fp8_state(fp8_slots(pl_module, plugin.fp8_recipe, plugin.fp8_emulations))
        self.at[when] = {name: {k: v.detach().cpu().clone() for k, v in entry.items() if isinstance(v, torch.Tensor)}
                         for name, entry in state.items()}

    def on_train_start(self, trainer, pl_module):
        self._take(trainer, pl_module, "start")

    def on_train_end(self, trainer, pl_module):
        self._take(trainer, pl_module, "end")


def _model_and_data(cfg: RealRun):
    if cfg.model == "mlp":
        from tests.harness.zoo import MLP, loaders

        train, val = loaders(cfg.batch, n=cfg.n or 128)
        return MLP(**cfg.model_kw), train, val if cfg.limit_val_batches else None, "train_loss"
    if cfg.wrapper == "split_mlp":  # deep_mlp with a parallelize_stage hook
        from tests.harness.zoo.real import SplitMLP

        model = SplitMLP(**cfg.model_kw)
    else:
        model = LMWrapper(cfg.model, **cfg.model_kw)
    train = loader(cfg.model, cfg.batch, n=cfg.n or 32)
    val = loader(cfg.model, cfg.batch, n=16) if cfg.limit_val_batches else None
    return model, train, val, "train/loss"


def run(cfg: RealRun, devices: int) -> None:
    if not cfg.fp8_capable:
        return _run(cfg, devices)
    from lightning_hpp.precision import fp8

    saved = fp8.fp8_capable, fp8.te_version
    fp8.fp8_capable, fp8.te_version = (lambda device: (True, "")), (lambda: "(simulated)")
    try:
        return _run(cfg, devices)
    finally:
        fp8.fp8_capable, fp8.te_version = saved


def _record_materialized() -> list[str]:
    """Every parameter name this rank materializes off the meta device (the worker saves the list)."""
    import lightning_hpp.model.materialize as strategy_module

    names: list[str] = []
    real = strategy_module.materialize

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        names.extend(out)
        return out

    strategy_module.materialize = recording
    return names


def _run(cfg: RealRun, devices: int) -> None:
    L.seed_everything(0)
    materialized = _record_materialized()
    model, train, val, loss_key = _model_and_data(cfg)
    fields = {"precision": cfg.precision} if cfg.precision else {}
    points = cfg.points
    plan = "auto" if points == "auto" else StagePlan.split_at(points, **fields) if points else None
    ckpt_dir = cfg.ckpt_dir
    checkpoint = CheckpointOptions(dir=ckpt_dir, every_n_steps=cfg.every if ckpt_dir else None,
                                   resume=cfg.resume)
    strategy = HPPStrategy(plan=plan, schedule=cfg.schedule, n_microbatches=cfg.n_micro, pp_degree=cfg.pp,
                           frontend=cfg.frontend, checkpoint=checkpoint, timeout=120, **cfg.strategy)
    losses, fp8_states = StepLosses(loss_key), FP8States()
    plugins = [HPPPrecision(fp8_backend=cfg.fp8_backend)] if cfg.fp8_backend else None
    callbacks = [losses, fp8_states] if plugins else [losses]
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_steps=cfg.steps, plugins=plugins,
                            callbacks=callbacks, enable_checkpointing=bool(ckpt_dir), num_sanity_val_steps=0,
                            limit_val_batches=cfg.limit_val_batches, default_root_dir=cfg.out,
                            gradient_clip_val=cfg.gradient_clip_val)
    try:
        trainer.fit(model, train, val)
    except BaseException as exc:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, f"rank{trainer.global_rank}_error.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise
    from lightning_hpp.checkpoint.lightning_state import optimizer_to_named, param_names

    optim, _ = optimizer_to_named(trainer.optimizers[0], param_names(model))
    from torch.distributed.tensor import DTensor

    # a tensor-parallel shard saved whole (collective over its tp group: every rank of it calls this in one order)
    state = {k: (v.full_tensor() if isinstance(v,
                                               DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
    out = {
        "state": state,
        "local_shapes": {n: list(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)},
        "param_bytes": sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                           for p in model.parameters()),
        "meta_params": [n for n, p in model.named_parameters() if p.is_meta],
        "materialized": materialized,
        "losses": losses.losses,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "stage_ids": strategy.stage_ids,
        "split_calls": getattr(model, "split_calls", None),
        "plan": strategy.plan.to_dict(),
        "optim": optim,
        "global_step": trainer.global_step,
        "resumed_from": strategy.resumed_from,
        "fp8_start": fp8_states.at.get("start"),
        "fp8_end": fp8_states.at.get("end"),
    }
    os.makedirs(cfg.out, exist_ok=True)
    torch.save(out, os.path.join(cfg.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    import functools

    from tests.workers.refusals import exit_status, try_case

    spec = Runs.from_json(sys.argv[1])
    records = []
    for cfg in spec.runs:
        if cfg.refused:
            records.append(try_case(cfg.out, spec.devices, functools.partial(run, cfg, spec.devices)))
        else:
            run(cfg, spec.devices)
    sys.exit(exit_status(records))
