"""Where a fit starts from, decided once for every rank, and what a resumed run must check.

* :func:`resolve_ckpt_path`: what ``Trainer.fit`` is handed before any process group exists:
  ``None``, an explicit path, or a :class:`PendingResume` for ``resume="auto"`` and
  ``ckpt_path="last"``, which the ranks decide together once they can talk.
* :func:`select_and_load`: rank 0 lists the candidates and broadcasts them (ranks that listed on
  their own could pick different checkpoints while one is being written); every rank checks the
  sha256 of its share of the candidate's files (:func:`~lightning_hpp.checkpoint.checksums.checked_by`)
  and loads it; any damage found by any rank, then or while loading, sends every rank alike to the
  next candidate, with one warning line naming what was skipped and why, and the damaged
  checkpoint moved to ``<root>/corrupt/``, so that no restart loads it again.
* :func:`check_checkpoint_dir` and :func:`check_run`: a checkpoint ``dir`` that is a file, an
  ``s3://`` one without credentials, or one holding another run's checkpoints is refused at setup.
* :func:`consumed_batches`, :func:`step_checkpoint_callback`, :func:`same_location`.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import Self

from lightning_hpp._dist import all_gather_object, broadcast_object, global_rank, world_size
from lightning_hpp.checkpoint.checksums import verify
from lightning_hpp.checkpoint.commit import METADATA_FILE, CheckpointInfo, has_file
from lightning_hpp.checkpoint.discovery import quarantine, scan
from lightning_hpp.checkpoint.retry import RetryPolicy, StorageFailure, is_s3, is_transient
from lightning_hpp.checkpoint.s3 import require_s3_credentials
from lightning_hpp.checkpoint.storage import filesystem
from lightning_hpp.checkpoint.warning import warn_checkpoint
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError, S3ConfigError
from lightning_hpp.redaction import redact

T = TypeVar("T")

_UNSET = object()
_DCP_INDEX = ".metadata"
_STEP_IN_NAME = re.compile(r"step[-=](\d+)")


class PendingResume(str):
    """The ``ckpt_path`` handed to ``Trainer.fit`` for ``resume="auto"`` / ``ckpt_path="last"``.

    Lightning needs a value before the ranks can agree on one, so this stands in for it: it is
    true (a checkpoint may follow) until :func:`select_and_load` has set :attr:`chosen`, then true
    only if a checkpoint was chosen, and prints as that checkpoint's URL.

    Attributes:
        roots: The directories searched.
        prefer: A name prefix that wins when present (``"last"``).
        what: The request, for messages (``"resume='auto'"``).
        chosen: The checkpoint chosen, ``None`` (start from scratch), or unset.
    """

    roots: tuple[str, ...]
    prefer: str | None
    what: str
    chosen: Any

    def __new__(cls, text: str, *, roots: Sequence[str], prefer: str | None = None, what: str) -> Self:
        obj = super().__new__(cls, text)
        obj.roots, obj.prefer, obj.what, obj.chosen = tuple(roots), prefer, what, _UNSET
        return obj

    def __bool__(self) -> bool:
        return self.chosen is not None

    def __str__(self) -> str:
        return self.chosen if isinstance(self.chosen, str) else str.__str__(self)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __repr__(self) -> str:
        return repr(str(self))


def resolve_ckpt_path(
    ckpt_path: Any, *, resume: str | None, checkpoint_dir: str | None, callback_dirs: Sequence[str] = ()
) -> Any:
    """What a fit is handed as ``ckpt_path``, before any process group exists.

    Args:
        ckpt_path: What the user passed to ``Trainer.fit`` (``None``, a path or ``"last"``).
        resume: ``CheckpointOptions.resume``: ``None``, ``"auto"`` or a path.
        checkpoint_dir: ``CheckpointOptions.dir``.
        callback_dirs: The ``dirpath`` of every ``ModelCheckpoint`` (searched for ``"last"``).

    Returns:
        ``None`` (start from scratch), a :class:`PendingResume`, or an explicit path.
    """
    if ckpt_path is None and resume == "auto":
        return PendingResume(str(checkpoint_dir), roots=[checkpoint_dir], what="resume='auto'")
    if ckpt_path is None and resume is not None:
        return resume
    if ckpt_path == "last":
        roots = [d for d in callback_dirs if d] + ([checkpoint_dir] if checkpoint_dir else [])
        # not the text "last": Lightning would look for a last checkpoint itself
        return PendingResume(
            str(roots[0]) if roots else "<no checkpoint directory>", roots=roots, prefer="last", what="ckpt_path='last'"
        )
    return ckpt_path


# ----------------------------------------------------------------------------- one decision


def on_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` run on global rank 0 only, its result (or its error) on every rank (collective)."""
    rank = global_rank()
    outcome: tuple[Any, BaseException | None] = (None, None)
    if rank == 0:
        try:
            outcome = (fn(), None)
        except (CheckpointError, S3ConfigError) as exc:
            outcome = (None, exc)
        except Exception as exc:  # noqa: BLE001 - storage errors: every rank must raise, none wait
            outcome = (None, OSError(redact(f"{type(exc).__name__}: {exc}")))
    result, error = broadcast_object(outcome)
    if error is not None:
        raise error
    return result


