"""Live skew metrics: spread of losses and local gradient norms across data-parallel ranks.

:class:`BiasMonitor` is a Lightning callback. It logs through ``pl_module.log`` (so every logger,
the progress bar and checkpoint monitors see the values) and raises a :class:`CodedBiasWarning`
that names the metric, the value and the likely cause when a threshold is crossed.

Per training step:

* ``bias/loss_std`` — standard deviation (population) across data-parallel ranks of the loss;
* ``bias/grad_norm_std/stage_{k}`` — standard deviation across the data-parallel ranks of stage
  ``k`` of the stage's *local* gradient norm, taken before the data-parallel all-reduce.

Per training epoch, from the indices each rank's sampler handed out:

* ``bias/overlap_jaccard`` — pooled Jaccard overlap of the ranks' index sets
  (``sum over rank pairs |A∩B| / sum over rank pairs |A∪B|``): 0 for disjoint shards, 1 when all
  ranks drew the same samples;
* ``bias/overlap_expected`` — the overlap the ranks would show if they drew independently: 0 when
  no rank drew an index twice (sampling without replacement must give disjoint shards), else the
  pooled Jaccard expected for independent draws from the epoch's observed index frequencies
  (with replacement, heavily weighted samples land on every rank by chance);
* ``bias/coverage`` — fraction of the dataset drawn by at least one rank;
* ``bias/sequence_agreement`` — fraction of positions at which two ranks drew the same index
  (first ``max_agreement_positions`` positions): about ``sum(p_i^2)`` for independent streams,
  1 for ranks that draw the identical sequence.

Where the numbers come from:

* Under a strategy that provides them (the pipeline strategy), ``trainer.strategy`` has
  ``dp_group``, ``dp_size``, ``dp_rank`` and ``step_stats`` — a dict updated every training step
  on every rank, ``{"loss": float | None, "local_grad_norms": {stage_id: float}}``.
* Under Lightning's ``DDPStrategy`` the monitor uses the world group, takes the loss from the
  training step's output, and gets the local gradient norm from a DDP communication hook that
  computes it from each gradient bucket before averaging it exactly as DDP's default all-reduce
  does. When the model already has a communication hook, that is not possible: the norm is then
  taken in ``on_before_optimizer_step``, *after* DDP averaged the gradients, so it is equal on
  all ranks and its spread is 0 — the grad-norm metrics then carry no information.
* On a single device the local norm is the norm.

Sample indices are observed by giving the train dataloader's sampler (the one that hands
indices to the loader: ``DistributedSamplerWrapper``, ``DistributedSampler`` or the user's own) a
recording subclass for the duration of ``fit``; its class is restored afterwards.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule

from lightning_hpp._dist import all_gather_object
from lightning_hpp.bias.baseline import SustainedLevel, SustainedShift
from lightning_hpp.bias.fingerprint import CodedBiasWarning
from lightning_hpp.bias.index_overlap import IndexRecorder, epoch_metrics, first_dataloader
from lightning_hpp.bias.index_overlap import index_overlap_metrics  # noqa: F401 - where users import it from
from lightning_hpp.errors import BiasConfigError
from lightning_hpp.pipeline.view import pipeline_view
from lightning_hpp.validation import check_int, check_number

_LIKELY_DATA = (
    "Likely cause: the ranks draw systematically different or identical data — a sampler without a "
    "rank-aware generator (use_distributed_sampler=False), or a per-rank generator inside a sampler "
    "Lightning wraps. Run `audit_dataloader` on the train dataloader, or use `DistributedWeightedSampler`."
)


class BiasMonitor(Callback):
    """Log and alarm on skew between data-parallel ranks.

    The step alarms ignore the first ``warmup_steps`` measured steps and judge the median of the last
    ``sustain_steps`` values, so a single noisy step never alarms (:mod:`lightning_hpp.bias.baseline`).

    Args:
        grad_norm_std_threshold: Alarm when a stage's ``bias/grad_norm_std`` stays above this (its
            median over the last ``sustain_steps`` steps; the field report saw 0.32 with the bug and
            < 0.05 without). ``None`` disables.
        loss_std_jump: Alarm when the median of ``bias/loss_std`` over the last ``sustain_steps``
            measured steps exceeds this factor times its baseline, the rolling median of the
            ``baseline_steps`` steps before them, and that baseline by ``mad_factor`` robust standard
            deviations (the field report saw 0.042 → 0.189). ``None`` disables.
        baseline_steps: Steps in the rolling loss-spread baseline (judged from 5 on). With two
            replicas the spread is one absolute difference, half-normal noise: a long baseline keeps
            its median steady.
        warmup_steps: Measured steps at the start of the fit that the step alarms ignore.
        sustain_steps: Steps whose median must cross a threshold.
        mad_factor: How many robust standard deviations (1.4826 × MAD) of the baseline a loss-spread
            shift must exceed as well.
        overlap_excess_threshold: Alarm when ``bias/overlap_jaccard`` exceeds
            ``bias/overlap_expected`` by more than this. ``None`` disables.
        agreement_threshold: Alarm when ``bias/sequence_agreement`` exceeds this. ``None`` disables.
        min_coverage: Alarm when ``bias/coverage`` falls below this. ``None`` (default) disables:
            sampling with replacement covers less than the whole dataset by design.
        log_every_n_steps: Measure every n-th optimizer step (each measurement is one collective).
        max_agreement_positions: Positions per rank compared for ``bias/sequence_agreement``.

    Attributes:
        history: Every measured step and epoch as a dict (``{"step": ..., "bias/loss_std": ...}``),
            on every rank.
        alarms: The alarm messages raised so far, on every rank (warnings are emitted on global
            rank 0 only, at most once per metric and epoch).

    Raises:
        BiasConfigError: a threshold or count that cannot work.
    """

    def __init__(
        self,
        grad_norm_std_threshold: float | None = 0.15,
        loss_std_jump: float | None = 3.0,
        baseline_steps: int = 20,
        warmup_steps: int = 10,
        sustain_steps: int = 5,
        mad_factor: float = 5.0,
        overlap_excess_threshold: float | None = 0.15,
        agreement_threshold: float | None = 0.5,
        min_coverage: float | None = None,
        log_every_n_steps: int = 1,
        max_agreement_positions: int = 1024,
    ) -> None:
        for label, value, low in (("grad_norm_std_threshold", grad_norm_std_threshold, 0.0),
                                  ("loss_std_jump", loss_std_jump, 1.0),
                                  ("overlap_excess_threshold", overlap_excess_threshold, 0.0),
                                  ("agreement_threshold", agreement_threshold, 0.0),
                                  ("min_coverage", min_coverage, 0.0),
                                  ("mad_factor", mad_factor, 0.0)):
            check_number(
                value,
                f"BiasMonitor({label}=...)",
                minimum=low,
                strict=False,
                optional=True,
                error=BiasConfigError,
                hint="None disables it.",
            )
        for label, value in (
            ("baseline_steps", baseline_steps),
            ("log_every_n_steps", log_every_n_steps),
            ("max_agreement_positions", max_agreement_positions),
            ("sustain_steps", sustain_steps),
        ):
            check_int(value, f"BiasMonitor({label}=...)", error=BiasConfigError)
        check_int(warmup_steps, "BiasMonitor(warmup_steps=...)", minimum=0, error=BiasConfigError)
        self.grad_norm_std_threshold = grad_norm_std_threshold
        self.loss_std_jump = loss_std_jump
        self.baseline_steps = baseline_steps
        self.warmup_steps = warmup_steps
        self.sustain_steps = sustain_steps
        self.mad_factor = mad_factor
        self.overlap_excess_threshold = overlap_excess_threshold
        self.agreement_threshold = agreement_threshold
        self.min_coverage = min_coverage
        self.log_every_n_steps = log_every_n_steps
        self.max_agreement_positions = max_agreement_positions
        self.history: list[dict[str, Any]] = []
        self.alarms: list[str] = []
        self._loss_shift = self._new_loss_rule()
        self._norm_levels: dict[str, SustainedLevel] = {}
        self._alarmed: set[tuple[str, int]] = set()
        self._hook_state: _LocalNormState | None = None
        self._norm_source = "local"
        self._local_norm: float | None = None
        self._stepped = False
        self._steps_seen = 0
        self._recorder = IndexRecorder()

    # ------------------------------------------------------------------ topology
    @staticmethod
    def _dp(trainer: Any) -> tuple[Any, int, int]:
        view = pipeline_view(trainer)
        if view is None:
            return None, trainer.world_size, trainer.global_rank
        return view.dp_group, int(view.dp_size), int(view.dp_rank)

    @staticmethod
    def _step_stats(trainer: Any) -> Mapping[str, Any] | None:
        view = pipeline_view(trainer)
        return view.step_stats if view is not None else None

    @property
    def norm_source(self) -> str:
        """Where the local gradient norm comes from: ``"step_stats"``, ``"ddp_comm_hook"``,
        ``"after_reduce"`` (DDP with a foreign hook: no information) or ``"local"`` (one device)."""
        return self._norm_source

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Any, pl_module: LightningModule) -> None:
        self._loss_shift = self._new_loss_rule()
        self._norm_levels.clear()
        self._alarmed.clear()
        if pipeline_view(trainer) is not None:
            self._norm_source = "step_stats"
            return
        model = getattr(trainer.strategy, "model", None)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            state = _LocalNormState(model.process_group)
            try:
                model.register_comm_hook(state, _recording_allreduce)
            except RuntimeError:
                self._norm_source = "after_reduce"
                if trainer.is_global_zero:
                    warnings.warn(
                        "BiasMonitor: the DDP model already has a communication hook, so local gradient norms "
                        "cannot be read before the all-reduce; bias/grad_norm_std will be 0 and carries no "
                        "information.",
                        CodedBiasWarning,
                        stacklevel=2,
                    )
            else:
                self._hook_state = state
                self._norm_source = "ddp_comm_hook"
        else:
            self._norm_source = "local"

    def on_train_epoch_start(self, trainer: Any, pl_module: LightningModule) -> None:
        loader = first_dataloader(trainer.train_dataloader)
        self._recorder.attach(loader)

    def on_before_optimizer_step(self, trainer: Any, pl_module: LightningModule, optimizer: Any) -> None:
        self._stepped = True
        if self._norm_source == "ddp_comm_hook":
            state = self._hook_state
            self._local_norm = None if state.sq is None else float(state.sq) ** 0.5
            state.sq = None
        elif self._norm_source in ("local", "after_reduce"):
            grads = [p.grad.detach().float().norm() for p in pl_module.parameters() if p.grad is not None]
            self._local_norm = float(torch.linalg.vector_norm(torch.stack(grads))) if grads else None

    def on_train_batch_end(
        self, trainer: Any, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = self._step_stats(trainer)
        if stats is None and not self._stepped:
            return  # accumulating: measure once per optimizer step
        self._stepped = False
        self._steps_seen += 1
        if (self._steps_seen - 1) % self.log_every_n_steps:
            return
        _, _, dp_rank = self._dp(trainer)
        if stats is not None:
            loss = stats.get("loss")
            norms = {int(k): float(v) for k, v in (stats.get("local_grad_norms") or {}).items() if v is not None}
        else:
            loss = _loss_value(outputs, trainer.accumulate_grad_batches)
            norms = {} if self._local_norm is None else {0: self._local_norm}
        mine = {"dp_rank": dp_rank, "loss": None if loss is None else float(loss), "norms": norms}
        gathered = all_gather_object(mine, group=None)
        metrics = _step_metrics(gathered)
        step = trainer.global_step
        self.history.append({"step": step, "epoch": trainer.current_epoch, **metrics})
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)
        self.check_step_metrics(metrics, trainer.global_step, trainer.current_epoch, warn=trainer.is_global_zero)

    def on_train_epoch_end(self, trainer: Any, pl_module: LightningModule) -> None:
        group, _, _ = self._dp(trainer)
        metrics = epoch_metrics(self._recorder, group, self.max_agreement_positions)
        self._recorder.clear()
        if metrics is None:
            return
        self.history.append({"step": trainer.global_step, "epoch": trainer.current_epoch, **metrics})
        for name, value in metrics.items():
            # Equal on the ranks of a data-parallel group already; the mean over the world also covers a
            # pipeline (one group per stage) and keeps Lightning from asking for sync_dist.
            pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=True, batch_size=1)
        self.check_epoch_metrics(metrics, trainer.current_epoch, warn=trainer.is_global_zero)

    def teardown(self, trainer: Any, pl_module: LightningModule, stage: str) -> None:
        self._recorder.detach()

    # ------------------------------------------------------------------ alarms
    def check_step_metrics(self, metrics: Mapping[str, float], step: int, epoch: int, warn: bool = True) -> list[str]:
        """Judge one step's metrics against the thresholds (the hooks call this every measured step).

        Args:
            metrics: ``bias/loss_std`` and ``bias/grad_norm_std/stage_{k}`` values.
            step: The global step, for the message.
            epoch: The epoch; each metric alarms at most once per epoch.
            warn: Emit a :class:`CodedBiasWarning` (the hooks warn on global rank 0 only).

        Returns:
            The alarm messages raised by this call.
        """
        raised: list[str] = []
        thr = self.grad_norm_std_threshold
        k = self.sustain_steps
        for name, value in metrics.items():
            if thr is None or not name.startswith("bias/grad_norm_std/"):
                continue
            level = self._norm_levels.setdefault(name, SustainedLevel(thr, k, self.warmup_steps))
            median = level.update(value)
            if median is not None:
                stage = name.rsplit("_", 1)[-1]
                raised += self._alarm(
                    name,
                    epoch,
                    warn,
                    (
                        f"{name} = {value:.4g} exceeds {thr} (median {median:.4g} over the last {k} steps): the "
                        f"data-parallel ranks of stage {stage} compute gradients of very different size at step "
                        f"{step}. "
                        f"{_LIKELY_DATA}"
                    ),
                )
        std = metrics.get("bias/loss_std")
        if std is None or self.loss_std_jump is None:
            return raised
        shift = self._loss_shift.update(std)
        if shift is not None:
            raised += self._alarm(
                "bias/loss_std",
                epoch,
                warn,
                (
                    f"bias/loss_std = {std:.4g}: its median over the last {k} steps, {shift.recent:.4g}, is "
                    f"{shift.factor:.1f}x the baseline {shift.base:.4g} (rolling median of up to {self.baseline_steps} "
                    f"steps before, MAD {shift.mad:.2g}), above the jump factor {self.loss_std_jump}: the ranks' "
                    "losses "
                    f"diverged by step {step}. {_LIKELY_DATA}"
                ),
            )
        return raised

    def _new_loss_rule(self) -> SustainedShift | None:
        if self.loss_std_jump is None:
            return None
        return SustainedShift(
            self.loss_std_jump, self.baseline_steps, self.sustain_steps, self.warmup_steps, self.mad_factor
        )

    def check_epoch_metrics(self, metrics: Mapping[str, float], epoch: int, warn: bool = True) -> list[str]:
        """Judge one epoch's sample metrics against the thresholds.

        Args:
            metrics: As :func:`index_overlap_metrics` returns them.
            epoch: The epoch, for the message; each metric alarms at most once per epoch.
            warn: Emit a :class:`CodedBiasWarning`.

        Returns:
            The alarm messages raised by this call.
        """
        raised: list[str] = []
        j, e = metrics["bias/overlap_jaccard"], metrics["bias/overlap_expected"]
        c, a = metrics["bias/coverage"], metrics.get("bias/sequence_agreement")
        if self.overlap_excess_threshold is not None and j - e > self.overlap_excess_threshold:
            raised += self._alarm(
                "bias/overlap_jaccard",
                epoch,
                warn,
                (
                    f"bias/overlap_jaccard = {j:.3f} exceeds the {e:.3f} expected for independent draws by more "
                    f"than {self.overlap_excess_threshold}: in epoch {epoch} the data-parallel ranks drew largely "
                    f"the same samples (coverage {c:.3f}). {_LIKELY_DATA}"
                ),
            )
        if self.agreement_threshold is not None and a is not None and a > self.agreement_threshold:
            raised += self._alarm(
                "bias/sequence_agreement",
                epoch,
                warn,
                (
                    f"bias/sequence_agreement = {a:.3f} exceeds {self.agreement_threshold}: in epoch {epoch} the "
                    f"ranks drew the same index at the same position, i.e. the same sequence. {_LIKELY_DATA}"
                ),
            )
        if self.min_coverage is not None and c < self.min_coverage:
            raised += self._alarm(
                "bias/coverage",
                epoch,
                warn,
                (
                    f"bias/coverage = {c:.3f} is below {self.min_coverage}: in epoch {epoch} the ranks together "
                    f"left {1 - c:.1%} of the dataset unseen. {_LIKELY_DATA}"
                ),
            )
        return raised

    def _alarm(self, metric: str, epoch: int, warn: bool, message: str) -> list[str]:
        key = (metric, epoch)
        if key in self._alarmed:
            return []
        self._alarmed.add(key)
        self.alarms.append(message)
        if warn:
            warnings.warn(message, CodedBiasWarning, stacklevel=3)
        return [message]


# ---------------------------------------------------------------------- local gradient norms
class _LocalNormState:
    """State of the recording all-reduce hook: the process group and this step's sum of squares."""

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.sq: torch.Tensor | None = None


