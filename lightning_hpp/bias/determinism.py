"""The determinism switch: what two runs with the same seed need to compute the same bits.

:func:`enable_determinism` turns on, in the calling process:

* ``torch.use_deterministic_algorithms(True)`` (ops without a deterministic implementation raise),
* cuDNN ``deterministic=True`` and ``benchmark=False`` (autotuning picks kernels by timing),
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` on CUDA builds (cuBLAS ≥ 10.2 needs a fixed workspace for
  reproducible GEMMs; it must be set before the first cuBLAS call),
* the seeds of ``torch``, ``random`` and ``numpy`` (Lightning's ``seed_everything``), with
  ``workers=True`` so Lightning seeds every dataloader worker from the seed, the worker id and
  the global rank,
* ``PYTHONHASHSEED`` for processes started from now on (:func:`ensure_hash_seed`).

The hash seed is the one setting that cannot be switched on from inside Python: the interpreter
draws it at start-up. Setting ``os.environ["PYTHONHASHSEED"]`` before Lightning launches the
other ranks gives *them* a fixed hash seed, but the launching process (global rank 0 under
Lightning's subprocess launcher; every rank under torchrun or SLURM) keeps the random one it
started with. Only ``PYTHONHASHSEED=<n>`` in the shell (or the job spec) fixes every rank. The
function warns when the calling process is in that state, and the data-loading audit reports it
(``pythonhashseed_differs``: "set after the interpreter started").

:func:`worker_init_fn` builds a dataloader ``worker_init_fn``: Lightning's own worker seeding
(``pl_worker_init_function``) with the *data-parallel* rank in place of the global rank, so every
worker's ``torch``, ``random`` and ``numpy`` streams derive from ``(seed, data-parallel rank, worker
id, the loader's per-epoch base seed)``: they differ between workers, replicas and epochs, repeat
between runs, and agree between the pipeline stages of one replica (with the *global* rank, as
Lightning installs it, the stages of one pipeline get different augmentations of the same batch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_hpp.bias.fingerprint import HASH_PROBE, CodedBiasWarning
from lightning_hpp.errors import BiasConfigError
from lightning_hpp.validation import check_int

HASH_SEED_VAR = "PYTHONHASHSEED"
CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS workspace setting for reproducible GEMMs (``:16:8`` also works, with less memory and speed)."""

_MAX_HASH_SEED = 2**32 - 1

_effective_cache: dict[str, bool] = {}
_warned_hash_seed = False


def _check_seed(seed: Any, where: str) -> int:
    return check_int(seed, f"{where}(seed=...)", minimum=0, error=BiasConfigError,
                     hint=f"Give the same seed on every rank, e.g. `{where}(seed=42)`.")


def hash_seed_for(seed: int) -> str:
    """The PYTHONHASHSEED value used for a training seed (PYTHONHASHSEED accepts 0 .. 2**32 - 1)."""
    return str(_check_seed(seed, "hash_seed_for") % (_MAX_HASH_SEED + 1))


def hash_seed_effective(value: str | None = None) -> bool:
    """Whether this interpreter hashes strings as a fresh interpreter started with ``PYTHONHASHSEED=value``.

    A fresh interpreter is asked for the hash of a probe string (about 20 ms, cached per value).

    Args:
        value: The PYTHONHASHSEED to check; ``None`` means the current ``os.environ`` value.

    Returns:
        ``False`` when ``value`` is unset or ``"random"``, or when this process started with another
        (or a random) hash seed.
    """
    value = os.environ.get(HASH_SEED_VAR) if value is None else value
    if value is None or value == "random":
        return False
    if value == "0":
        return sys.flags.hash_randomization == 0
    if value not in _effective_cache:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env[HASH_SEED_VAR] = value
        try:
            out = subprocess.run(
                [sys.executable, "-S", "-c", f"print(hash({HASH_PROBE!r}))"],
                env=env, capture_output=True, text=True, timeout=60, check=True,
            )
            _effective_cache[value] = int(out.stdout.strip()) == hash(HASH_PROBE)
        except (OSError, subprocess.SubprocessError, ValueError):
            return False  # cannot tell: report it as not effective rather than claim it is
    return _effective_cache[value]


def ensure_hash_seed(seed: int, *, warn: bool = True) -> str:
    """Make every process started from now on hash strings the same way.

    Sets ``PYTHONHASHSEED`` in ``os.environ`` unless it is already set to a fixed value (a value
    from the shell is kept: it is the one that also reached this process). Call it in the
    launching process before Lightning starts the other ranks, i.e. before ``Trainer.fit``.

    This process's own hash seed cannot change: when it started without PYTHONHASHSEED, it keeps a
    random one, and (with ``warn``) a :class:`CodedBiasWarning` says so once per process.

    Args:
        seed: Training seed; the hash seed is ``seed % 2**32``.
        warn: Warn when this process's own hash seed is not the one now in the environment.

    Returns:
        The PYTHONHASHSEED value in the environment.

    Raises:
        BiasConfigError: ``seed`` is not a non-negative int.
    """
    global _warned_hash_seed
    _check_seed(seed, "ensure_hash_seed")
    current = os.environ.get(HASH_SEED_VAR)
    if current is None or current == "random":
        current = hash_seed_for(seed)
        os.environ[HASH_SEED_VAR] = current
    if warn and not _warned_hash_seed and not hash_seed_effective(current):
        _warned_hash_seed = True
        warnings.warn(
            f"PYTHONHASHSEED={current} is now set for the processes this one launches, but this process "
            f"(pid {os.getpid()}) started without it and keeps a random string-hash seed: set iteration order "
            f"and hash-based splits on this rank differ from the other ranks and from run to run. Start the "
            f"job with `PYTHONHASHSEED={current}` in the shell or job spec (it must be set before the "
            f"interpreter starts).",
            CodedBiasWarning,
            stacklevel=2,
        )
    return current


