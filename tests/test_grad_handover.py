"""The gradient hand-over's overlap: buckets start their all-reduce inside the stage's last backward, only
once their gradients are final, in a fixed order, and the result is the dp average either way.

In one process over a one-rank gloo group told it has two replicas: the all-reduce is then the identity
and the division by two shows, so what reached each collective, and when, can be checked exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hpp.pipeline import grads as grads_mod
from lightning_hpp.pipeline.grads import GradHandover


@pytest.fixture(scope="module")
def group():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


@pytest.fixture
def started(monkeypatch):
    """Every all-reduce the hand-over starts: (a copy of the tensor at that moment, the tensor)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append((tensor.detach().clone(), tensor))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(grads_mod.dist, "all_reduce", spy)
    return seen


def _model() -> nn.Module:
    torch.manual_seed(0)
    # a large weight (a bucket of its own, reduced in place) and small tensors (flattened buckets)
    return nn.Sequential(nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 7), nn.Tanh(), nn.Linear(7, 3))


def _batches():
    torch.manual_seed(1)
    return [torch.randn(4, 300) for _ in range(2)]


def _expected(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients of both micro-batches, summed (no dp average)."""
    ref = _model()
    ref.load_state_dict(model.state_dict())
    for x in batches:
        ref(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _warmed(handover: GradHandover, model: nn.Module, started: list) -> GradHandover:
    """After the first step, which only watches how often each gradient accumulates in the last backward."""
    _step(model, handover, _batches())
    assert started == []  # nothing starts early in the first step
    handover.hand_over()
    started.clear()
    for p in model.parameters():
        p.grad = None
    return handover


def _step(model: nn.Module, handover: GradHandover, batches: list[torch.Tensor], **kw) -> None:
    with handover.during_step(**kw):
        for i, x in enumerate(batches):
            loss = model(x).square().sum()
            if i == len(batches) - 1:
                with handover.last_backward(0):
                    loss.backward()
            else:
                loss.backward()


def _bucket_values(handover: GradHandover, model: nn.Module, expected: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What each bucket must send: its members' final gradients, flattened in bucket order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [torch.cat([expected[names[id(handover.params[i])]].flatten() for i in b]) for b in handover._buckets]


def test_buckets_start_inside_the_last_backward_once_final(group, started):
    model = _model()
    handover = _warmed(GradHandover({0: model}, group, 2, bucket_numel=8), model, started)  # small buckets: several
    batches = _batches()
    expected = _expected(model, batches)
    _step(model, handover, batches)
    n_started = len(started)
    assert n_started == len(handover._buckets) > 3  # every bucket started during the backward
    # in bucket order, each with its members' final gradients (both micro-batches), none with a partial one
    for (sent, _), want in zip(started, _bucket_values(handover, model, expected)):
        assert torch.equal(sent.flatten(), want)
    handover.hand_over()
    assert handover.started_in_backward == n_started
    assert len(started) == n_started  # nothing left for the hand-over to start
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n] / 2, rtol=0, atol=0)


def test_outside_the_window_nothing_starts_before_the_hand_over(group, started):
    model = _model()
    handover = GradHandover({0: model}, group, 2, bucket_numel=8)
    batches = _batches()
    expected = _expected(model, batches)
    with handover.during_step():
        for x in batches:
            model(x).square().sum().backward()
    assert started == []
    handover.hand_over()
    gradients = [c for c, _ in started if c.is_floating_point()]  # (the first step's watch also ends in one collective)
    assert handover.started_in_backward == 0 and len(gradients) == len(handover._buckets)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n] / 2, rtol=0, atol=0)


def test_a_parameter_without_gradient_holds_back_later_buckets_to_the_hand_over(group, started):
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()
            self.unused = nn.Linear(2, 2)  # registered last: its bucket comes first in reverse order

        def forward(self, x):
            return self.net(x)

    model = WithUnused()
    handover = _warmed(GradHandover({0: model}, group, 2, bucket_numel=8), model, started)
    batches = _batches()
    expected = _expected(model.net, batches)
    _step(model, handover, batches)
    assert started == []  # the first bucket never became final, and buckets start in order
    handover.hand_over()
    assert handover.started_in_backward == 0 and len(started) == len(handover._buckets)  # all at the hand-over
    for n, p in model.named_parameters():
        if n.startswith("unused"):
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, expected[n.removeprefix("net.")] / 2, rtol=0, atol=0)


def test_local_norms_are_taken_before_the_all_reduce_and_held_gradients_accumulate(group, started):
    model = _model()
    handover = _warmed(GradHandover({0: model}, group, 2, bucket_numel=8), model, started)
    batches = _batches()
    expected = _expected(model, batches)
    held = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = held[n].clone()
    _step(model, handover, batches, keep_held=True, local_norms=True)
    norms = handover.hand_over(local_norms=True)
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected.values()]).double())
    torch.testing.assert_close(norms[0], want, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, held[n] + expected[n] / 2, rtol=1e-6, atol=1e-7)


def test_a_parameter_of_two_local_stages_is_reduced_after_both(group, started):
    torch.manual_seed(0)
    shared = nn.Linear(5, 5)
    a, b = nn.Sequential(shared, nn.Tanh(), nn.Linear(5, 5)), nn.Sequential(nn.Linear(5, 5), nn.Tanh(), shared)
    whole = nn.Sequential(a, b)
    handover = GradHandover({0: a, 1: b}, group, 2, bucket_numel=1)
    handover._observing = False  # (the first step's watching is tested on its own)
    x = torch.randn(3, 5)
    ref = nn.Sequential(nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5)),
                        nn.Sequential(nn.Linear(5, 5), nn.Tanh()))
    with torch.no_grad():
        for dst, src in zip(ref.parameters(), [*a.parameters(), *list(b.parameters())[:2]]):
            dst.copy_(src)
    out = ref[0][0](ref[1](ref[0](x)))  # the tied weight applied again, as stage 1's last module
    out.square().sum().backward()
    expected = {"a0": (ref[0][0].weight.grad, ref[0][0].bias.grad)}
    with handover.during_step():
        loss = whole(x).square().sum()
        with handover.last_backward(1), handover.last_backward(0):
            loss.backward()
    shared_buckets = [k for k, bucket in enumerate(handover._buckets)
                      if any(handover.params[i] is shared.weight or handover.params[i] is shared.bias for i in bucket)]
    assert shared_buckets == list(range(len(handover._buckets) - len(shared_buckets), len(handover._buckets)))
    assert len(started) == len(handover._buckets) - len(shared_buckets)  # the shared ones wait for the hand-over
    handover.hand_over()
    torch.testing.assert_close(shared.weight.grad, expected["a0"][0] / 2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(shared.bias.grad, expected["a0"][1] / 2, rtol=1e-6, atol=1e-7)
    for mine, theirs in zip([*list(a.parameters())[2:], *list(b.parameters())[:2]],
                            [*list(ref[0][2].parameters()), *list(ref[1][0].parameters())]):
        torch.testing.assert_close(mine.grad, theirs.grad / 2, rtol=1e-6, atol=1e-7)


def test_a_gradient_accumulated_twice_in_one_backward_waits_for_the_hand_over(group, started):
    from torch.utils.checkpoint import checkpoint

    class Reentrant(nn.Module):  # one weight inside a reentrant checkpoint and outside it: two accumulations
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.shared, self.head = nn.Linear(6, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.head(self.shared(checkpoint(self.shared, x, use_reentrant=True)))

    model = Reentrant()
    handover = GradHandover({0: model}, group, 2, bucket_numel=1)
    x = torch.randn(4, 6, requires_grad=True)  # a reentrant checkpoint needs an input that requires grad

    def step():
        with handover.during_step():
            out = model(x).square().sum()
            with handover.last_backward(0):
                out.backward()

    step()
    assert started == []
    handover.hand_over()
    # the watched step found shared.weight and shared.bias accumulated twice: their buckets go last, after the hand-over
    late = {id(model.shared.weight), id(model.shared.bias)}
    tail = [handover.params[i] for b in handover._buckets[-2:] for i in b]
    assert {id(p) for p in tail} == late
    for p in model.parameters():
        p.grad = None
    started.clear()
    ref = Reentrant()
    ref(x).square().sum().backward()
    step()
    assert len(started) == len(handover._buckets) - 2  # the head's buckets started inside the backward
    handover.hand_over()
    for mine, theirs in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad / 2, rtol=1e-6, atol=1e-7)