def _recording_allreduce(state, bucket):  # noqa: ANN001, ANN202 - DDP inspects the annotations
    """DDP's default averaging all-reduce, after adding the bucket's local sum of squares to ``state``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    sq = bucket.buffer().detach().float().pow(2).sum()
    state.sq = sq if state.sq is None else state.sq + sq
    return allreduce_hook(state.process_group, bucket)


def _loss_value(outputs: Any, accumulate: int) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return None
    # Lightning divides the loss in `outputs` by accumulate_grad_batches; report the step's loss.
    return float(loss.detach()) * accumulate


# ---------------------------------------------------------------------- collectives and metrics
def _pstd(values: Sequence[float]) -> float:
    return statistics.pstdev(values) if len(values) > 1 else 0.0


def _step_metrics(gathered: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Spread of the loss (one value per dp rank) and of each stage's local gradient norm."""
    losses: dict[int, float] = {}
    norms: dict[int, dict[int, float]] = {}
    for item in gathered:
        if item["loss"] is not None:
            losses.setdefault(item["dp_rank"], item["loss"])
        for stage, value in item["norms"].items():
            norms.setdefault(stage, {}).setdefault(item["dp_rank"], value)
    out: dict[str, float] = {}
    if len(losses) > 1:
        out["bias/loss_std"] = _pstd(list(losses.values()))
    for stage in sorted(norms):
        if len(norms[stage]) > 1:
            out[f"bias/grad_norm_std/stage_{stage}"] = _pstd(list(norms[stage].values()))
    return out
