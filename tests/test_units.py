"""The sequential-forward check names the first unit where forward departs from the chain."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from lightning_hpp.errors import MicroBatchError, ScheduleError, SequentialForwardError
from lightning_hpp.model.sequential import check_sequential_forward
from lightning_hpp.model.units import find_units
from lightning_hpp.pipeline.microbatch import batch_size_of, largest_divisor_at_most, split_batch
from lightning_hpp.pipeline.schedules import check_schedule


class Chain(nn.Module):
    def __init__(self, tweak: str = ""):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)
        self.tweak = tweak

    def forward(self, x):
        if self.tweak == "pre":
            x = x * 2
        h = self.a(x)
        if self.tweak == "between":
            h = torch.relu(h)
        h = self.b(h)
        if self.tweak == "skip":
            h = h + x
        out = self.c(h)
        if self.tweak == "post":
            out = out.softmax(-1)
        if self.tweak == "order":
            out = self.c(self.a(self.b(x)))
        return out


def test_sequential_forward_passes_and_keeps_rng_and_mode():
    m = Chain()
    m.train()
    x = torch.randn(3, 4)
    state = torch.random.get_rng_state()
    check_sequential_forward(m, find_units(m), (x,), boundaries=[0, 1])
    assert torch.equal(state, torch.random.get_rng_state())
    assert m.training


@pytest.mark.parametrize(
    "tweak, message",
    [
        ("between", "not sequential at unit 'b'"),
        ("skip", "not sequential at unit 'c'"),
        ("pre", "transforms its input before the first unit 'a'"),
        ("post", "changes the output of the last unit 'c'"),
        ("order", "calls the units in the order"),
    ],
)
def test_non_sequential_forward_names_the_unit(tweak, message):
    m = Chain(tweak)
    with pytest.raises(SequentialForwardError, match=message):
        check_sequential_forward(m, find_units(m), (torch.randn(3, 4),))


def test_integer_tensor_at_a_boundary_is_refused():
    class ToInt(nn.Module):
        def forward(self, x):
            return x.argmax(-1)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = ToInt()
            self.c = nn.Embedding(4, 2)

        def forward(self, x):
            return self.c(self.b(self.a(x)))

    m = M()
    check_sequential_forward(m, find_units(m), (torch.randn(3, 4),), boundaries=[0])
    with pytest.raises(SequentialForwardError,
                       match=r"boundary after unit 'b' carries Tensor\(shape=\(3,\), dtype=torch.int64\)"):
        check_sequential_forward(m, find_units(m), (torch.randn(3, 4),), boundaries=[1])


def test_split_batch_nested_structures():
    batch = {"x": torch.arange(8).view(8, 1), "pair": (torch.zeros(8, 2), [torch.ones(8)]), "tag": "t"}
    parts = split_batch(batch, 4)
    assert len(parts) == 4
    assert torch.equal(parts[1]["x"], torch.tensor([[2], [3]]))
    assert parts[3]["pair"][1][0].shape == (2,)
    assert parts[2]["tag"] == "t"
    assert batch_size_of(batch) == 8
    assert largest_divisor_at_most(10, 4) == 2


def test_split_batch_keeps_container_types_and_splits_inside_subclasses():
    # what torch pipelining's pytree split does not: a dict subclass would be one leaf, copied whole
    class Features(dict):
        pass

    Pair = collections.namedtuple("Pair", "x y")
    batch = Features(pair=Pair(torch.arange(6), "label"), rest=[torch.arange(6).view(6, 1)])
    parts = split_batch(batch, 3)
    assert [type(p) for p in parts] == [Features] * 3 and all(type(p["pair"]) is Pair for p in parts)
    assert torch.equal(parts[2]["pair"].x, torch.tensor([4, 5])) and parts[2]["pair"].y == "label"
    assert torch.equal(parts[1]["rest"][0], torch.tensor([[2], [3]]))


def test_split_batch_errors():
    with pytest.raises(MicroBatchError, match="Batch size 10 is not divisible by n_microbatches=4"):
        split_batch((torch.zeros(10, 2), torch.zeros(10)), 4)
    with pytest.raises(MicroBatchError, match="different sizes along dim 0: \\[3, 4\\]"):
        batch_size_of((torch.zeros(4), torch.zeros(3)))
    with pytest.raises(MicroBatchError, match="holds no tensor"):
        batch_size_of({"a": 1})


@pytest.mark.parametrize(
    "args, message",
    [
        (("pipedream", 2, 2, 4), "Unknown schedule 'pipedream'. Valid schedules: gpipe, 1f1b, interleaved1f1b"),
        (("1f1b", 3, 3, 2), "at least as many micro-batches as stages: n_microbatches=2 < 3"),
        (("1f1b", 3, 2, 4), "runs one stage per rank, but the plan has 3 stages and pp_degree=2"),
        (("interleaved1f1b", 3, 2, 4), "must be a multiple \\(>= 2x\\) of pp_degree=2"),
        (("zbv", 6, 2, 4), "needs exactly 2 stages per rank"),
        (("interleaved1f1b", 4, 2, 5), "multiple of the number of rounds"),
        (("gpipe", 2, 2, 0), "positive integer"),
    ],
)
def test_schedule_errors(args, message):
    with pytest.raises(ScheduleError, match=message):
        check_schedule(*args)


def test_valid_schedules_pass():
    assert check_schedule("gpipe", 2, 2, 1).multi is False
    assert check_schedule("interleaved1f1b", 4, 2, 4).style == "loop"
    assert check_schedule("zbv", 4, 2, 4).style == "v"
