"""One Trainer's checkpoints under the pipeline strategy: :class:`CheckpointSession`.

It takes :class:`~lightning_hpp.options.CheckpointOptions` whole and holds what lives between
Lightning's checkpoint hooks: the fit request decided before any process group exists, the
checkpoint chosen and loaded at the end of setup, the run id, the checkpoint the run resumed from
(never deleted), the RNG state and the mid-epoch position to restore, and the metadata written
beside every save. The strategy forwards Lightning's hooks to it; nothing here reads the Trainer
beyond what a hook hands in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_hpp.checkpoint import resume as _resume
from lightning_hpp.checkpoint.commit import delete_checkpoint, read_metadata
from lightning_hpp.checkpoint.discovery import scan
from lightning_hpp.checkpoint.fp8_state import FP8Slot
from lightning_hpp.checkpoint.lightning_state import load_lightning_checkpoint, save_lightning_checkpoint, set_rng_state
from lightning_hpp.checkpoint.save import wait_for_pending_save
from lightning_hpp.checkpoint.storage import route_storage
from lightning_hpp.errors import CheckpointError

if TYPE_CHECKING:
    from lightning_hpp.options import CheckpointOptions


class CheckpointSession:
    """Where a fit starts from, what a resumed run restores, and what each save writes.

    Args:
        options: The strategy's ``CheckpointOptions``.
    """

    def __init__(self, options: CheckpointOptions) -> None:
        self.options = options
        self._fit_request: Any = None
        self._preloaded: _resume.Chosen | None = None
        self._run_id: str | None = None
        self._resumed_from: str | None = None
        self._pending_rng: dict | None = None
        self._resume_batches = 0
        self._resume_epoch = 0
        self._unroute: Callable[[], None] | None = None
        self.notes: dict[str, Any] = {}
        """JSON entries every later save's ``metadata.json`` carries under ``extra`` (the straggler watch's speeds)."""

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this run resumed from (never deleted by retention or top-k cleanup)."""
        return self._resumed_from

    @property
    def run_id(self) -> str | None:
        return self._run_id

    # ------------------------------------------------------------------ before and at setup
    def route_storage(self) -> None:
        """From now until :meth:`finish`, every S3 filesystem of this process, Lightning's callbacks' too, retries
        each request as the strategy's own checkpoint I/O does
        (:func:`~lightning_hpp.checkpoint.storage.route_storage`)."""
        if self._unroute is None:
            self._unroute = route_storage()

    def request_fit(self, ckpt_path: Any, callback_dirs: Sequence[str | None]) -> Any:
        """What ``Trainer.fit`` is handed as its ``ckpt_path`` (before any process group exists): ``None``,
        a path, or a :class:`~lightning_hpp.checkpoint.resume.PendingResume` decided at :meth:`begin_fit`."""
        self._fit_request = _resume.resolve_ckpt_path(
            ckpt_path,
            resume=self.options.resume,
            checkpoint_dir=self.options.dir,
            callback_dirs=[d for d in callback_dirs if d],
        )
        return self._fit_request

    def check_setup(self, *, fitting: bool, checkpointing: bool) -> None:
        """Refuse a checkpoint ``dir`` that would never be written to."""
        if self.options.dir is not None and fitting and not checkpointing:
            raise CheckpointError(
                f"`HPPStrategy(checkpoint=CheckpointOptions(dir={self.options.dir!r}))` saves checkpoints, "
                f"but `Trainer(enable_checkpointing=False)` turns checkpointing off. Drop one of the two."
            )

    def step_callback(self, callbacks: Sequence[Any]) -> ModelCheckpoint | None:
        """The callback writing ``step-<N>`` checkpoints into ``dir``, unless one of ``callbacks`` already does."""
        opts = self.options
        if opts.dir is None or any(
            isinstance(cb, ModelCheckpoint) and cb.dirpath and _resume.same_location(cb.dirpath, opts.dir)
            for cb in callbacks
        ):
            return None
        return _resume.step_checkpoint_callback(opts.dir, opts.every_n_steps)

    def recorded_speeds(self) -> dict[int, float] | None:
        """The per-rank device speeds a straggler watch recorded (``extra.watch.speeds``, or the ``rank_speeds`` of the
        plan a re-planned run saved) in the checkpoint this fit is asked to resume from: the newest committed one for
        ``resume="auto"`` / ``"last"`` (the one loaded unless
        it turns out damaged), or the explicit one. ``None`` when there is none (collective: rank 0 reads, all get it).
        """
        request = self._fit_request
        if request is None:
            return None

        def read() -> Any:
            if isinstance(request, _resume.PendingResume):
                found = scan(request.roots, prefer=request.prefer).committed
                meta = found[0].metadata if found else {}
            else:
                try:
                    meta = read_metadata(str(request))
                except (CheckpointError, OSError):  # its load reports what is wrong with it
                    return None
            # a checkpoint written later by the re-planned run carries them in its plan
            return ((meta.get("extra") or {}).get("watch") or {}).get("speeds") or (
                (meta.get("plan") or {}).get("meta") or {}
            ).get("rank_speeds")

        speeds = _resume.on_rank0(read)
        return {int(r): float(v) for r, v in speeds.items()} if speeds else None

    def begin_fit(self, load: Callable[[str], dict[str, Any]]) -> None:
        """At the end of a fit's setup, on every rank (collective): choose and load a pending resume."""
        self._preloaded, self._run_id = _resume.begin_fit(
            self._fit_request, checkpoint_dir=self.options.dir, new_run=self.options.new_run, load=load
        )

    # ------------------------------------------------------------------ loading
    def load(self, checkpoint_path: Any, load: Callable[[str], dict[str, Any]], *, fitting: bool) -> dict[str, Any]:
        """Lightning's ``load_checkpoint``: the checkpoint chosen at :meth:`begin_fit`, or the one at an
        explicit path, verified and loaded (collective); what it restores later is kept here."""
        chosen, self._preloaded = self._preloaded, None
        if chosen is None or not isinstance(checkpoint_path, _resume.PendingResume):  # an explicit path: verified here
            chosen = _resume.select_and_load(str(checkpoint_path), load)
            if fitting:
                self._run_id = _resume.continue_run(
                    chosen, checkpoint_dir=self.options.dir, new_run=self.options.new_run
                )
        checkpoint = chosen.loaded
        self._pending_rng = checkpoint.pop("hpp_rng", None)
        self._resumed_from = chosen.url
        self._resume_batches = _resume.consumed_batches(checkpoint)
        self._resume_epoch = int(checkpoint.get("epoch", 0) or 0)
        return checkpoint

    def take_resume_position(self) -> tuple[int, int]:
        """``(batches, epoch)`` the train loader must skip once (``(0, epoch)`` when none are pending)."""
        batches, self._resume_batches = self._resume_batches, 0
        return batches, self._resume_epoch

    def restore_rng(self) -> None:
        """Put back the RNG state the checkpoint carried (at the start of training, once)."""
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    # ------------------------------------------------------------------ saving
    def metadata(
        self, *, plan: dict[str, Any], metrics: dict[str, Any], hyper_parameters: Any, fingerprint: Any
    ) -> dict[str, Any]:
        """What every checkpoint's ``metadata.json`` carries beside the weights."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        return {
            "plan": plan,
            "metrics": scalars,
            "hyper_parameters": hyper_parameters,
            "run_id": self._run_id,
            "fingerprint": fingerprint,
            **self.notes,
        }

    def save(
        self,
        checkpoint: dict[str, Any],
        filepath: Any,
        module: torch.nn.Module,
        optimizers: list[Any],
        *,
        global_rank: int,
        position: int,
        replica: int,
        extra: dict[str, Any],
        storage_options: Any = None,
        fp8: Mapping[str, FP8Slot] | None = None,
    ) -> None:
        """Write one sharded checkpoint directory at ``filepath`` (collective: every rank calls it); ``fp8``:
        this rank's fp8 scaling state (:func:`~lightning_hpp.precision.fp8_slots.fp8_slots`)."""
        if storage_options is not None:
            raise CheckpointError(
                f"`storage_options={storage_options!r}` is not used by HPPStrategy: S3 settings come from the "
                f"environment (AWS_* variables). Remove it from the `save_checkpoint` call."
            )
        opts = self.options
        # a local `dir` in the form ModelCheckpoint gives its paths (resolved), so that `keep_last` finds its saves
        step_dir = opts.dir if opts.dir is None or "://" in opts.dir else os.path.realpath(os.path.expanduser(opts.dir))
        save_lightning_checkpoint(
            checkpoint,
            str(filepath),
            module,
            optimizers,
            global_rank=global_rank,
            position=position,
            replica=replica,
            extra=extra,
            step_dir=step_dir,
            keep_last=opts.keep_last,
            async_save=opts.async_save,
            on_error=opts.on_error,
            protect=[self._resumed_from] if self._resumed_from else [],
            fp8=fp8,
        )

    def remove(self, filepath: Any, *, is_global_zero: bool, resuming: bool = True) -> None:
        """Lightning's ``remove_checkpoint`` (top-k cleanup): never the checkpoint the fit resumed from (``resuming``:
        the fit was given one). A checkpoint restored otherwise (the tuner's own, around its trial steps) goes."""
        if not is_global_zero:
            return
        # Lightning's tuners restore their own temporary checkpoint (``.lr_find_<id>.ckpt``), then remove it
        tuners = str(filepath).rstrip("/").rsplit("/", 1)[-1].startswith((".lr_find_", ".scale_batch_size_"))
        if (
            resuming
            and not tuners
            and self._resumed_from is not None
            and _resume.same_location(str(filepath), self._resumed_from)
        ):
            rank_zero_info(f"HPPStrategy: keeping {str(filepath)!r}, the checkpoint this run resumed from.")
            return
        wait_for_pending_save()
        delete_checkpoint(str(filepath))

    @staticmethod
    def load_shards(
        url: str,
        module: torch.nn.Module,
        optimizers: list[Any],
        *,
        global_rank: int,
        position: int,
        replica: int = 0,
        fp8: Mapping[str, FP8Slot] | None = None,
    ) -> dict[str, Any]:
        """This rank's part of the sharded checkpoint at ``url`` (collective); the fp8 scaling state of
        ``fp8`` is put back into its layers."""
        return load_lightning_checkpoint(
            url, module, optimizers, global_rank=global_rank, position=position, replica=replica, fp8=fp8
        )

    def finish(self) -> None:
        """Wait for a background save still in flight; put the storage defaults back (teardown)."""
        wait_for_pending_save()
        if self._unroute is not None:
            self._unroute, unroute = None, self._unroute
            unroute()