def _cuda_needs_cublas_config() -> bool:
    cuda = torch.version.cuda
    if not cuda:
        return False
    try:
        major, minor = (int(x) for x in cuda.split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= (10, 2)


@dataclass(frozen=True)
class DeterminismSettings:
    """What :func:`enable_determinism` set in this process.

    Attributes:
        seed: The seed given to ``torch``, ``random`` and ``numpy``.
        hash_seed: PYTHONHASHSEED in the environment of processes started from now on.
        hash_seed_effective: Whether this process itself hashes with that seed.
        cublas_workspace_config: ``CUBLAS_WORKSPACE_CONFIG`` (``None`` on builds without CUDA).
    """

    seed: int
    hash_seed: str
    hash_seed_effective: bool
    cublas_workspace_config: str | None


def enable_determinism(seed: int, *, seed_workers: bool = True, warn: bool = True) -> DeterminismSettings:
    """Set up everything a bitwise-reproducible run needs, in this process.

    Call it in every rank's process (a strategy does it in ``setup_environment``) and, for the hash
    seed to reach the other ranks, once in the launching process before they start.

    Args:
        seed: Seed shared by every rank.
        seed_workers: Let Lightning seed dataloader workers per rank and worker
            (``PL_SEED_WORKERS=1``; Lightning installs its worker init function on loaders without one).
        warn: Warn when this process's own hash seed is random (see :func:`ensure_hash_seed`).

    Returns:
        The settings applied.

    Raises:
        BiasConfigError: ``seed`` is not a non-negative int.
    """
    from lightning.fabric.utilities.seed import seed_everything

    _check_seed(seed, "enable_determinism")
    hash_seed = ensure_hash_seed(seed, warn=warn)
    cublas = os.environ.get(CUBLAS_VAR)
    if cublas is None and _cuda_needs_cublas_config():
        cublas = os.environ[CUBLAS_VAR] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    seed_everything(seed, workers=seed_workers, verbose=False)
    return DeterminismSettings(seed, hash_seed, hash_seed_effective(hash_seed), cublas)


def determinism_seed(default: int = 0) -> int:
    """The seed to use when the user asked for determinism without giving one.

    Returns:
        ``PL_GLOBAL_SEED`` (set by ``seed_everything``) when it is a valid seed, else ``default``.
    """
    value = os.environ.get("PL_GLOBAL_SEED")
    try:
        seed = int(value) if value is not None else default
    except ValueError:
        return default
    return seed if seed >= 0 else default


class WorkerSeeder:
    """A picklable dataloader ``worker_init_fn``: Lightning's worker seeding, per seed and data-parallel rank.

    Each worker runs Lightning's ``pl_worker_init_function(worker_id, rank=rank)``, which seeds the
    worker's ``torch``, ``random`` and ``numpy`` generators from ``(base seed, worker id, rank)``.
    Lightning reads the base seed from ``torch.initial_seed() - worker_id``, i.e. the value the
    ``DataLoader`` drew for this epoch's workers from its generator (or the global torch RNG). To
    make the streams follow ``seed`` as well, the base seed is first replaced by a mix of ``seed``
    and the loader's base seed, set where Lightning reads it (``torch.manual_seed(base + worker_id)``):
    the streams differ between seeds, workers, ranks and epochs, and repeat in a run with the same seed.

    Under pipeline parallelism pass the *data-parallel* rank (the replica index,
    ``trainer.strategy.dp_rank``) rather than the global rank Lightning would use: the stages of one
    pipeline replica load the same batch on different processes, and random augmentation must
    agree between them. Without pipeline parallelism the data-parallel rank is the global rank.

    Args:
        seed: Seed shared by every rank.
        rank: This process's data-parallel rank.
    """

    def __init__(self, seed: int, rank: int) -> None:
        _check_seed(seed, "worker_init_fn")
        check_int(rank, "worker_init_fn(rank=...)", minimum=0, error=BiasConfigError)
        self.seed = seed
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        from lightning.fabric.utilities.seed import pl_worker_init_function

        # Inside a worker, torch.initial_seed() is the loader's base seed plus the worker id.
        loader_base = (torch.initial_seed() - worker_id) % 2**64
        # 63 bits, so that base + worker_id stays a valid torch seed (< 2**64).
        base = int(np.random.SeedSequence([self.seed, loader_base]).generate_state(1, dtype=np.uint64)[0]) >> 1
        torch.manual_seed(base + worker_id)
        pl_worker_init_function(worker_id, rank=self.rank)

    def __repr__(self) -> str:
        return f"WorkerSeeder(seed={self.seed}, rank={self.rank})"


def worker_init_fn(seed: int, rank: int) -> WorkerSeeder:
    """A dataloader ``worker_init_fn`` for ``seed`` on data-parallel rank ``rank`` (see :class:`WorkerSeeder`).

    Example::

        DataLoader(ds, num_workers=4, worker_init_fn=worker_init_fn(seed, trainer.strategy.dp_rank))

    Raises:
        BiasConfigError: ``seed`` or ``rank`` is not a non-negative int.
    """
    return WorkerSeeder(seed, rank)
