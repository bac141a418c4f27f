"""Two groups of a strategy's Lightning hooks over a :class:`~lightning_hpp.assembly.build.Pipeline`, mixed into
``HPPStrategy`` (before Lightning's ``ParallelStrategy``), which keeps the wiring of the rest:

* :class:`ReplicaCollectives`: ``barrier``, ``broadcast``, ``reduce``, ``all_gather`` and
  ``reduce_boolean_decision`` as DDP means them on the pipeline's grid (:mod:`lightning_hpp.pipeline.collectives`);
* :class:`ShardedCheckpointHooks`: Lightning's checkpoint hooks on sharded checkpoints (every rank saves and loads
  its own part; :class:`~lightning_hpp.checkpoint.session.CheckpointSession` does the work).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import group as _group
from torch import Tensor

from lightning_hpp import _dist
from lightning_hpp.assembly.build import Pipeline
from lightning_hpp.bias.controls import BiasControls
from lightning_hpp.checkpoint.session import CheckpointSession
from lightning_hpp.pipeline.collectives import decide_together, gather_over_replicas, reduce_over_replicas
from lightning_hpp.pipeline.steps import REDUCED
from lightning_hpp.precision.fp8_slots import fp8_slots
from lightning_hpp.precision.plugin import HPPPrecision


class ReplicaCollectives:
    """Lightning's collectives over ``_pipeline``'s grid: values span the data-parallel replicas, decisions the job."""

    _pipeline: Pipeline | None
    root_device: Any
    world_size: int

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _dist.initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return _dist.broadcast_object(obj, src, group=_group.WORLD)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or group is REDUCED:  # REDUCED: a replayed value, equal on every replica
            return tensor
        return reduce_over_replicas(tensor, self._pipeline.mesh if self._pipeline else None, group, reduce_op)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return gather_over_replicas(tensor, self._pipeline.mesh if self._pipeline else None, group, sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decide_together(decision, all, self.root_device, self.world_size)


class ShardedCheckpointHooks:
    """Lightning's checkpoint hooks on sharded checkpoints: one directory, every rank writing and reading its part,
    whatever layout saved it."""

    _pipeline: Pipeline | None
    _session: CheckpointSession
    _controls: BiasControls
    lightning_module: Any
    optimizers: list
    precision_plugin: Any
    global_rank: int
    is_global_zero: bool

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model must be cut and the optimizers built before a checkpoint knows what to load

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.lightning_module.state_dict()  # this rank's stages only: every rank writes its own part

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write one sharded checkpoint directory at ``filepath`` (collective: every rank calls it)."""
        p = self._pipeline
        extra = self._session.metadata(
            plan=p.plan.to_dict(),
            metrics=dict(self.lightning_module.trainer.callback_metrics),
            hyper_parameters=checkpoint.get("hyper_parameters"),
            fingerprint=self._controls.checkpoint_metadata(),
        )
        self._session.save(
            checkpoint,
            filepath,
            self.lightning_module,
            self.optimizers,
            global_rank=self.global_rank,
            position=p.mesh.position,
            replica=p.mesh.replica,
            extra=extra,
            storage_options=storage_options,
            fp8=self._fp8_slots(),
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        self._session.remove(
            filepath, is_global_zero=self.is_global_zero, resuming=self.lightning_module.trainer.ckpt_path is not None
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load this rank's part of a sharded checkpoint, whatever layout saved it (collective)."""
        fitting = self.lightning_module.trainer.state.fn == "fit"
        return self._session.load(checkpoint_path, self._load_sharded, fitting=fitting)

    def _load_sharded(self, url: str) -> dict[str, Any]:
        mesh = self._pipeline.mesh if self._pipeline else None
        return self._session.load_shards(
            url,
            self.lightning_module,
            self.optimizers,
            global_rank=self.global_rank,
            position=mesh.position if mesh else 0,
            replica=mesh.replica if mesh else 0,
            fp8=self._fp8_slots(),
        )

    def _fp8_slots(self) -> dict[str, Any]:
        """This rank's fp8 scaling state, which checkpoints save and restore as data."""
        p = self.precision_plugin
        return fp8_slots(self.lightning_module, p.fp8_recipe, p.fp8_emulations) if isinstance(p, HPPPrecision) else {}

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
