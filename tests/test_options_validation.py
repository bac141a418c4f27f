"""Every option is validated when it is given: the wrong type or value (strings where booleans or
numbers belong included) is refused with an error naming the value, the context and the fix."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest

from lightning_hpp import HPPPrecision, HPPStrategy, PlanError, StagePlan
from lightning_hpp.bias.samplers import DistributedWeightedSampler, SamplerError
from lightning_hpp.errors import BiasConfigError, CheckpointError, PlacementError
from lightning_hpp.options import BiasOptions, CheckpointOptions, PlacementOptions


@pytest.mark.parametrize("value", ["ten minutes", "600", -5, 0, True, timedelta(seconds=-1)])
def test_timeout_must_be_positive_seconds_or_a_timedelta(value):
    with pytest.raises(
        PlanError,
        match=rf"`HPPStrategy\(timeout={re.escape(repr(value))}\)`: use a positive number of seconds or a "
        rf"`datetime.timedelta`, e.g. `timeout=600`",
    ):
        HPPStrategy(timeout=value)


def test_timeout_in_seconds_or_as_timedelta_is_taken():
    assert HPPStrategy(timeout=7.5)._timeout == timedelta(seconds=7.5)
    assert HPPStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)


@pytest.mark.parametrize(
    "build, message, error",
    [
        (
            lambda: BiasOptions(deterministic="no"),
            r"`BiasOptions\(deterministic='no'\)`: must be True or False \(not a str\)",
            BiasConfigError,
        ),
        (
            lambda: HPPStrategy(bias={"deterministic": "no"}),
            r"`BiasOptions\(deterministic='no'\)`: must be True or False",
            BiasConfigError,
        ),
        (
            lambda: CheckpointOptions(dir="x", async_save="false"),
            r"`CheckpointOptions\(async_save='false'\)`: must be True or False",
            CheckpointError,
        ),
        (
            lambda: HPPStrategy(activation_checkpointing="yes"),
            r"`HPPStrategy\(activation_checkpointing='yes'\)`: must be True or False",
            PlanError,
        ),
        (
            lambda: DistributedWeightedSampler([1.0, 2.0], replacement="false"),
            r"`DistributedWeightedSampler\(replacement='false'\)`: must be True or False \(not a str\)",
            SamplerError,
        ),
        (
            lambda: DistributedWeightedSampler([1.0, 2.0], drop_last="no"),
            r"`DistributedWeightedSampler\(drop_last='no'\)`: must be True or False \(not a str\)",
            SamplerError,
        ),
        (lambda: HPPPrecision(init_scale="1024"), r"`HPPPrecision\(init_scale='1024'\)`: must be a positive number",
         PlanError),
        (lambda: HPPPrecision(init_scale=True), r"`HPPPrecision\(init_scale=True\)`: must be a positive number",
         PlanError),
        (lambda: HPPPrecision(init_scale=-1.0), r"`HPPPrecision\(init_scale=-1.0\)`: must be a positive number",
         PlanError),
        (
            lambda: HPPStrategy(schedule=["1f1b"]),
            r"`HPPStrategy\(schedule=\['1f1b'\]\)` is unknown. Valid schedules: gpipe, 1f1b",
            PlanError,
        ),
        (
            lambda: HPPStrategy(process_group_backend="glooo"),
            (
                r"`HPPStrategy\(process_group_backend='glooo'\)` is not a torch.distributed "
                r"backend; use one of 'gloo', 'nccl'"
            ),
            PlanError,
        ),
        (
            lambda: PlacementOptions(device_map="zero:a100"),
            r"`PlacementOptions\(device_map='zero:a100'\)`: device_map entry 'zero:a100'",
            PlacementError,
        ),
        (
            lambda: HPPStrategy(placement={"device_map": {"0": "a100"}}),
            r"`device_map` key \('0'\): must be an integer >= 0\. Keys are ranks",
            PlacementError,
        ),
    ],
    ids=[
        "deterministic-str",
        "deterministic-dict",
        "async_save-str",
        "activation_checkpointing-str",
        "sampler-replacement-str",
        "sampler-drop_last-str",
        "init_scale-str",
        "init_scale-bool",
        "init_scale-negative",
        "schedule-list",
        "backend-unknown",
        "device_map-format",
        "device_map-str-rank",
    ],
)
def test_wrong_types_and_values_are_refused_at_construction(build, message, error):
    with pytest.raises(ValueError, match=message) as info:
        build()
    assert isinstance(info.value, error)


def test_well_formed_values_are_taken():
    assert BiasOptions(deterministic=True).deterministic is True
    assert (
        DistributedWeightedSampler([1.0, 2.0], replacement=False, num_samples=2, num_replicas=1, rank=0).replacement
        is False
    )
    assert HPPPrecision(init_scale=1024).scaler is not None
    assert HPPStrategy(process_group_backend="gloo")._process_group_backend == "gloo"
    PlacementOptions(device_map={0: "a100", 1: "h100"}).check_world(2)


def test_device_map_ranks_are_checked_against_the_world(monkeypatch):
    with pytest.raises(
        PlacementError,
        match=r"names rank\(s\) \[7\], but the job has 2 processes \(ranks 0-1\). Give one kind per "
        r"rank of this job, e.g. '0:a100,1:a100'",
    ):
        PlacementOptions(device_map="0:a100,7:h100").check_world(2)
    with pytest.raises(PlacementError, match=r"gives no kind for rank\(s\) \[1, 2\] of the 3 processes"):
        PlacementOptions(device_map=["a100"]).check_world(3)
    monkeypatch.setenv("HPP_DEVICE_KIND", "0:a100,1:h100,2:h100")
    with pytest.raises(PlacementError, match=r"\$HPP_DEVICE_KIND='0:a100,1:h100,2:h100' names rank\(s\) \[2\]"):
        PlacementOptions().check_world(2)
    monkeypatch.setenv("HPP_DEVICE_KIND", "a100")  # one kind for every rank: nothing to check
    PlacementOptions().check_world(2)


@pytest.mark.parametrize(
    "doc, message",
    [
        (
            {"stages": "net.0-3"},
            r"`stages` is 'net.0-3'; expected a non-empty list of stage objects, as in \{\"stages\": \[",
        ),
        ({"stages": []}, r"`stages` is \[\]; expected a non-empty list"),
        ([{"modules": ["net.0"]}], r"a stage plan must be a mapping with a 'stages' list, got list"),
        ({"stages": [{"modules": ["net.0"]}], "stage": 1}, r"has unknown top-level keys \['stage'\]"),
        (
            {"stages": ["net.0-3"]},
            r"`stages\[0\]` is 'net.0-3'; expected an object such as \{\"modules\": \[\"layers.0-3\"\]\}",
        ),
        (
            {"stages": [{"modules": ["net.0"]}, {"modules": ["net.1"], "precison": "fp8"}]},
            r"Stage 1 of the plan has unknown keys \['precison'\]",
        ),
        ({"stages": [{"modules": [0, 1]}]}, r"`stages\[0\].modules` is \[0, 1\]; expected a list of unit names"),
        (
            {"stages": [{"modules": ["net.0"], "precision": "fp7"}]},
            r"`stages\[0\].precision` is 'fp7'; expected one of '32-true', ",
        ),
        (
            {"stages": [{"modules": ["net.0"], "clip_norm": "1.0"}]},
            r"`stages\[0\].clip_norm` is '1.0'; expected a number > 0, or null",
        ),
        (
            {"stages": [{"modules": ["net.0"], "clip_norm": -1}]},
            r"`stages\[0\].clip_norm` is -1; expected a number > 0",
        ),
        (
            {"stages": [{"modules": ["net.0"], "activation_checkpointing": "false"}]},
            (
                r"`stages\[0\].activation_checkpointing` is 'false'; "
                r"expected true or false"
            ),
        ),
        ({"stages": [{"modules": ["net.0"], "device": 100}]}, r"`stages\[0\].device` is 100; expected a device kind"),
        ({"stages": [{"modules": ["net.0"]}], "meta": []}, r"`meta` is \[\]; expected an object"),
    ],
    ids=[
        "stages-str",
        "stages-empty",
        "not-a-mapping",
        "unknown-top-key",
        "stage-str",
        "unknown-stage-key",
        "modules-ints",
        "precision",
        "clip_norm-str",
        "clip_norm-negative",
        "activation_checkpointing-str",
        "device-int",
        "meta-list",
    ],
)
def test_plan_files_are_validated_field_by_field(tmp_path, doc, message):
    path = tmp_path / "stage_plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(
        PlanError,
        match=rf"^Stage plan file {str(path)!r}: " + message
        if "top-level" not in message
        else rf"^Stage plan file {str(path)!r} " + message,
    ):
        HPPStrategy(plan=str(path))


def test_a_well_formed_plan_file_is_taken_and_a_directory_is_refused(tmp_path):
    path = tmp_path / "stage_plan.json"
    path.write_text(
        json.dumps(
            {
                "stages": [
                    {"modules": "net.0-3", "precision": "bf16", "clip_norm": 1},
                    {"modules": ["net.4"], "device": "cpu", "activation_checkpointing": True},
                ],
                "meta": {},
            }
        )
    )
    plan = HPPStrategy(plan=str(path)).spec.plan
    assert isinstance(plan, StagePlan)
    assert [(s.modules, s.precision, s.clip_norm, s.device) for s in plan.stages] == [
        (["net.0-3"], "bf16-mixed", 1.0, None),
        (["net.4"], None, None, "cpu"),
    ]
    with pytest.raises(PlanError, match=rf"Stage plan file {str(tmp_path)!r} is a directory"):
        HPPStrategy(plan=str(tmp_path))


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        ("16GB", r"`PlacementOptions\(memory='16GB'\)`: give the bytes per device by kind, e\.g\."),
        ({"cpu": 0},
         r"`PlacementOptions\(memory=\{'cpu': 0\}\)`: the memory of a 'cpu' device must be a number of bytes > 0"),
        ({"cpu": "16e9"}, r"must be a number of bytes > 0"),
        ({"cpu": True}, r"must be a number of bytes > 0"),
        ({"a 100": 1e9}, r"`PlacementOptions\(memory=\.\.\.\)` kind 'a 100' is not a device kind"),
    ],
)
def test_memory_per_kind_for_plan_auto_is_validated(memory, message):
    with pytest.raises(PlacementError, match=message):
        HPPStrategy(placement={"memory": memory})


def test_memory_per_kind_is_taken_with_kinds_normalized():
    assert PlacementOptions(memory={"CPU": 16e9, "a100": 40_000_000_000}).memory == {"cpu": 16e9, "a100": 40e9}
    assert PlacementOptions().memory is None
