"""DistributedWeightedSampler: sharding, distribution, epochs, determinism, resume, Lightning."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_hpp.bias.samplers import DistributedWeightedSampler
from lightning_hpp.errors import SamplerError


def shards(weights, world, **kw) -> list[list[int]]:
    return [list(DistributedWeightedSampler(weights, num_replicas=world, rank=r, **kw)) for r in range(world)]


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


@pytest.fixture
def weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.rand(40, generator=g) + 0.05
    w[:4] *= 20  # a few heavy samples, as in the field report
    return w


def test_without_replacement_ranks_are_disjoint_and_cover_everything(weights):
    parts = shards(weights, 4, replacement=False, seed=1)
    assert [len(p) for p in parts] == [10] * 4
    for a, b in itertools.combinations(parts, 2):
        assert not set(a) & set(b)
    assert sorted(itertools.chain(*parts)) == list(range(40))


def test_without_replacement_subset_follows_the_weights(weights):
    # Drawing one sample without replacement picks index i with probability w_i / sum(w).
    s = DistributedWeightedSampler(weights, num_samples=1, replacement=False, num_replicas=1, rank=0)
    counts = np.zeros(40)
    for epoch in range(4000):
        counts[int(s.global_sequence(epoch)[0])] += 1
    p = (weights / weights.sum()).numpy()
    assert tv(counts, p) < 0.05
    # A zero weight is never drawn, even when every other index is.
    w = weights.clone()
    w[7] = 0
    drawn = set(itertools.chain(*shards(w, 3, replacement=False, drop_last=True)))
    assert 7 not in drawn and len(drawn) == 39


def test_with_replacement_streams_are_independent_and_follow_the_weights(weights):
    parts = shards(weights, 4, num_samples=40_000, seed=5)
    p = (weights / weights.sum()).numpy()
    for part in parts:  # every rank's marginal is the weighted distribution
        counts = np.bincount(part, minlength=40).astype(float)
        assert tv(counts, p) < 0.03
        chi2 = float((((counts - counts.sum() * p) ** 2) / (counts.sum() * p)).sum())
        assert chi2 < 73.4  # chi-square, 39 degrees of freedom, p = 0.001
    # Independent streams agree position by position about as often as chance, sum(p^2).
    agree = np.mean([np.mean(np.array(a) == np.array(b)) for a, b in itertools.combinations(parts, 2)])
    assert abs(agree - float((p**2).sum())) < 0.01
    assert agree < 0.2  # and certainly not the identical sequences of the field report's bug


def test_field_report_bug_for_contrast(weights):
    # WeightedRandomSampler without a generator draws the same sequence on every rank when each
    # rank starts from the same seed (seed_everything): what the sampler above avoids.
    seqs = []
    for _ in range(2):
        torch.manual_seed(0)
        seqs.append(list(WeightedRandomSampler(weights, 40)))
    assert seqs[0] == seqs[1]


def test_epochs_seeds_and_determinism(weights):
    s = DistributedWeightedSampler(weights, num_replicas=2, rank=1, seed=3)
    e0 = list(s)
    assert list(s) == e0  # same epoch, same order
    s.set_epoch(1)
    e1 = list(s)
    assert e1 != e0
    again = DistributedWeightedSampler(weights, num_replicas=2, rank=1, seed=3)
    again.set_epoch(1)
    assert list(again) == e1  # deterministic from (seed, epoch)
    assert list(DistributedWeightedSampler(weights, num_replicas=2, rank=1, seed=4)) != e0
    # (seed=0, epoch=1) and (seed=1, epoch=0) are different sequences.
    a = DistributedWeightedSampler(weights, seed=0, num_replicas=1, rank=0)
    a.set_epoch(1)
    assert list(a) != list(DistributedWeightedSampler(weights, seed=1, num_replicas=1, rank=0))


def test_padding_and_drop_last(weights):
    parts = shards(weights[:10], 4, replacement=False)  # 10 samples over 4 ranks
    assert [len(p) for p in parts] == [3] * 4
    assert set(itertools.chain(*parts)) == set(range(10))
    dropped = shards(weights[:10], 4, replacement=False, drop_last=True)
    assert [len(p) for p in dropped] == [2] * 4
    flat = list(itertools.chain(*dropped))
    assert len(set(flat)) == len(flat) == 8
    assert len(DistributedWeightedSampler(weights[:10], num_replicas=4, rank=0, drop_last=True)) == 2


@pytest.mark.parametrize("replacement", [True, False])
def test_resume_mid_epoch(weights, replacement):
    s = DistributedWeightedSampler(weights, replacement=replacement, num_replicas=2, rank=1, seed=9)
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(7)]
    state = s.state_dict()
    tail = list(it)
    resumed = DistributedWeightedSampler(weights, replacement=replacement, num_replicas=2, rank=1, seed=0)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # Lightning calls set_epoch at the start of the resumed epoch
    assert resumed.seed == 9 and list(resumed) == tail
    fresh = DistributedWeightedSampler(weights, replacement=replacement, num_replicas=2, rank=1, seed=9)
    fresh.set_epoch(2)
    assert head + tail == list(fresh)
    resumed.set_epoch(3)  # the next epoch starts from its beginning
    assert len(list(resumed)) == len(s)


def test_resume_with_a_different_number_of_replicas(weights):
    old = [DistributedWeightedSampler(weights, replacement=False, num_replicas=2, rank=r) for r in range(2)]
    iters = [iter(s) for s in old]
    seen = [next(it) for it in iters for _ in range(5)]
    state = old[0].state_dict()
    assert state["global_position"] == 10
    new = [DistributedWeightedSampler(weights, replacement=False, num_replicas=3, rank=r) for r in range(3)]
    for s in new:
        s.load_state_dict(state)
    rest = list(itertools.chain(*[list(s) for s in new]))
    assert set(seen) | set(rest) == set(range(40))  # the epoch completes every sample
    assert not set(seen) & set(rest) and len(set(rest)) == 30


def test_rank_and_replicas_follow_torch_distributed_when_not_given(weights):
    s = DistributedWeightedSampler(weights)
    assert (s.num_replicas, s.rank) == (1, 0)  # no process group
    s.num_replicas, s.rank = 4, 3  # what a strategy with its own data-parallel group assigns
    assert list(s) == shards(weights, 4)[3]


def test_lightning_leaves_it_in_place_and_wraps_weighted_random_sampler(weights):
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    connector = trainer._data_connector
    ds = TensorDataset(torch.arange(40))
    ours = DataLoader(ds, batch_size=4, sampler=DistributedWeightedSampler(weights))
    theirs = DataLoader(ds, batch_size=4, sampler=WeightedRandomSampler(weights, 40))
    assert isinstance(ours.sampler, DistributedSampler)
    assert connector._requires_distributed_sampler(ours) is False
    assert connector._requires_distributed_sampler(theirs) is True


def test_bad_input(weights):
    with pytest.raises(SamplerError, match=r"`weights\[2\]` is -1.0"):
        DistributedWeightedSampler([1.0, 2.0, -1.0])
    with pytest.raises(SamplerError, match="all zero"):
        DistributedWeightedSampler([0.0, 0.0])
    with pytest.raises(SamplerError, match=r"shape \(2, 2\)"):
        DistributedWeightedSampler(torch.ones(2, 2))
    with pytest.raises(SamplerError, match="exceeds the 2 indices with a non-zero weight"):
        DistributedWeightedSampler([1.0, 0.0, 1.0], num_samples=3, replacement=False)
    with pytest.raises(SamplerError, match=r"`rank=2` is out of range for `num_replicas=2`"):
        DistributedWeightedSampler(weights, num_replicas=2, rank=2)
    with pytest.raises(SamplerError,
                       match=r"`DistributedWeightedSampler\(num_samples=0\)`: must be a positive integer"):
        DistributedWeightedSampler(weights, num_samples=0)
    state = DistributedWeightedSampler(weights).state_dict()
    with pytest.raises(SamplerError, match="weights_digest"):
        DistributedWeightedSampler(weights * 2 + 1).load_state_dict(state)
    assert issubclass(SamplerError, ValueError)
