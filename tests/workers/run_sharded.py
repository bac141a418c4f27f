"""Train a real model (tests.harness.zoo.real) under HPPStrategy with sharded stages, for several configurations in one
launch, and save what each rank holds, shards gathered.

Every rank saves, per configuration, to OUT/<name>/rank{r}.pt: ``state`` (its stages' parameters, each FSDP2
shard gathered with ``DTensor.full_tensor``), ``local`` (per parameter: the numel of its local shard, of its
gradient's local shard at the last optimizer step and of its optimizer state's local shards, and its full numel),
the loss of every step, the plan, the stages it holds and its place in the mesh (``position``, ``replica``,
``dp_shard``, ``dp_replicate``).
Usage: python -m tests.workers.run_sharded '<json: {"devices": N, "runs": [config, ...]}>'

Config keys as :mod:`tests.workers.run_real` (``model``, ``points``, ``precision``, ``schedule``, ``n_micro``,
``pp``, ``steps``, ``batch``, ``n``, ``out``, ``model_kw``, ``strategy``, ``gradient_clip_val``), ``clip`` and
``init_scale`` (``HPPPrecision(clip=..., init_scale=...)``), ``fp8_backend``, ``points`` (or ``"auto"``), ``wrapper``
(:data:`WRAPPERS`), ``limit_val_batches`` and ``val_check_interval``,
``bias_monitor`` (``true``: a ``BiasMonitor`` among the callbacks) and ``checkpointing`` (``true``: Lightning's
``ModelCheckpoint``). The FSDP2 all-gathers and reduce-scatters of every step are counted (``collectives``). A
config with ``"refused": true`` records each rank's error (:mod:`tests.workers.refusals`) and the job goes on.
"""

import json
import os
import sys

import lightning as L
import torch

from lightning_hpp import BiasMonitor, HPPPrecision, HPPStrategy, StagePlan
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo.real import LMWrapper, loader
from tests.workers.run_real import StepLosses


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local_numel(t) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


class Collectives(L.Callback):
    """FSDP2's all-gathers and reduce-scatters (``all_gather_single`` / ``reduce_scatter_single``) in each step, and
    the local numel of every gradient at the last optimizer step."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.counts = {"all_gather_single": 0, "reduce_scatter_single": 0}
        self.per_step: list[dict[str, int]] = []
        self.grads: dict[str, int | None] = {}
        self._seen = dict(self.counts)
        for name in self.counts:
            real = getattr(dist, name)

            def counting(*args, _real=real, _name=name, **kwargs):
                self.counts[_name] += 1
                return _real(*args, **kwargs)

            setattr(dist, name, counting)

    def on_train_batch_end(self, *args):
        self.per_step.append({k: v - self._seen[k] for k, v in self.counts.items()})
        self._seen = dict(self.counts)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # the gradients as the optimizer sees them (Lightning drops them before each validation)
        self.grads = {n: None if p.grad is None else _local_numel(p.grad) for n, p in pl_module.named_parameters()}


WRAPPERS = {"decorated": "DecoratedMLP", "per_half_clipped": "PerHalfClipped"}
"""``wrapper``: a LightningModule of tests.harness.zoo.real other than ``LMWrapper``."""


def run(cfg: dict, devices: int) -> None:
    import tests.harness.zoo.real as real_models

    L.seed_everything(0)
    if cfg.get("wrapper"):
        model = getattr(real_models, WRAPPERS[cfg["wrapper"]])(**cfg.get("model_kw", {}))
    else:
        model = LMWrapper(cfg["model"], **cfg.get("model_kw", {}))
    train = loader(cfg["model"], cfg["batch"], n=cfg.get("n", 32))
    fields = {"precision": cfg["precision"]} if cfg.get("precision") else {}
    points = cfg.get("points")
    plan = "auto" if points == "auto" else StagePlan.split_at(points, **fields) if points else None
    strategy = HPPStrategy(plan=plan, schedule=cfg["schedule"], n_microbatches=cfg["n_micro"], pp_degree=cfg.get("pp"),
                           timeout=120, **cfg.get("strategy", {}))
    losses, collectives = StepLosses(), Collectives()
    extra = [BiasMonitor()] if cfg.get("bias_monitor") else []
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_steps=cfg["steps"],
                            plugins=[HPPPrecision(clip=cfg.get("clip", "global"),
                                                  init_scale=cfg.get("init_scale", 2.0**16),
                                                  **({"fp8_backend": cfg["fp8_backend"]} if cfg.get("fp8_backend")
                                                     else {}))],
                            callbacks=[losses, collectives, *extra],
                            enable_checkpointing=bool(cfg.get("checkpointing")), num_sanity_val_steps=0,
                            limit_val_batches=cfg.get("limit_val_batches", 0),
                            val_check_interval=cfg.get("val_check_interval"), default_root_dir=cfg["out"],
                            gradient_clip_val=cfg.get("gradient_clip_val"))
    try:
        val = loader(cfg["model"], cfg["batch"], n=8) if cfg.get("limit_val_batches") else None
        trainer.fit(model, train, val)
    except BaseException as exc:
        os.makedirs(cfg["out"], exist_ok=True)
        with open(os.path.join(cfg["out"], f"rank{trainer.global_rank}_error.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise
    opt = trainer.optimizers[0]
    local = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        local[name] = {"param": _local_numel(p), "full": p.numel(), "dtensor": hasattr(p, "to_local"),
                       "grad": collectives.grads.get(name),
                       "optim": sum(_local_numel(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim())}
    mesh = strategy.mesh
    sharded = strategy.runner.sharded
    groups = 0 if sharded is None else sum(m._get_fsdp_state()._fsdp_param_group is not None for m in sharded.modules)
    out = {
        "collectives": collectives.per_step, "fsdp_groups": groups,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "skipped_steps": trainer.precision_plugin.skipped_steps, "loss_scale": trainer.precision_plugin.scaler.scale,
        # collective: every rank of a stage's shard group gathers its parameters in the same (state_dict) order
        "state": {k: _full(v).detach().clone() for k, v in model.state_dict().items()},
        "local": local,
        "losses": losses.losses,
        "stage_ids": strategy.stage_ids,
        "plan": strategy.plan.to_dict(),
        "position": mesh.position, "replica": mesh.replica, "dp_shard": mesh.dp_shard,
        "dp_replicate": mesh.dp_replicate,
        "tp": mesh.tp, "tp_rank": mesh.tp_rank,
        "split": {n: (p.to_local().numel(), p.numel(), [str(x) for x in p.placements],
                      list(p.device_mesh.mesh_dim_names))
                  for n, p in model.named_parameters() if hasattr(p, "to_local")},
        "schedule": strategy.schedule if hasattr(strategy, "schedule") else None,
        "device_mesh_dims": list(model.device_mesh.mesh_dim_names),
        "device_mesh_shape": list(model.device_mesh.mesh.shape),
    }
    os.makedirs(cfg["out"], exist_ok=True)
    torch.save(out, os.path.join(cfg["out"], f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    import functools

    from tests.workers.refusals import exit_status, try_case

    spec = json.loads(sys.argv[1])
    records = []
    for cfg in spec["runs"]:
        if cfg.get("refused"):
            records.append(try_case(cfg["out"], spec["devices"], functools.partial(run, cfg, spec["devices"])))
        else:
            run(cfg, spec["devices"])
    sys.exit(exit_status(records))
