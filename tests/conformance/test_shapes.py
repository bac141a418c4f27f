"""Batches whose shapes change: token sequences padded to each batch's longest, evaluation batches of another size
and length range (tests/conformance/shape_scenarios.py). On every rank of pp=2 and pp=2 × dp=2, what the Trainer
and the module hold equals one process under Lightning's default strategy: every step's loss, every logged value,
the final parameters, what ``test`` returns and what ``predict`` gives, on the sequential and the traced frontend,
for a plain model and a transformers Llama fed attention masks; and a loss averaged over the batch's tokens
equals one process's when it is declared with ``HPPStrategy(loss_weight=...)``.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.conformance import compare
from tests.conformance.compare import close, diff_all, diff_metric_lists, load, report
from tests.conformance.harness import GLOBAL_BATCH
from tests.conformance.shape_scenarios import BUCKET, TRAIN, TokenSeqs, pad_batch

pytestmark = pytest.mark.slow


def check(problems: list[str]) -> None:
    assert not problems, report(problems)


def replica_losses(outcome) -> list[str]:
    """dp = 2: the loss ``on_train_batch_end`` receives is the replica's own, as under DDP (its rows of the reference
    batch, :class:`~tests.conformance.shape_scenarios.TokenProbe`)."""
    problems = []
    for r in outcome.ranks:
        if r.layout.dp == 1:
            continue
        for i, (step, want) in enumerate(zip(r.result["steps"], outcome.ref["probe"])):
            if not close(step["loss"], want[r.replica]):
                problems.append(f"{r.where} batch {i}: loss {step['loss']:.7g} "
                                f"(replica {r.replica}: {want[r.replica]:.7g})")
    return problems


def entry_points(outcome) -> list[str]:
    """What ``trainer.test`` returned, and each replica's predictions (its share of the samples, in order)."""
    problems = []
    for r in outcome.ranks:
        problems += diff_metric_lists(r.where, "test", r.result["test"], outcome.ref["test"])
        got, want = r.result["predictions"], outcome.ref["predictions"][r.layout.dp][r.replica]
        if len(got) != len(want):
            problems.append(f"{r.where}: {len(got)} prediction batches (reference {len(want)})")
            continue
        for i, (g, w) in enumerate(zip(got, want)):  # relative to the batch's largest logit: some are near 0
            atol = max(compare.PARAM_REL * float(w.abs().max()), compare.PARAM_ABS)
            if g.shape != w.shape or not torch.allclose(g, w, rtol=compare.PARAM_REL, atol=atol):
                err = float((g - w).abs().max()) if g.shape == w.shape else float("nan")
                problems.append(f"{r.where}: prediction batch {i} differs by up to {err:.3g} ({tuple(g.shape)} vs "
                                f"{tuple(w.shape)}; largest logit {float(w.abs().max()):.3g})")
    return problems


def reference_lengths(epochs: int = 2, multiple_of: int = 1) -> list[int]:
    """The length each training batch of the reference is padded to, over ``epochs`` epochs."""
    ds = TokenSeqs(**TRAIN)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True,
                        collate_fn=functools.partial(pad_batch, multiple_of=multiple_of))
    lengths = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        lengths += [b["input_ids"].shape[1] for b in loader]
    return lengths


def test_the_training_batches_change_length():
    """The premise: the reference's training batches, in its order, are padded to many different lengths."""
    lengths = reference_lengths()
    assert len(set(lengths)) >= 5 and sum(a != b for a, b in itertools.pairwise(lengths)) >= 12, lengths


def test_sequential_frontend_fits_validates_tests_and_predicts_on_changing_lengths(conformance):
    o = load(conformance, "shapes_sequential")
    assert len(o.ref["steps"]) == 24 and len(o.ref["validations"]) == 2
    # PipelineTelemetry's values (pipeline/...) are the pipeline's own; everything Lightning holds is compared
    check(diff_all(o, skip=("pipeline/",)) + replica_losses(o) + entry_points(o))


def test_telemetry_shows_the_steps_with_new_shapes(conformance):
    # pp = 2: each step whose batch length was not seen before hands its shapes over in band (the first step infers
    # them as torch does); a length seen before, in the first epoch or the second, reuses what was recorded
    o = load(conformance, "shapes_sequential")
    lengths = reference_lengths()
    want = [float(i > 0 and n not in lengths[:i]) for i, n in enumerate(lengths)]
    for r in o.layout("pp2"):
        steps = r.result["shapes"]
        assert [s[0] for s in steps] == list(range(len(lengths))), r.where
        assert [s[1] for s in steps] == want, (r.where, lengths)
        grown = [s[3] for s in steps if s[3] > 0]  # receive buffers grow only for a length longer than any before
        longer = [i for i, n in enumerate(lengths) if i > 0 and n > max(lengths[:i])]
        assert len(grown) == len(longer), (r.where, grown, longer)
        assert all(s[2] > 0 for s in steps if s[1]), r.where


def test_traced_frontend_with_a_token_mean_loss(conformance):
    # the loss averages over each batch's tokens, whose number differs between micro-batches; with
    # loss_weight the micro-batches weigh by their tokens (over both replicas' on dp = 2), as one process averages
    o = load(conformance, "shapes_traced_tokens")
    check(diff_all(o) + replica_losses(o))


def test_llama_with_attention_masks_and_a_token_mean_loss(conformance, monkeypatch):
    # a transformers decoder: 1e-4 relative (its attention and norms sum in other orders on other lengths)
    for name, value in (("REL", 1e-4), ("ABS", 1e-6), ("PARAM_REL", 1e-4), ("PARAM_ABS", 1e-5)):
        monkeypatch.setattr(compare, name, value)
    o = load(conformance, "shapes_llama_tokens")
    assert len(o.ref["steps"]) == 12
    check(diff_all(o) + replica_losses(o) + entry_points(o))


def test_bucketed_lengths_hand_each_bucket_over_once_and_capture_once(conformance):
    # pad_to_multiple_of=8: the training batches fall into two buckets; each bucket's shapes are handed over the
    # first time it comes (the first step infers them), every later batch of it reuses them, and the traced frontend
    # captures once per mode (training, evaluation) for every bucket, on every rank
    o = load(conformance, "shapes_traced_buckets")
    check(diff_all(o, skip=("pipeline/",)) + replica_losses(o))
    lengths = reference_lengths(epochs=1, multiple_of=BUCKET)
    assert sorted(set(lengths)) == [BUCKET, 2 * BUCKET], lengths
    want = [float(i > 0 and n not in lengths[:i]) for i, n in enumerate(lengths)]
    for r in o.layout("pp2"):
        assert [s[1] for s in r.result["shapes"]] == want, (r.where, lengths)
    for r in o.ranks:
        assert r.result["exports"] == 2, (r.where, r.result["exports"])
