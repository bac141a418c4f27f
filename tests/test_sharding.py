"""Sharded stages (``ShardingOptions``): the option section refused early with value, context and fix, and
accepted as a section or a dict like the others."""

from __future__ import annotations

import pytest

from lightning_hpp import HPPStrategy, PlanError, ShardingOptions
from lightning_hpp.errors import ShardingError


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ShardingOptions(data_parallel="zero3"),
         r"`ShardingOptions\(data_parallel='zero3'\)`.*'ddp', 'fsdp', 'hsdp'"),
        (lambda: ShardingOptions(tp_degree=0), r"`ShardingOptions\(tp_degree=0\)`: must be a positive integer"),
        (lambda: ShardingOptions(tp_degree="2"), r"`ShardingOptions\(tp_degree='2'\)`"),
        (lambda: ShardingOptions(data_parallel="fsdp", reshard_after_forward="no"),
         r"`ShardingOptions\(reshard_after_forward='no'\)`: must be True, False or None"),
        (lambda: ShardingOptions(data_parallel="hsdp"),
         r"data_parallel='hsdp'.*`dp_replicate` is not set.*dp_replicate=2"),
        (lambda: ShardingOptions(data_parallel="fsdp", dp_replicate=2),
         r"`ShardingOptions\(dp_replicate=2\)` applies to data_parallel='hsdp' only.*Drop `dp_replicate`"),
        (lambda: ShardingOptions(data_parallel="hsdp", dp_replicate=0), r"`ShardingOptions\(dp_replicate=0\)`"),
        (lambda: ShardingOptions(reshard_after_forward=True),
         r"`ShardingOptions\(reshard_after_forward=True\)` applies to sharded stages.*data_parallel='ddp'"),
        (lambda: HPPStrategy(sharding={"data_parallel": "fsdp", "shards": 2}),
         r"`HPPStrategy\(sharding=...\)` has unknown keys \['shards'\]; `ShardingOptions` takes"),
        (lambda: HPPStrategy(sharding="fsdp"), r"`HPPStrategy\(sharding='fsdp'\)`: pass a `ShardingOptions\(...\)`"),
        (lambda: HPPStrategy(sharding={"data_parallel": "hsdp"}), r"`dp_replicate` is not set"),
    ],
)
def test_bad_sharding_options_are_refused_at_construction(build, message):
    with pytest.raises(ShardingError, match=message) as info:
        build()
    assert isinstance(info.value, PlanError)  # a plan error like every other layout error


def test_sharding_is_taken_as_a_section_or_a_dict():
    assert HPPStrategy()._sharding == ShardingOptions()
    assert HPPStrategy(sharding={"data_parallel": "fsdp"})._sharding == ShardingOptions(data_parallel="fsdp")
    given = ShardingOptions(data_parallel="hsdp", dp_replicate=2, reshard_after_forward=True)
    assert HPPStrategy(sharding=given)._sharding is given
    assert not ShardingOptions().sharded and ShardingOptions(data_parallel="fsdp").sharded


@pytest.mark.parametrize("options, dp, dims", [
    (ShardingOptions(), 4, (4, 1)),
    (ShardingOptions(data_parallel="fsdp"), 4, (1, 4)),
    (ShardingOptions(data_parallel="hsdp", dp_replicate=2), 4, (2, 2)),
    (ShardingOptions(data_parallel="hsdp", dp_replicate=1), 2, (1, 2)),
])
def test_the_data_parallel_shape_rule(options, dp, dims):
    assert options.dp_dims(dp) == dims


def test_hsdp_replicas_that_do_not_split_evenly_are_refused():
    with pytest.raises(ShardingError, match=r"dp_replicate=2\)`: each stage has 3 replicas.*divides 3 \(\[1, 3\]\)"):
        ShardingOptions(data_parallel="hsdp", dp_replicate=2).dp_dims(3)
