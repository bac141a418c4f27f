"""Train, stop, resume: every rank saves its final parameters and optimizer state to OUT/<tag>_rank{r}.pt.

Usage: python -m tests.workers.run_resume '<json config>'
or, for several configurations one after another in the same processes (each with its own Trainer
and model; all with the same ``devices``), python -m tests.workers.run_resume '<json: {"runs": [config, ...]}>'
"""

import json
import os
import signal
import sys
import time
from tests.harness.trainer import quiet_trainer

PRELOADED = "lightning" in sys.modules  # before this script's imports: a worker of lightning_hpp.torchrun

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from lightning_hpp.options import CheckpointOptions
from tests.harness.zoo import MLP, loaders


class _KillAt(Callback):
    """SIGKILL this rank after ``step`` optimizer steps, on the first attempt of an elastic job only."""

    def __init__(self, step: int, rank: int, stamp: str) -> None:
        self.step, self.rank, self.stamp = step, rank, stamp

    def on_train_batch_end(self, trainer, *args):
        if (trainer.global_rank == self.rank and trainer.global_step == self.step
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            with open(self.stamp, "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


class _Losses(Callback):
    """The loss of every step trained here (the last stage's, which reaches every rank)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, *args):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _whole(t):
    # a sharded stage's DTensor, gathered (collective over its group: every rank saves in the same order)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _SplitMLP(MLP):
    """``MLP`` that a tensor-parallel run splits in its own hook: each stage's Linear units in pairs, colwise
    then rowwise (the Tanh between acts on each rank's columns; the rowwise all-reduce makes the output whole), and
    a last unpaired one colwise with its output gathered."""

    def parallelize_stage(self, module, mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from torch.distributed.tensor import Replicate

        linears = [u for u in module.units if isinstance(u, torch.nn.Linear)]
        for a, b in zip(linears[0::2], linears[1::2]):
            parallelize_module(a, mesh, ColwiseParallel())
            parallelize_module(b, mesh, RowwiseParallel())
        if len(linears) % 2:  # a stage of one Linear: its rows split, its output gathered
            parallelize_module(linears[-1], mesh, ColwiseParallel(output_layouts=Replicate()))


class _FirstStepStamp(Callback):
    def __init__(self, path: str) -> None:
        self.path, self.done = path, False

    def on_train_batch_end(self, trainer, *args):
        if not self.done and trainer.global_rank == 0:
            self.done = True
            with open(self.path, "w") as f:
                f.write(json.dumps({"time": time.time(), "global_step": trainer.global_step, "preloaded": PRELOADED,
                                    "threads": torch.get_num_threads()}))


def main(cfg: dict) -> None:
    L.seed_everything(0)
    model = _SplitMLP() if cfg.get("tp_hook") else MLP()
    plan = StagePlan([StageSpec(modules=m) for m in cfg["stages"]])
    # the strategy's own step-<N> checkpoints when ckpt_dir is set; "every" also paces the ModelCheckpoint of mc_dirpath
    ckpt_dir = cfg.get("ckpt_dir")
    checkpoint = CheckpointOptions(
        dir=ckpt_dir, resume=cfg.get("resume"), every_n_steps=cfg.get("every") if ckpt_dir else None,
        keep_last=cfg.get("keep_last"), async_save=cfg.get("async_save", False),
    )
    strategy = HPPStrategy(
        plan=plan, schedule=cfg.get("schedule", "1f1b"), n_microbatches=cfg.get("n_micro", 4), pp_degree=cfg.get("pp"),
        checkpoint=checkpoint, timeout=cfg.get("timeout", 60), **cfg.get("strategy", {}),
    )
    losses = _Losses()
    callbacks = [losses]
    if "kill_at" in cfg:
        callbacks.append(_KillAt(cfg["kill_at"], cfg.get("kill_rank", 1), os.path.join(cfg["out"], "killed_at")))
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        callbacks.append(_FirstStepStamp(os.path.join(cfg["out"],
                                                      "first_step_after_restart" if restarted else "first_step")))
    if cfg.get("mc_dirpath"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=cfg["mc_dirpath"], save_last=True, every_n_train_steps=cfg["every"],
                                         save_top_k=1))
    trainer = quiet_trainer(devices=cfg.get("devices", 2), num_nodes=1, strategy=strategy, max_steps=cfg["steps"],
                            enable_checkpointing=bool(cfg.get("ckpt_dir") or cfg.get("mc_dirpath")),
                            num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
                            default_root_dir=cfg["out"])
    train, val = loaders(cfg.get("batch", 16))
    trainer.fit(model, train, val, ckpt_path=cfg.get("ckpt_path"))
    from lightning_hpp.checkpoint.lightning_state import optimizer_to_named, param_names

    optim, groups = optimizer_to_named(trainer.optimizers[0], param_names(model))
    out = {
        "state": {k: _whole(v).detach().clone() for k, v in model.state_dict().items()},
        "optim": {n: {k: _whole(v) for k, v in s.items()} for n, s in optim.items()},
        "losses": losses.losses,
        "groups": groups,
        "global_step": trainer.global_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "resumed_from": strategy.resumed_from,
    }
    os.makedirs(cfg["out"], exist_ok=True)
    torch.save(out, os.path.join(cfg["out"], f"{cfg['tag']}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    for cfg in spec.get("runs", [spec]):
        main(cfg)
