"""Train tests.harness.zoo.MLP under HPPStrategy for one or more configurations in one launch.

Every rank saves, per configuration, what it holds to OUT/<name>/rank{r}.pt.
Usage: python -m tests.workers.run_hpp '<tests.harness.runs.Runs of HppRun, as JSON>'
"""

import os
import sys

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_hpp import HPPPrecision, HPPStrategy, StagePlan, StageSpec
from tests.harness.runs import HppRun, Runs
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders


def run(cfg: HppRun, devices: int) -> None:
    L.seed_everything(0)
    model = MLP(depth=cfg.depth)
    n = len(cfg.stages or [])
    specs = zip(cfg.stages or [], cfg.precisions or [None] * n, cfg.clip_norms or [None] * n,
                cfg.devices_kinds or [None] * n)
    plan = StagePlan([StageSpec(modules=m, precision=p, clip_norm=c, device=d) for m, p, c, d in specs]) \
        if cfg.stages else "auto"
    # cfg.strategy: HPPStrategy keyword arguments (option sections as dicts, e.g. {"placement": {...}});
    # cfg.precision: HPPPrecision keyword arguments, handed to the strategy (or, with init_scale,
    # to the Trainer as a plugin)
    precision = cfg.precision or {}
    plugins = []
    if cfg.init_scale is not None:  # the plugin given to the Trainer is the one the strategy uses
        plugins.append(HPPPrecision(init_scale=cfg.init_scale, **precision))
    strategy = HPPStrategy(
        plan=plan, schedule=cfg.schedule, n_microbatches=cfg.n_micro, pp_degree=cfg.pp, timeout=cfg.timeout,
        precision_plugin=HPPPrecision(**precision) if precision and not plugins else None,
        **cfg.strategy,
    )
    callbacks = []
    if cfg.bias_monitor:  # it asks the strategy for the local gradient norms (step_stats)
        from lightning_hpp.bias.monitor import BiasMonitor

        callbacks.append(BiasMonitor())
    trainer = quiet_trainer(
        devices=devices,
        callbacks=callbacks,
        num_nodes=cfg.num_nodes,
        strategy=strategy,
        plugins=plugins,
        max_steps=cfg.steps,
        accumulate_grad_batches=cfg.accumulate,
        gradient_clip_val=cfg.gradient_clip_val,
        num_sanity_val_steps=0,
        limit_val_batches=cfg.limit_val_batches,
        default_root_dir=cfg.out,
    )
    train, val = loaders(cfg.batch)
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
        "telemetry_steps": [h.step for cb in trainer.callbacks if type(cb).__name__ == "PipelineTelemetry"
                            for h in cb.history],
    }
    if cfg.validate:
        out["validate"] = trainer.validate(model, val, verbose=False)
    if cfg.predict:
        out["predict"] = torch.cat(trainer.predict(model, val))
    os.makedirs(cfg.out, exist_ok=True)
    torch.save(out, os.path.join(cfg.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    spec = Runs.from_json(sys.argv[1])
    for cfg in spec.runs:
        run(cfg, spec.devices)
