"""Starting and ending the processes of a pipeline job, the way Lightning starts DDP.

* :class:`Launcher`: Lightning's subprocess launcher, with one hook that rewrites ``Trainer.fit``'s
  ``ckpt_path`` on every rank before the run starts (``resume="auto"``, ``"last"`` on ``s3://``);
* :func:`init_process_group`: Lightning's connection set-up, plus the store prefix that restarts
  under torchrun's c10d rendezvous need;
* :func:`shutdown`: at interpreter exit, finish a background checkpoint upload, then close the
  process groups.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_hpp.checkpoint.sharded import wait_for_pending_save


class Launcher(_SubprocessScriptLauncher):
    """Lightning's launcher; ``resolve_fit_ckpt(trainer, ckpt_path)`` runs on every rank first."""

    def __init__(self, resolve_fit_ckpt: Callable[[Any, Any], Any], *args: Any) -> None:
        super().__init__(*args)
        self._resolve_fit_ckpt = resolve_fit_ckpt

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Trainer.fit calls launch(_fit_impl, model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)
        if trainer is not None and getattr(function, "__name__", "") == "_fit_impl" and len(args) >= 5:
            args = (*args[:4], self._resolve_fit_ckpt(trainer, args[4]), *args[5:])
        return super().launch(function, *args, trainer=trainer, **kwargs)


def init_process_group(cluster_environment: Any, backend: str, timeout: timedelta, device: torch.device, world_size: int) -> None:
    """Create the default process group (collective) and close it again at interpreter exit."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not dist.is_initialized():
        # torchrun's c10d rendezvous keeps one store across restarts; without a prefix per attempt
        # the restarted ranks read the dead ranks' gloo addresses and fail to connect.
        store = dist.TCPStore(cluster_environment.main_address, cluster_environment.main_port,
                              world_size, is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        kwargs["store"] = dist.PrefixStore(f"/lightning_hpp/attempt_{attempt}", store)
    _init_dist_connection(cluster_environment, backend, **kwargs)
    atexit.register(shutdown)


def shutdown() -> None:
    """Finish a background checkpoint upload, then close the process groups.

    Process groups left to static destructors can abort the interpreter at exit ("terminate called
    without an active exception") while gloo's threads are still joinable.
    """
    wait_for_pending_save()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
