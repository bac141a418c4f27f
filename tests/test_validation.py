"""The shared value checks: the value, where it was given and the fix in every message, the caller's error class."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_hpp.errors import CheckpointError, PlanError, SweepError
from lightning_hpp.validation import check_bool, check_choice, check_int, check_number, check_path, is_int, is_number


def test_bool_is_neither_an_int_nor_a_number():
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_number(3) and is_number(0.5) and not is_number(False) and not is_number("1")


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: check_int(0, "CheckpointOptions(keep_last=...)", optional=True, error=CheckpointError),
         CheckpointError, r"^`CheckpointOptions\(keep_last=0\)`: must be a positive integer or None\.$"),
        (lambda: check_int(True, "n_microbatches"), PlanError,
         r"^`n_microbatches=True`: must be a positive integer\.$"),
        (lambda: check_int(-1, "`device_map` key", minimum=0, hint="Keys are ranks."),
         PlanError, r"^`device_map` key \(-1\): must be an integer >= 0\. Keys are ranks\.$"),
        (lambda: check_int(5000, "D(val_size=...)", minimum=10, maximum=1733),
         PlanError, r"^`D\(val_size=5000\)`: must be an integer in \[10, 1733\]\.$"),
        (lambda: check_number(1.5, "hydra.sweeper.max_failure_rate", minimum=0, strict=False, maximum=1,
                              error=SweepError),
         SweepError, r"^`hydra.sweeper.max_failure_rate=1.5`: must be a number in \[0, 1\]\.$"),
        (lambda: check_number(float("inf"), "P(init_scale=...)", hint="E.g. 65536."),
         PlanError, r"^`P\(init_scale=inf\)`: must be a positive number\. E\.g\. 65536\.$"),
        (lambda: check_bool("on", "S(activation_checkpointing=...)", optional=True, hint="None: the default."),
         PlanError,
         r"^`S\(activation_checkpointing='on'\)`: must be True, False or None \(not a str\)\. None: the default\.$"),
        (lambda: check_choice("avg", "Retention(mode=...)", ("min", "max"), error=CheckpointError),
         CheckpointError, r"^`Retention\(mode='avg'\)` is not supported; use one of 'min', 'max'\.$"),
        (lambda: check_choice([1], "X(mode=...)", ("te", "emulate"), optional=True),
         PlanError, r"^`X\(mode=\[1\]\)` is not supported; use one of 'te', 'emulate' or None\.$"),
        (lambda: check_path("", "save_sharded(url=...)", kind="a path or fsspec URL", hint="For example 's3://b/r'."),
         PlanError, r"^`save_sharded\(url=''\)`: must be a path or fsspec URL\. For example 's3://b/r'\.$"),
    ],
)
def test_messages_name_the_value_the_option_and_the_fix(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_good_values_come_back():
    assert check_int(None, "x", optional=True) is None
    assert check_int(7, "x", minimum=0, maximum=7) == 7
    assert check_number(1, "x", minimum=1, strict=False) == 1
    assert check_bool(False, "x") is False
    assert check_choice("te", "x", ("te", "emulate")) == "te"
    assert check_path(Path("/tmp/run"), "x") == "/tmp/run"