@dataclass
class _Plan:
    candidates: list[str] = field(default_factory=list)
    fallback: bool = True
    skipped: list[str] = field(default_factory=list)  # one line each, said once by rank 0
    damaged: list[tuple[str, str]] = field(default_factory=list)  # unreadable metadata.json: moved aside
    where: str = ""


def _step_of(url: str) -> int | None:
    match = _STEP_IN_NAME.search(url.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def _plan_search(roots: Sequence[str], prefer: str | None, retry: RetryPolicy | None) -> _Plan:
    for root in roots:
        if is_s3(root):
            require_s3_credentials(root)
    found = scan(roots, prefer=prefer, retry=retry)
    best = found.committed[0].step if found.committed else -1
    plan = _Plan(candidates=[c.url for c in found.committed], damaged=found.unreadable, where=f"{list(roots)}")
    for url in found.unfinished:
        if has_file(url, _DCP_INDEX, retry=retry):  # the save reached its end: metadata.json was lost later
            reason = (
                f"it has no {METADATA_FILE}, although its shard index is complete (the file was removed, or the "
                f"save died just before its commit)."
            )
            plan.damaged.append((url, reason))
            continue
        step = _step_of(url)
        if step is None or step > best:
            plan.skipped.append(
                f"Skipping {url!r}: it has no {METADATA_FILE}, so its save did not finish (or the file was "
                f"removed); it is never loaded."
            )
    return plan


def _plan_explicit(url: str, retry: RetryPolicy | None) -> _Plan:
    if is_s3(url):
        require_s3_credentials(url)
    fs, path = filesystem(url, retry)
    try:
        kind = (retry or RetryPolicy()).call(lambda: fs.info(path)["type"], what=f"looking up {url!r}")
    except FileNotFoundError:
        raise CheckpointError(
            f"ckpt_path {url!r} does not exist. Pass a checkpoint directory written by HPPStrategy "
            f"(it holds {METADATA_FILE}), its parent directory, or 'last'."
        ) from None
    if kind != "directory":
        raise CheckpointError(
            f"ckpt_path {url!r} is a file; HPPStrategy checkpoints are directories (``step-<N>/`` holding "
            f"{METADATA_FILE} and the shards). Pass the checkpoint directory, its parent, or 'last'; to load a "
            f"plain Lightning .ckpt, load it into the module yourself (`MyModule.load_from_checkpoint(...)`)."
        )
    if has_file(url, METADATA_FILE, retry=retry) or has_file(url, _DCP_INDEX, retry=retry):
        return _Plan(candidates=[url], fallback=False, where=repr(url))
    plan = _plan_search([url], None, retry)
    if not plan.candidates:
        reasons = [r for _, r in plan.damaged] + plan.skipped
        raise CheckpointError(
            f"ckpt_path {url!r} is neither a checkpoint nor a directory holding a committed one"
            + (f" ({'; '.join(reasons)})" if reasons else " (it holds no checkpoint directories)")
            + ". Pass a checkpoint written by HPPStrategy, its parent directory, or 'last'."
        )
    return plan


def _say_skipped(url: str, reason: str, then: str | None, retry: RetryPolicy | None, move: bool = True) -> None:
    moved = ""
    if move:
        try:
            moved = f" Moved it to {quarantine(url, retry=retry)!r}."
        except Exception as exc:  # noqa: BLE001 - keeping the evidence must not stop the fallback
            moved = f" It could not be moved aside ({type(exc).__name__}: {exc})."
    warn_checkpoint(
        f"Skipping checkpoint {url!r}: {reason}{moved} "
        f"{'Falling back to ' + repr(then) if then else 'No older checkpoint is left'}."
    )


@dataclass
class Chosen:
    """The checkpoint a run starts from.

    Attributes:
        url: Its directory.
        info: Its ``metadata.json`` (as verified).
        loaded: What the ``load`` callback returned for it.
    """

    url: str
    info: CheckpointInfo
    loaded: Any


def select_and_load(request: Any, load: Callable[[str], T], *, retry: RetryPolicy | None = None) -> Chosen | None:
    """Choose the checkpoint to start from, verify it and load it, falling back past damage (collective).

    Args:
        request: A :class:`PendingResume` (search its roots; nothing valid: start from scratch), or an
            explicit checkpoint path (itself; or, for a directory of checkpoints, the newest valid one).
        load: Loads one checkpoint on this rank (collective): ``load(url)``.
        retry: Retries of transient storage errors.

    Returns:
        The :class:`Chosen` checkpoint, or ``None`` for a :class:`PendingResume` with nothing valid.

    Raises:
        CorruptCheckpointError: an explicit checkpoint is damaged (the message gives the damage), or
            every candidate failed while loading.
        CheckpointError: an explicit path that is a file, does not exist or holds no checkpoint.
    """
    if isinstance(request, PendingResume):
        plan = on_rank0(lambda: _plan_search(request.roots, request.prefer, retry))
    else:
        plan = on_rank0(lambda: _plan_explicit(str(request), retry))
    rank, world = global_rank(), world_size()
    if rank == 0:
        for line in plan.skipped:
            warn_checkpoint(line)
        for url, reason in plan.damaged:
            _say_skipped(url, reason, plan.candidates[0] if plan.candidates else None, retry)
    touched = False  # a failed load may have written into the live tensors
    for i, url in enumerate(plan.candidates):
        then = plan.candidates[i + 1] if i + 1 < len(plan.candidates) else None
        info, outcome = None, None
        try:
            info = verify(url, retry=retry, share=(rank, world))
        except CorruptCheckpointError as exc:
            outcome = ("damage", str(exc))
        reason = _first(all_gather_object(outcome))
        if reason is None:
            touched = True
            loaded, outcome = None, None
            try:
                loaded = load(url)
            except (CorruptCheckpointError, StorageFailure) as exc:
                fatal = isinstance(exc, StorageFailure) and is_transient(exc)
                outcome = ("fatal" if fatal else "damage", f"{type(exc).__name__} while loading: {exc}", exc)
            except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank has reported
                outcome = ("fatal", f"{type(exc).__name__}: {exc}", exc)
            reports = all_gather_object(None if outcome is None else outcome[:2])
            fatal = next(((r, m) for r, m in enumerate(reports) if m is not None and m[0] == "fatal"), None)
            if fatal is not None:
                if outcome is not None and outcome[0] == "fatal":
                    raise outcome[2]
                raise CheckpointError(f"rank {fatal[0]} failed loading {url!r}: {redact(fatal[1][1])}")
            reason = _first(reports)
            if reason is None:
                assert info is not None
                return Chosen(url=url, info=info, loaded=loaded)
        if not plan.fallback:
            raise CorruptCheckpointError(
                f"ckpt_path {url!r} is damaged: {reason} Pass another checkpoint (or its parent directory, to "
                f"take the newest valid one there), or use `CheckpointOptions(resume='auto')`."
            )
        if rank == 0:
            _say_skipped(url, reason, then, retry)
    if touched:
        raise CorruptCheckpointError(
            f"every checkpoint in {plan.where} failed while loading (see the warnings above); the model may "
            f"hold part of one, so the run does not start from scratch. Restore a checkpoint, or start a new "
            f"run in another directory."
        )
    if isinstance(request, PendingResume):
        rank_zero_info(f"HPPStrategy: {request.what}: no valid checkpoint in {plan.where}; starting from scratch.")
        return None
    raise CheckpointError(f"ckpt_path {str(request)!r} holds no valid checkpoint (see the warnings above).")


def _first(reports: list[Any]) -> str | None:
    for rank, report in enumerate(reports):
        if report is not None:
            return report[1] if rank == 0 else f"(found by rank {rank}) {report[1]}"
    return None


# ----------------------------------------------------------------------------- setup checks


def begin_fit(
    request: Any, *, checkpoint_dir: str | None, new_run: bool, load: Callable[[str], Any]
) -> tuple[Chosen | None, str | None]:
    """What a fit does at the end of setup, on every rank together (collective).

    Checks ``checkpoint_dir``; for a :class:`PendingResume` chooses, verifies and loads the checkpoint
    (setting its ``chosen``); for a run that starts fresh, makes a run id and refuses a
    ``checkpoint_dir`` holding another run's checkpoints (unless ``new_run``). An explicit
    ``ckpt_path`` is left to :func:`select_and_load` and :func:`continue_run` when Lightning loads it.

    Returns:
        ``(chosen, run_id)``: the checkpoint loaded (``None``: none) and this run's id (``None``
        while an explicit ``ckpt_path`` is still to be loaded).
    """
    if checkpoint_dir is not None:
        check_checkpoint_dir(checkpoint_dir)
    if request is not None and not isinstance(request, PendingResume):
        return None, None
    chosen = None
    if isinstance(request, PendingResume):
        chosen = select_and_load(request, load)
        request.chosen = chosen.url if chosen is not None else None
    if chosen is not None:
        return chosen, continue_run(chosen, checkpoint_dir=checkpoint_dir, new_run=new_run)
    run_id = new_run_id()
    if checkpoint_dir is not None:
        check_run(checkpoint_dir, run_id, resumed_from=None, new_run=new_run)
    return None, run_id


def continue_run(chosen: Chosen, *, checkpoint_dir: str | None, new_run: bool) -> str | None:
    """The run id of a run resumed from ``chosen`` (its own), once ``checkpoint_dir`` is checked (collective)."""
    run_id = chosen.info.run_id
    if checkpoint_dir is not None:
        check_run(checkpoint_dir, run_id, resumed_from=chosen.url, new_run=new_run)
    return run_id


def new_run_id() -> str:
    """A fresh run id, the same on every rank (collective)."""
    return on_rank0(lambda: uuid.uuid4().hex[:16])


def check_checkpoint_dir(url: str) -> None:
    """Refuse a checkpoint ``dir`` that cannot hold checkpoints, before the first save (rank 0 decides).

    Raises:
        CheckpointError: ``url`` is a file.
        S3ConfigError: ``url`` is on S3 and no credentials are found.
    """

    def check() -> None:
        if is_s3(url):
            require_s3_credentials(url)
        fs, path = filesystem(url)
        if fs.isfile(path):
            raise CheckpointError(
                f"`CheckpointOptions(dir={url!r})` is a file; checkpoints are directories under it. Point `dir` "
                f"at a directory (it is created on the first save), or remove the file."
            )

    on_rank0(check)


def check_run(url: str, run_id: str | None, *, resumed_from: str | None, new_run: bool) -> None:
    """Refuse to write into ``url`` when it holds checkpoints of another run (rank 0 decides).

    A run resumed from a checkpoint inside ``url`` continues there; a fresh run, or one resumed from
    elsewhere, must find no other run's checkpoints in it.

    Args:
        url: ``CheckpointOptions.dir``.
        run_id: This run's id (a resumed run keeps the id of the checkpoint it resumed from).
        resumed_from: The checkpoint this run resumed from, if any.
        new_run: ``CheckpointOptions.new_run``: the user asked to start a new run there.

    Raises:
        CheckpointError: another run's checkpoints are there and ``new_run`` is off.
    """
    if new_run or (resumed_from is not None and _inside(resumed_from, url)):
        return

    def check() -> None:
        others = [c for c in scan([url]).committed if resumed_from is None or c.run_id != run_id]
        if others:
            ids = sorted({str(c.run_id) for c in others})
            raise CheckpointError(
                f"`CheckpointOptions(dir={url!r})` holds {len(others)} checkpoint(s) of another run (run id "
                f"{', '.join(ids)}; newest {others[0].url!r}), and this run "
                f"{'resumed from ' + repr(resumed_from) if resumed_from else 'starts fresh'}: its checkpoints would "
                f"land beside them and a later resume='auto' could pick the other run's. Resume from them "
                f"(`CheckpointOptions(resume='auto')`), use an empty `dir`, or pass "
                f"`CheckpointOptions(new_run=True)` to start a new run there on purpose."
            )

    on_rank0(check)


def _inside(ckpt_url: str, root: str) -> bool:
    parent = str(ckpt_url).rstrip("/").rsplit("/", 1)[0]
    return same_location(parent, root)


# ----------------------------------------------------------------------------- the rest


def consumed_batches(checkpoint: dict[str, Any]) -> int:
    """Batches of the current epoch already trained on when ``checkpoint`` was written.

    A checkpoint saved in ``on_train_batch_end`` has processed the batch before Lightning counts it
    completed, so ``processed`` is the count. One saved on the epoch's last batch, or after it (at the
    epoch's end, after its validation), finished the epoch: Lightning resumes at the next epoch's first
    batch, so none are to be skipped.
    """
    progress = (checkpoint.get("loops") or {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})
    if progress.get("is_last_batch"):  # saved on or after the epoch's last batch: Lightning starts the next epoch
        return 0
    return int((progress.get("current") or {}).get("processed", 0) or 0)


def step_checkpoint_callback(checkpoint_dir: str, every_n_steps: int | None) -> ModelCheckpoint:
    """The callback that saves ``step-<N>`` checkpoints into ``checkpoint_dir`` (every epoch when
    ``every_n_steps`` is ``None``), keeping all of them (retention is the strategy's ``keep_last``)."""
    cb = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="step-{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=every_n_steps,
        save_top_k=-1,
        save_on_train_epoch_end=every_n_steps is None,
    )
    cb.FILE_EXTENSION = ""
    return cb


def same_location(a: str, b: str) -> bool:
    """Whether two checkpoint URLs or paths name the same place (local paths resolved, links followed,
    as ``ModelCheckpoint`` resolves its ``dirpath``)."""
    from fsspec.implementations.local import LocalFileSystem

    (fa, pa), (fb, pb) = filesystem(a), filesystem(b)
    if type(fa) is not type(fb):
        return False
    if isinstance(fa, LocalFileSystem):
        return os.path.realpath(pa) == os.path.realpath(pb)
    return pa.rstrip("/") == pb.rstrip("/")
