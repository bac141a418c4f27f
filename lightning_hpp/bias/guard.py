"""The coded-bias guard: fingerprints and the data-loading audit, run by Lightning at fit start.

:class:`BiasGuard` is a Lightning callback. On every rank:

* ``on_fit_start`` (after the strategy built its process groups, before the sanity check): each
  rank collects its environment fingerprint and device kind; the ranks exchange them, compare them
  (device-specific fields may differ between device kinds, never inside one stage's data-parallel
  group), write them to ``fingerprints.json`` in ``trainer.log_dir`` and act on the fingerprint
  policy. A fingerprint saved with a checkpoint is compared with the current one here as well.
* ``on_train_start`` (the dataloaders exist, with Lightning's distributed samplers injected and
  the strategy's ``process_dataloader`` applied; no training step has run): the train dataloader
  (and the validation dataloaders, when present) are audited across the data-parallel ranks, and
  PYTHONHASHSEED across all ranks; the audit policy decides what happens.

Every rank reaches the same verdict, so with policy ``"error"`` every rank raises and none is left
waiting in a collective. With ``"warn"`` the warnings are emitted on global rank 0 only.

Findings have a severity (:data:`~lightning_hpp.bias.audit.SKEW` or
:data:`~lightning_hpp.bias.audit.REPRODUCIBILITY`). The policies act on skew; reproducibility findings
(the hash seed unset, a sampler whose order a resume cannot restore) are notes logged on rank 0, and
count like skew only when the run is deterministic (``BiasGuard(deterministic=True)``, or by default
``torch``'s deterministic flag, which ``Trainer(deterministic=True)`` and
``BiasOptions(deterministic=True)`` set). Every finding, with its severity, is written to
``bias_audit.json`` in ``trainer.log_dir``.

Data-parallel topology: a strategy that has ``dp_group`` / ``dp_size`` / ``dp_rank`` (the pipeline
strategy) is audited per data-parallel group and the findings of all groups are merged; any other
strategy (``DDPStrategy``, one device) is audited over the world. Under pipeline parallelism the
ranks of one pipeline replica must see the *same* data (the first stage's inputs and the last
stage's targets come from their own loaders), so the guard also compares their draws and their
dataloader workers' random streams (hazards :data:`PIPELINE_PEERS_DATA` and
:data:`PIPELINE_PEERS_WORKERS`).

Resume: :meth:`BiasGuard.state_dict` puts the fingerprints into Lightning checkpoints and
:meth:`BiasGuard.load_state_dict` compares them at fit start; checkpoint code of its own calls
:meth:`BiasGuard.check_resume` with what it stored from :meth:`BiasGuard.checkpoint_metadata`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from lightning_hpp._dist import all_gather_object
from lightning_hpp.bias.audit import (
    PIPELINE_PEERS_DATA,
    PIPELINE_PEERS_WORKERS,
    Hazard,
    analyze_audit_records,
    collect_audit_record,
    enforce_audit,
)
from lightning_hpp.bias.fingerprint import (
    DEVICE_FIELDS,
    FingerprintDifference,
    check_policy,
    collect_fingerprint,
    compare_fingerprints,
    compare_with_saved,
    enforce,
    format_ranks,
    load_fingerprints,
    save_fingerprints,
)
from lightning_hpp.errors import BiasConfigError
from lightning_hpp.pipeline.view import pipeline_view
from lightning_hpp.validation import check_bool, check_int

FINGERPRINT_FILENAME = "fingerprints.json"
AUDIT_FILENAME = "bias_audit.json"
"""Every finding of the guard with its severity, written next to the fingerprints."""


class BiasGuard(Callback):
    """Check the environment and the data loading of every rank before the first training step.

    Args:
        fingerprint: Policy for environment differences between ranks and against a resumed
            checkpoint: ``"warn"``, ``"error"`` (raise :class:`FingerprintMismatchError` on every
            rank) or ``"off"`` (no fingerprints are collected).
        audit: Policy for data-loading hazards: ``"warn"``, ``"error"`` (raise
            :class:`CodedBiasError` on every rank) or ``"off"``.
        max_indices: Indices each rank draws per dataloader for the audit.
        filename: Name of the fingerprint file written to ``trainer.log_dir``.
        deterministic: Whether reproducibility findings count like skew (the policies act on them).
            ``None``: when ``torch``'s deterministic-algorithms flag is on at fit start.

    Attributes:
        fingerprints: Every rank's fingerprint, in global-rank order, once the fit started (on every
            rank); store :meth:`checkpoint_metadata` with checkpoints.
        device_kinds: Every rank's device kind.
        stage_of_rank: The first pipeline stage each rank holds (0 for every rank without pipeline).
        differences: The fingerprint differences between ranks.
        resume_differences: Differences between a saved fingerprint and the current one, after
            :meth:`check_resume` ran (``None`` before).
        hazards: The data-loading hazards found (the same list on every rank).
        audited_at_step: ``trainer.global_step`` when the audit ran (0: before the first step).
        fingerprint_path: Where the fingerprints were written.
        audit_path: Where the findings were written (``bias_audit.json``).

    Raises:
        BiasConfigError: an invalid policy or ``max_indices``.
    """

    def __init__(
        self,
        fingerprint: str = "warn",
        audit: str = "warn",
        max_indices: int = 256,
        filename: str = FINGERPRINT_FILENAME,
        deterministic: bool | None = None,
    ) -> None:
        self.fingerprint_policy = check_policy(fingerprint, "`BiasGuard(fingerprint=...)`")
        self.audit_policy = check_policy(audit, "`BiasGuard(audit=...)`")
        check_int(max_indices, "BiasGuard(max_indices=...)", error=BiasConfigError, hint="For example 256.")
        if not isinstance(filename, str) or not filename or "/" in filename:
            raise BiasConfigError(
                f"`BiasGuard(filename={filename!r})`: use a plain file name such as {FINGERPRINT_FILENAME!r}; "
                f"the file is written to `trainer.log_dir`."
            )
        check_bool(deterministic, "BiasGuard(deterministic=...)", optional=True, error=BiasConfigError,
                   hint="None follows torch.")
        self.max_indices = max_indices
        self.filename = filename
        self.deterministic = deterministic
        self._reset()

    def _reset(self) -> None:
        self.fingerprints: list[dict[str, Any]] | None = None
        self.device_kinds: list[str] | None = None
        self.stage_of_rank: list[int] | None = None
        self.differences: list[FingerprintDifference] = []
        self.resume_differences: list[FingerprintDifference] | None = None
        self.hazards: list[Hazard] = []
        self.audited_at_step: int | None = None
        self.fingerprint_path: str | None = None
        self.audit_path: str | None = None
        self._log_dir: str | None = None
        self._pending_saved: list[dict[str, Any]] | None = None
        self._is_global_zero = True

    # ------------------------------------------------------------------ wiring
    def attach(self, trainer: Any) -> BiasGuard:
        """Add this guard to ``trainer.callbacks`` unless a :class:`BiasGuard` is already there.

        A strategy calls it before ``Trainer.fit`` reaches the callbacks' ``setup`` (for example in
        ``setup_environment``), so that resuming restores the guard's state too.

        Returns:
            The guard that will run: the user's own when there is one, else ``self``.
        """
        for cb in trainer.callbacks:
            if isinstance(cb, BiasGuard):
                return cb
        trainer.callbacks.append(self)
        return self

    @property
    def state_key(self) -> str:
        return "BiasGuard"

    def state_dict(self) -> dict[str, Any]:
        """What Lightning stores in its checkpoints: the fingerprints of this run."""
        return {"fingerprints": self.fingerprints, "device_kinds": self.device_kinds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """On resume from a checkpoint that holds this callback's state: compare its fingerprints.

        Lightning restores callbacks before ``on_fit_start`` (then the comparison waits for the current
        fingerprints) or, for strategies that restore after setup, after it (then it runs at once).
        """
        saved = state_dict.get("fingerprints")
        if saved:
            self.check_resume(saved)

    def checkpoint_metadata(self) -> dict[str, Any] | None:
        """The fingerprints as one JSON document for checkpoint metadata (``{"format", "ranks"}``).

        Returns:
            ``None`` before the fit started or with ``fingerprint="off"``.
        """
        if self.fingerprints is None:
            return None
        return {"format": 1, "ranks": list(self.fingerprints), "device_kinds": self.device_kinds}

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset()

    def on_fit_start(self, trainer: Any, pl_module: LightningModule) -> None:
        self._is_global_zero = trainer.is_global_zero
        log_dir = trainer.log_dir or trainer.default_root_dir  # a collective: every rank asks
        self._log_dir = None if log_dir is None else str(log_dir).rstrip("/")
        if self.fingerprint_policy == "off":
            self._pending_saved = None
            return
        mine = {
            # Plain JSON types only (torch.__version__ is a str subclass): checkpoints that hold the
            # fingerprints must load with torch.load(weights_only=True).
            "fingerprint": json.loads(
                json.dumps(collect_fingerprint(device=trainer.strategy.root_device), default=str)
            ),
            "device_kind": _device_kind(trainer),
            "stage": _first_stage(trainer),
        }
        gathered = all_gather_object(mine, group=None)
        self.fingerprints = [g["fingerprint"] for g in gathered]
        self.device_kinds = [g["device_kind"] for g in gathered]
        self.stage_of_rank = [g["stage"] for g in gathered]
        self.differences = compare_fingerprints(self.fingerprints, self.stage_of_rank, self.device_kinds)
        if self._log_dir is not None:
            self.fingerprint_path = f"{self._log_dir}/{self.filename}"
            if trainer.is_global_zero:
                import fsspec

                fs, path = fsspec.core.url_to_fs(self._log_dir)
                fs.makedirs(path, exist_ok=True)
                save_fingerprints(self.fingerprints, self.fingerprint_path)
        self._write_findings()
        what = "environment fingerprint across ranks"
        self._act(
            self.differences,
            lambda found, p: enforce(found, p, what, deterministic=True),
            self.fingerprint_policy,
            what,
        )
        if self._pending_saved is not None:
            saved, self._pending_saved = self._pending_saved, None
            self.check_resume(saved)

    def on_train_start(self, trainer: Any, pl_module: LightningModule) -> None:
        self._is_global_zero = trainer.is_global_zero
        if self.audit_policy == "off":
            return
        self.hazards = self.run_audit(trainer)
        self.audited_at_step = trainer.global_step
        self._write_findings()
        self._act(
            self.hazards,
            lambda found, p: enforce_audit(found, p, deterministic=True),
            self.audit_policy,
            "data-loading audit",
        )

    # ------------------------------------------------------------------ audit
    def run_audit(self, trainer: Any) -> list[Hazard]:
        """Audit the train and validation dataloaders and PYTHONHASHSEED (a collective: every rank).

        Each data-parallel group compares its ranks' draws (the audit's hazards). Under pipeline
        parallelism the ranks of one pipeline replica must moreover see the same data, so their draws
        and worker streams are compared too (:data:`PIPELINE_PEERS_DATA`, :data:`PIPELINE_PEERS_WORKERS`).

        Returns:
            The hazards, the same list on every rank.
        """
        group, size, rank = _dp_topology(trainer)
        # What Lightning does: inject or wrap samplers only under a distributed strategy.
        connector = trainer._accelerator_connector
        use_ds = bool(connector.use_distributed_sampler and connector.is_distributed)
        loaders = [
            (name, loader, True) for name, loader in _named_loaders(trainer.train_dataloader, "train dataloader")
        ]
        loaders += [(name, loader, False) for name, loader in _named_loaders(trainer.val_dataloaders, "val dataloader")]
        hazards: list[Hazard] = []
        draws: list[tuple[str, Any, Any]] = []
        for name, loader, train in loaders:
            record = collect_audit_record(
                loader,
                rank=rank,
                world_size=size,
                use_distributed_sampler=use_ds,
                max_indices=self.max_indices,
                train=train,
            )
            hazards += analyze_audit_records(all_gather_object(record, group), name=name, check_hash_seed=False)
            draws.append((name, record["shard"], record["worker_stream"]))
        if size < trainer.world_size:
            # One data-parallel group per pipeline position judged its own ranks: merge the verdicts so
            # every rank acts on the same list, then compare the ranks of each pipeline replica.
            mine = {"hazards": hazards, "replica": rank, "rank": trainer.global_rank, "draws": draws}
            parts = all_gather_object(mine, None)
            hazards = _merge([h for part in parts for h in part["hazards"]])
            hazards += pipeline_peer_hazards(parts)
        # PYTHONHASHSEED concerns every rank, not only a data-parallel group.
        record = collect_audit_record(
            None, rank=trainer.global_rank, world_size=trainer.world_size, use_distributed_sampler=use_ds
        )
        hazards += analyze_audit_records(all_gather_object(record, None), check_hash_seed=True)
        return hazards

    # ------------------------------------------------------------------ resume
    def check_resume(self, saved: Any) -> list[FingerprintDifference] | None:
        """Compare the fingerprints saved with a checkpoint against this run's, and act on the policy.

        Call it on every rank with the same ``saved`` (the checkpoint code does, after reading the
        checkpoint's metadata). Before the fit gathered the current fingerprints, the comparison is
        deferred to fit start. Same world size: rank ``r`` is compared with saved rank ``r``.
        Different world size: every rank is compared with saved rank 0, device fields excepted
        (the placement changed with the world size).

        Args:
            saved: :meth:`checkpoint_metadata` (``{"ranks": [...]}``), a list of per-rank
                fingerprints, one fingerprint, or the path of a ``fingerprints.json``.

        Returns:
            The differences (holders ``"saved"`` / ``"current"``, scope naming the ranks), or ``None``
            when the comparison was deferred (or ``fingerprint="off"``).

        Raises:
            FingerprintMismatchError: differences and ``fingerprint="error"``.
            BiasConfigError: ``saved`` is none of the accepted forms.
        """
        per_rank = _saved_ranks(saved)
        if self.fingerprint_policy == "off":
            return None
        if self.fingerprints is None:
            self._pending_saved = per_rank
            return None
        diffs = compare_runs(per_rank, self.fingerprints)
        self.resume_differences = diffs
        what = "environment fingerprint of the resumed run (saved vs current)"
        self._act(diffs, lambda found, p: enforce(found, p, what, deterministic=True), self.fingerprint_policy, what)
        return diffs

    # ------------------------------------------------------------------ policy
    @property
    def strict(self) -> bool:
        """Whether reproducibility findings count like skew: ``deterministic``, else torch's deterministic flag."""
        if self.deterministic is not None:
            return self.deterministic
        return torch.are_deterministic_algorithms_enabled()

    def _act(self, findings: Sequence[Any], enforce_fn: Any, policy: str, what: str) -> None:
        """Notes on rank 0 for what the policy does not act on; the policy for the rest.

        Every rank holds the same verdict: all raise together; only rank 0 warns.
        """
        if policy == "off":
            return
        strict = self.strict
        if self._is_global_zero:
            for f in findings:
                if not f.blocks(strict):
                    rank_zero_info(f"BiasGuard note ({what}): {f}")
        acted = [f for f in findings if f.blocks(strict)]
        if acted and (policy == "error" or self._is_global_zero):
            enforce_fn(acted, policy)

    def _write_findings(self) -> None:
        """Rank 0 writes every finding so far, with its severity, to ``bias_audit.json``."""
        if self._log_dir is None:
            return
        self.audit_path = f"{self._log_dir}/{AUDIT_FILENAME}"
        if not self._is_global_zero:
            return
        import fsspec

        fs, path = fsspec.core.url_to_fs(self._log_dir)
        fs.makedirs(path, exist_ok=True)
        record = {
            "format": 1,
            "deterministic": self.strict,
            "fingerprint_differences": [d.to_dict() for d in self.differences],
            "resume_differences": None
            if self.resume_differences is None
            else [d.to_dict() for d in self.resume_differences],
            "hazards": [h.to_dict() for h in self.hazards],
        }
        with fsspec.open(self.audit_path, "w") as f:
            json.dump(record, f, indent=1)


# ---------------------------------------------------------------------- pipeline peers
def pipeline_peer_hazards(parts: Sequence[Mapping[str, Any]]) -> list[Hazard]:
    """Hazards where the ranks of one pipeline replica draw different data (pure: no communication).

    Args:
        parts: One entry per global rank: ``{"rank", "replica", "draws": [(loader name, indices drawn,
            worker-0 stream), ...]}``.

    Returns:
        At most one :data:`PIPELINE_PEERS_DATA` and one :data:`PIPELINE_PEERS_WORKERS` hazard per loader.
    """
    out: list[Hazard] = []
    by_replica: dict[int, list[Mapping[str, Any]]] = {}
    for part in parts:
        by_replica.setdefault(part["replica"], []).append(part)
    n_loaders = min((len(p["draws"]) for p in parts), default=0)
    for i in range(n_loaders):
        name = parts[0]["draws"][i][0]
        for what, pos in (("data", 1), ("workers", 2)):
            bad = {
                d: ps
                for d, ps in by_replica.items()
                if len({json.dumps(p["draws"][i][pos], default=str) for p in ps}) > 1
            }
            if not bad:
                continue
            replica, peers = next(iter(bad.items()))
            ranks = tuple(sorted(p["rank"] for ps in bad.values() for p in ps))
            shown = " vs ".join(f"{_preview(p['draws'][i][pos])} (rank {p['rank']})" for p in peers)
            where = f"{name}: the ranks of pipeline replica {replica} ({format_ranks([p['rank'] for p in peers])})"
            if len(bad) > 1:
                where += f" and of {len(bad) - 1} other replica(s)"
            if what == "data":
                out.append(
                    Hazard(
                        PIPELINE_PEERS_DATA,
                        f"{where} draw different indices: {shown}. The first stage computes on one batch while the "
                        f"last stage's loss uses the targets of another.",
                        "Let the strategy shard the data over the data-parallel replicas: keep "
                        "`use_distributed_sampler=True`, or use `DistributedWeightedSampler` / `DistributedSampler` "
                        "(the strategy points them at the replicas); never seed a sampler with the global rank.",
                        ranks,
                    )
                )
            else:
                out.append(
                    Hazard(
                        PIPELINE_PEERS_WORKERS,
                        f"{where} start their dataloader workers with different random streams: {shown}. If the "
                        f"dataset draws random numbers (augmentation, label noise, mixing), the stages of one "
                        f"pipeline see different versions of the same batch, and the last stage's targets no longer "
                        f"match the first stage's inputs.",
                        "Seed workers per data-parallel replica, not per global rank: "
                        "`DataLoader(..., worker_init_fn=lightning_hpp.bias.determinism.worker_init_fn(seed, "
                        "trainer.strategy.dp_rank))`.",
                        ranks,
                    )
                )
    return out


def _preview(value: Any, k: int = 4) -> str:
    if isinstance(value, (list, tuple)):
        head = ", ".join(str(v) for v in value[:k])
        return f"[{head}{', ...' if len(value) > k else ''}]"
    return str(value)


# ---------------------------------------------------------------------- comparison of runs
def compare_runs(saved: Sequence[dict[str, Any]], current: Sequence[dict[str, Any]]) -> list[FingerprintDifference]:
    """Differences between a saved run's per-rank fingerprints and the current run's.

    Args:
        saved: Per-rank fingerprints stored with the checkpoint.
        current: Per-rank fingerprints of this run.

    Returns:
        One difference per field and (saved value, current value) pair, its scope naming the
        current ranks concerned (``"ranks 0-3"``); sorted by field.
    """
    same_world = len(saved) == len(current)
    grouped: dict[tuple[str, str, str], tuple[FingerprintDifference, list[int]]] = {}
    for rank, fp in enumerate(current):
        ref = saved[rank] if same_world else saved[0]
        for d in compare_with_saved(ref, fp):
            if not same_world and d.field in DEVICE_FIELDS:
                continue
            key = (
                d.field,
                json.dumps(d.values[0], sort_keys=True, default=str),
                json.dumps(d.values[1], sort_keys=True, default=str),
            )
            grouped.setdefault(key, (d, []))[1].append(rank)
    out = [
        FingerprintDifference(d.field, d.values, d.holders, scope=format_ranks(ranks)) for d, ranks in grouped.values()
    ]
    return sorted(out, key=lambda d: (d.field, d.scope or ""))


def _saved_ranks(saved: Any) -> list[dict[str, Any]]:
    if isinstance(saved, str):
        return load_fingerprints(saved)
    if isinstance(saved, Mapping) and isinstance(saved.get("ranks"), list):
        saved = saved["ranks"]
    elif isinstance(saved, Mapping) and "torch" in saved:
        saved = [saved]
    if (
        isinstance(saved, Sequence)
        and not isinstance(saved, str)
        and saved
        and all(isinstance(fp, Mapping) for fp in saved)
    ):
        return [dict(fp) for fp in saved]
    raise BiasConfigError(
        f"`check_resume` got {type(saved).__name__} {str(saved)[:80]!r}; pass what `BiasGuard.checkpoint_metadata()` "
        f"returned ({{'ranks': [...]}}), a list of per-rank fingerprints, one fingerprint, or a fingerprints.json path."
    )


# ---------------------------------------------------------------------- topology
def _dp_topology(trainer: Any) -> tuple[Any, int, int]:
    """``(group, size, rank)`` of this rank's data-parallel group; the world without pipeline."""
    view = pipeline_view(trainer)
    if view is None:
        return None, trainer.world_size, trainer.global_rank
    group, size, rank = view.dp_group, view.dp_size, view.dp_rank
    if group is None and int(size) != trainer.world_size:
        raise BiasConfigError(
            f"The strategy reports dp_size={size!r} of world size {trainer.world_size} but no `dp_group`; "
            f"the audit needs the data-parallel process group to compare the ranks' data."
        )
    return group, int(size), int(rank)


def _first_stage(trainer: Any) -> int:
    view = pipeline_view(trainer)
    return min(view.stage_ids) if view is not None and view.stage_ids else 0


def _device_kind(trainer: Any) -> str:
    """The kind placement gave this rank; without a pipeline, the device's own name."""
    view = pipeline_view(trainer)
    if view is not None and view.device_kind:
        return view.device_kind
    device = trainer.strategy.root_device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _named_loaders(obj: Any, name: str) -> list[tuple[str, DataLoader]]:
    if obj is None:
        return []
    if isinstance(obj, DataLoader):
        return [(name, obj)]
    if isinstance(obj, Mapping):
        return [item for key, value in obj.items() for item in _named_loaders(value, f"{name} {key!r}")]
    if isinstance(obj, Sequence) and not isinstance(obj, str):
        if len(obj) == 1:
            return _named_loaders(obj[0], name)
        return [item for i, value in enumerate(obj) for item in _named_loaders(value, f"{name} {i}")]
    return []


def _merge(hazards: Sequence[Hazard]) -> list[Hazard]:
    """One hazard per code: the first group's, noting how many other groups found it too."""
    by_code: dict[str, list[Hazard]] = {}
    for h in hazards:
        same = by_code.setdefault(h.code, [])
        if all(h.message != s.message for s in same):
            same.append(h)
    out = []
    for first, *others in by_code.values():
        if others:
            first = Hazard(
                first.code,
                f"{first.message} (Found as well, with other values, in {len(others)} other data-parallel group(s).)",
                first.fix,
                first.ranks,
            )
        out.append(first)
    return out


__all__ = [
    "AUDIT_FILENAME",
    "FINGERPRINT_FILENAME",
    "PIPELINE_PEERS_DATA",
    "PIPELINE_PEERS_WORKERS",
    "BiasGuard",
    "compare_runs",
    "pipeline_peer_hazards",
]
