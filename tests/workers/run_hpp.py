"""Train tests.models.MLP under HPPStrategy for one or more configurations in one launch.

Every rank saves, per configuration, what it holds to OUT/<name>/rank{r}.pt.
Usage: python -m tests.workers.run_hpp '<json: {"devices": N, "runs": [config, ...]}>'
"""

import json
import os
import sys

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_hpp import HPPPrecision, HPPStrategy, StagePlan, StageSpec
from tests.models import MLP, loaders


def run(cfg: dict, devices: int) -> None:
    L.seed_everything(0)
    model = MLP(depth=cfg.get("depth", 4))
    precisions = cfg.get("precisions") or [None] * len(cfg.get("stages") or [])
    clip_norms = cfg.get("clip_norms") or [None] * len(cfg.get("stages") or [])
    plan = StagePlan([StageSpec(modules=m, precision=p, clip_norm=c, device=d) for m, p, c, d in zip(cfg["stages"], precisions, clip_norms, cfg.get("devices_kinds") or [None] * len(cfg["stages"]))]) if cfg.get("stages") else "auto"
    # cfg["strategy"]: HPPStrategy keyword arguments (option sections as dicts, e.g. {"placement": {...}});
    # cfg["precision"]: HPPPrecision keyword arguments, handed to the strategy (or, with "init_scale",
    # to the Trainer as a plugin)
    precision = cfg.get("precision") or {}
    plugins = []
    if "init_scale" in cfg:  # the plugin given to the Trainer is the one the strategy uses
        plugins.append(HPPPrecision(init_scale=cfg["init_scale"], **precision))
    strategy = HPPStrategy(
        plan=plan, schedule=cfg.get("schedule"), n_microbatches=cfg.get("n_micro"), pp_degree=cfg.get("pp"), timeout=cfg.get("timeout", 60),
        precision_plugin=HPPPrecision(**precision) if precision and not plugins else None,
        **cfg.get("strategy", {}),
    )
    callbacks = []
    if cfg.get("bias_monitor"):  # it asks the strategy for the local gradient norms (step_stats)
        from lightning_hpp.bias.monitor import BiasMonitor

        callbacks.append(BiasMonitor())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        callbacks=callbacks,
        num_nodes=cfg.get("num_nodes", 1),
        strategy=strategy,
        plugins=plugins,
        max_steps=cfg["steps"],
        accumulate_grad_batches=cfg.get("accumulate", 1),
        gradient_clip_val=cfg.get("gradient_clip_val"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=cfg.get("limit_val_batches", 0),
        default_root_dir=cfg["out"],
    )
    train, val = loaders(cfg["batch"])
    trainer.fit(model, train, val)
    state, sharded = {}, []
    for k, v in model.state_dict().items():
        if "layers" in k:
            if isinstance(v, DTensor):  # an FSDP2 shard: gathered over the stage's replicas (they hold the same names)
                sharded.append(k)
                v = v.full_tensor()
            state[k] = v.detach().clone()
    out = {
        "state": state,
        "sharded": sharded,
        "sharded_stages": strategy._pipeline.runner.sharded is not None,
        # what the training schedules' stages still hold of the last step's outputs (the loss is taken per micro-batch)
        "held_outputs": sum(len(stage.output_chunks) for sched in strategy._pipeline.runner._schedules.values()
                            if sched._has_backward
                            for stage in (sched._stages if hasattr(sched, "_stages") else [sched._stage])),
        "exchange_posted": strategy._pipeline.runner.exchange_posted,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "stage_ids": strategy.stage_ids,
        "skipped_steps": getattr(strategy.precision_plugin, "skipped_steps", None),
        "loss_scale": getattr(strategy.precision_plugin, "loss_scale", None),
        "plan_meta": strategy.plan.meta,
        "plan": strategy.plan.to_dict(),
        "step_stats": dict(strategy.step_stats),
        "grid": strategy.mesh.grid,
        "telemetry_steps": [h.step for cb in trainer.callbacks if type(cb).__name__ == "PipelineTelemetry" for h in cb.history],
    }
    if cfg.get("validate"):
        out["validate"] = trainer.validate(model, val, verbose=False)
    if cfg.get("predict"):
        out["predict"] = torch.cat(trainer.predict(model, val))
    os.makedirs(cfg["out"], exist_ok=True)
    torch.save(out, os.path.join(cfg["out"], f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    for cfg in spec["runs"]:
        cfg.setdefault("num_nodes", spec.get("num_nodes", 1))
        run(cfg, spec["devices"])
