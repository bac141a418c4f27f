"""Weighted sampling that is correct on every rank, with or without Lightning's sampler wrapping.

The field report's bug: a ``WeightedRandomSampler`` without a generator draws the same sequence on
every rank when ``use_distributed_sampler=False``; its "fix" (a generator seeded ``seed + rank``)
breaks when Lightning wraps the sampler in ``DistributedSamplerWrapper`` (the default), because
that wrapper shards *one* sequence that must be identical on every rank.

:class:`DistributedWeightedSampler` removes the choice. It is a ``DistributedSampler``, so
Lightning (``use_distributed_sampler=True``) and Fabric leave it in place rather than wrapping it,
and it shards itself in both cases:

* every rank draws the same global sequence for an epoch, from a generator seeded by
  ``(seed, epoch)`` only;
* rank ``r`` of ``R`` takes positions ``r, r + R, r + 2R, ...`` of it.

Without replacement the global sequence has no repeats, so ranks draw disjoint indices. With
replacement the global sequence is i.i.d., so the ranks' sub-sequences are independent streams.

Rank and replica count come from the arguments, else from ``torch.distributed`` (the world) at the
time of use. A strategy whose data-parallel group is not the world (pipeline parallelism) assigns
``sampler.num_replicas`` and ``sampler.rank`` from its data-parallel group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data.distributed import DistributedSampler

from lightning_hpp.errors import SamplerError
from lightning_hpp.validation import check_bool, check_int


def _epoch_seed(seed: int, epoch: int) -> int:
    # Mixing (seed, epoch) through SeedSequence keeps (seed=0, epoch=1) and (seed=1, epoch=0) apart.
    return int(np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch]).generate_state(1, np.uint64)[0])


class DistributedWeightedSampler(DistributedSampler):
    """Weighted sampling sharded across data-parallel ranks.

    Args:
        weights: One non-negative weight per dataset index (a sequence, array or 1-D tensor).
        num_samples: Samples drawn per epoch across all replicas together (as in
            ``WeightedRandomSampler``); ``None`` means ``len(weights)`` with replacement and the
            number of non-zero weights without. Each rank draws
            ``ceil(num_samples / num_replicas)`` (``floor`` with ``drop_last``).
        replacement: Draw with replacement (independent streams per rank) or without (disjoint
            indices per rank; ``num_samples`` must not exceed the number of non-zero weights).
        num_replicas: Number of data-parallel replicas; ``None`` means the world size of
            ``torch.distributed`` at the time of use (1 when it is not initialised).
        rank: This replica's rank; ``None`` means the ``torch.distributed`` rank at the time of use.
        seed: Seed shared by all ranks; it must be equal on every rank.
        drop_last: Drop the tail of the global sequence so every rank gets the same number of
            samples; otherwise the tail is padded with samples from the start of the sequence
            (as ``DistributedSampler`` does), which repeats up to ``num_replicas - 1`` samples.

    Raises:
        SamplerError: invalid weights, counts, ranks or seed.
    """

    def __init__(
        self,
        weights: Sequence[float] | np.ndarray | torch.Tensor,
        num_samples: int | None = None,
        replacement: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        # DistributedSampler.__init__ is not called: it requires an initialised process group at
        # construction, and this sampler resolves rank and replica count when it is used.
        for name, flag in (("replacement", replacement), ("drop_last", drop_last)):
            check_bool(flag, f"DistributedWeightedSampler({name}=...)", error=SamplerError)
        self.weights = _as_weights(weights)
        self.replacement = replacement
        nonzero = int((self.weights > 0).sum())
        if num_samples is None:
            num_samples = len(self.weights) if self.replacement else nonzero
        check_int(num_samples, "DistributedWeightedSampler(num_samples=...)", error=SamplerError,
                  hint="It counts the samples per epoch across all replicas; None takes len(weights).")
        if not self.replacement and num_samples > nonzero:
            raise SamplerError(
                f"`num_samples={num_samples}` without replacement exceeds the {nonzero} indices with a "
                f"non-zero weight; lower `num_samples` or pass `replacement=True`."
            )
        check_int(seed, "DistributedWeightedSampler(seed=...)", minimum=None, error=SamplerError,
                  hint="Give the same seed on every rank.")
        self.total_size = num_samples
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle = True
        self.epoch = 0
        self._num_replicas = num_replicas
        self._rank = rank
        self._check_topology()
        self._position = 0  # indices yielded so far by the current iteration on this rank
        self._start = 0  # global offset the current iteration started from
        self._resume_offset: int | None = None
        self._weights_digest = hashlib.sha256(self.weights.numpy().tobytes()).hexdigest()[:16]

    # ------------------------------------------------------------------ topology
    @property
    def num_replicas(self) -> int:
        """Number of data-parallel replicas sharing the global sequence."""
        if self._num_replicas is not None:
            return self._num_replicas
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
        return 1

    @num_replicas.setter
    def num_replicas(self, value: int | None) -> None:
        self._num_replicas = value
        self._check_topology()

    @property
    def rank(self) -> int:
        """This replica's position among :attr:`num_replicas`."""
        if self._rank is not None:
            return self._rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return 0

    @rank.setter
    def rank(self, value: int | None) -> None:
        self._rank = value
        self._check_topology()

    def _check_topology(self) -> None:
        r = check_int(
            self._num_replicas, "DistributedWeightedSampler(num_replicas=...)", optional=True, error=SamplerError
        )
        k = check_int(self._rank, "DistributedWeightedSampler(rank=...)", minimum=0, optional=True, error=SamplerError)
        if r is not None and k is not None and k >= r:
            raise SamplerError(f"`rank={k}` is out of range for `num_replicas={r}`; use a rank in [0, {r - 1}].")

    @property
    def num_samples(self) -> int:
        """Samples this rank draws in a full epoch."""
        return _per_rank(self.total_size, self.num_replicas, self.drop_last)

    def __len__(self) -> int:
        return self.num_samples

    # ------------------------------------------------------------------ drawing
    def global_sequence(self, epoch: int | None = None) -> torch.Tensor:
        """The sequence all ranks share for ``epoch`` (default: the current epoch).

        Returns:
            An int64 tensor of ``num_samples`` (constructor value) dataset indices.
        """
        g = torch.Generator()
        g.manual_seed(_epoch_seed(self.seed, self.epoch if epoch is None else epoch))
        w = self.weights
        n = self.total_size
        if self.replacement:
            cdf = torch.cumsum(w, 0)
            u = torch.rand(n, generator=g, dtype=torch.float64) * cdf[-1]
            return torch.searchsorted(cdf, u, right=True).clamp_(max=len(w) - 1)
        # Efraimidis-Spirakis: the top-n keys log(u)/w are a weighted draw without replacement.
        u = 1.0 - torch.rand(len(w), generator=g, dtype=torch.float64)  # in (0, 1]: log(u) is finite
        keys = torch.where(w > 0, torch.log(u) / w, torch.full_like(w, -float("inf")))
        return torch.topk(keys, n, sorted=True).indices

    def __iter__(self) -> Iterator[int]:
        replicas, rank = self.num_replicas, self.rank
        if rank >= replicas:
            raise SamplerError(
                f"`rank={rank}` is out of range for `num_replicas={replicas}`; set both from the same "
                f"data-parallel group."
            )
        start = self._resume_offset or 0
        self._resume_offset = None
        seq = self.global_sequence()[start:]
        if self.drop_last:
            seq = seq[: (len(seq) // replicas) * replicas]
        else:
            pad = (-len(seq)) % replicas
            if pad and len(seq):
                seq = torch.cat([seq, seq.repeat(pad // len(seq) + 1)[:pad]])
        shard = seq[rank::replicas].tolist()
        self._start, self._position = start, 0
        return self._yield(shard)

    def _yield(self, shard: list[int]) -> Iterator[int]:
        for index in shard:
            self._position += 1
            yield index

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's sequence; call it with the same value on every rank.

        A position restored by :meth:`load_state_dict` for this same epoch is kept, so resuming
        works whether or not the training loop calls ``set_epoch`` before iterating.
        """
        if epoch != self.epoch:
            self._resume_offset = None
        self.epoch = epoch
        self._start = self._position = 0

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Where this sampler stands: epoch and global position inside the epoch.

        The position counts indices handed out by the current iteration; a ``DataLoader`` with
        workers prefetches, so save the state of a loader that tracks what it consumed (for
        example torchdata's ``StatefulDataLoader``), or save between epochs.
        """
        if self._resume_offset is not None:
            consumed = self._resume_offset
        else:
            consumed = min(self.total_size, self._start + self._position * self.num_replicas)
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "global_position": consumed,
            "num_samples": self.total_size,
            "replacement": self.replacement,
            "weights_digest": self._weights_digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration continues the saved epoch from the saved position.

        The replica count may differ from the saved run: the rest of the epoch's global sequence
        is sharded over the current replicas.

        Raises:
            SamplerError: the state was saved with other weights, ``num_samples`` or ``replacement``.
        """
        for key, mine in (
            ("num_samples", self.total_size),
            ("replacement", self.replacement),
            ("weights_digest", self._weights_digest),
        ):
            if state.get(key) != mine:
                raise SamplerError(
                    f"Sampler state has {key}={state.get(key)!r} but this sampler has {mine!r}; "
                    f"resume with the sampler configured as when the state was saved, or do not load it."
                )
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self._resume_offset = int(state["global_position"])
        self._position = 0


def _per_rank(total: int, replicas: int, drop_last: bool) -> int:
    return total // replicas if drop_last else -(-total // replicas)


def _as_weights(weights: Any) -> torch.Tensor:
    try:
        w = torch.as_tensor(
            np.asarray(weights, dtype=np.float64) if not isinstance(weights, torch.Tensor) else weights.detach().cpu(),
            dtype=torch.float64,
        )
    except (TypeError, ValueError) as e:
        raise SamplerError(f"`weights` of type {type(weights).__name__} cannot be read as numbers: {e}.") from None
    if w.dim() != 1 or len(w) == 0:
        raise SamplerError(
            f"`weights` has shape {tuple(w.shape)}; give one weight per dataset index (a non-empty 1-D sequence)."
        )
    bad = ~torch.isfinite(w) | (w < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise SamplerError(f"`weights[{i}]` is {float(w[i])!r}; weights must be finite and >= 0.")
    if not float(w.sum()) > 0:
        raise SamplerError("`weights` are all zero; at least one index needs a positive weight.")
    return w.contiguous()


def pin_wrapped_generator(dataloader: Any, seed: int) -> bool:
    """Give the sampler inside Lightning's ``DistributedSamplerWrapper`` a generator of its own, seeded ``seed``.

    The wrapper shards one sequence that must be identical on every rank. A sampler without a generator
    (a plain ``WeightedRandomSampler``) draws that sequence from torch's global RNG at the start of each
    epoch, and the ranks of a pipeline consume the global RNG differently (dropout lives on some stages
    only): from the second epoch on, the stages of one replica would draw different samples. With its
    own generator, seeded alike on every rank and used by nothing else, the sequence stays the same on
    every rank in every epoch. A sampler that has a generator is left as it is.

    Args:
        dataloader: A dataloader after Lightning injected its distributed sampler.
        seed: The seed, the same on every rank.

    Returns:
        Whether a generator was given.
    """
    try:
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    except ImportError:  # Lightning absent: nothing wrapped the sampler
        return False
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    sampler = (
        getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(dataloader, "sampler", None)
    )
    if not isinstance(sampler, DistributedSamplerWrapper):
        return False
    inner = getattr(sampler.dataset, "_sampler", None)
    if inner is None or not hasattr(inner, "generator") or inner.generator is not None:
        return False
    inner.generator = torch.Generator().manual_seed(seed)
    return True
