"""Device kinds per rank, the overrides, fp8 support and the stage -> rank layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_hpp.errors import PlacementError
from lightning_hpp.planning.devices import (
    ENV_VAR,
    assign_ranks,
    detect_device_kind,
    kind_from_name,
    parse_device_map,
    precision_preference,
    stage_kind_orders,
    supports_fp8,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA A10G", "a10g"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("Tesla T4", "t4"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx6000ada"),
        ("NVIDIA RTX A6000", "rtxa6000"),
        ("Quadro P5000", "quadrop5000"),
    ],
)
def test_kind_from_device_name(name, kind):
    assert kind_from_name(name) == kind


def test_unnamed_device_falls_back_to_capability():
    assert kind_from_name("NVIDIA", (9, 0)) == "sm90"


def test_cpu_is_detected_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert detect_device_kind() == "cpu"
    assert detect_device_kind("cpu") == "cpu"


def test_env_var_overrides_one_kind_or_a_map(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "H100")
    assert detect_device_kind() == "h100"
    monkeypatch.setenv(ENV_VAR, "0:fast,1:slow")
    assert detect_device_kind(rank=0) == "fast"
    assert detect_device_kind(rank=1) == "slow"
    monkeypatch.setenv("RANK", "1")
    assert detect_device_kind() == "slow"
    with pytest.raises(PlacementError, match="no entry for rank 2"):
        detect_device_kind(rank=2)


def test_device_map_wins_over_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "h100")
    assert detect_device_kind(rank=1, device_map={0: "a100", 1: "l4"}) == "l4"
    assert detect_device_kind(rank=0, device_map=["A100", "h100"]) == "a100"
    assert detect_device_kind(rank=1, device_map="0:a100, 1:h100") == "h100"


@pytest.mark.parametrize(
    "bad, match",
    [
        ("0=a100", "is not 'RANK:KIND'"),
        ("0:a100,0:h100", "rank 0 twice"),
        ({-1: "a100"}, r"`device_map` key \(-1\): must be an integer >= 0\. Keys are ranks"),
        (["a100", ""], "not a device kind"),
        (3.5, "must be a dict"),
    ],
)
def test_bad_device_maps_are_refused(bad, match):
    with pytest.raises(PlacementError, match=match):
        parse_device_map(bad)


def test_fp8_support_follows_compute_capability():
    assert supports_fp8("h100") and supports_fp8("h200") and supports_fp8("l4") and supports_fp8("rtx4090")
    assert not supports_fp8("a100") and not supports_fp8("v100") and not supports_fp8("cpu")
    assert not supports_fp8("mystery")
    assert supports_fp8((8, 9)) and supports_fp8((9, 0)) and not supports_fp8((8, 6))


def test_precision_preference_per_kind():
    assert precision_preference("h100")[0] == "fp8"
    assert precision_preference("a100")[0] == "bf16-mixed" and "fp8" not in precision_preference("a100")
    assert precision_preference("v100")[0] == "16-mixed"
    assert precision_preference("cpu") == ["32-true"]


def test_default_layout_is_pipeline_outer():
    assert assign_ranks([None, None], ["cpu"] * 4, 2, 2) == [[0, 1], [2, 3]]
    assert assign_ranks(["a100", "h100"], ["a100", "a100", "h100", "h100"], 2, 2) == [[0, 1], [2, 3]]


def test_kinds_are_matched_to_ranks_with_ascending_pipelines():
    kinds = ["a100", "h100", "a100", "h100"]
    assert assign_ranks(["a100", "h100"], kinds, 2, 2) == [[0, 2], [1, 3]]


def test_interleaved_kinds_one_replica():
    kinds = ["slow", "fast", "slow"]
    assert assign_ranks(["slow", "fast", "slow"], kinds, 3, 1) == [[0], [1], [2]]
    assert assign_ranks([None, "fast", None], kinds, 3, 1) == [[0], [1], [2]]


def test_missing_kind_is_refused_with_every_rank_listed():
    with pytest.raises(PlacementError) as err:
        assign_ranks(["a100", "h100"], ["a100", "a100"], 2, 1)
    msg = str(err.value)
    assert "'h100': needs 1 rank(s), has 0" in msg
    assert "rank 0: a100, rank 1: a100" in msg


def test_too_few_of_a_kind_is_refused():
    with pytest.raises(PlacementError, match="'h100': needs 2 rank"):
        assign_ranks(["a100", "h100"], ["a100", "a100", "a100", "h100"], 2, 2)


def test_order_that_cannot_ascend_is_refused():
    # stage 0 wants the kind of the last rank: no pipeline can ascend.
    with pytest.raises(PlacementError, match="ascend"):
        assign_ranks(["h100", "a100"], ["a100", "h100"], 2, 1)


def test_wrong_world_size_is_refused():
    with pytest.raises(PlacementError, match="world size"):
        assign_ranks([None, None], ["cpu"] * 3, 2, 2)


def test_stage_kind_orders_list_exactly_the_layouts_that_work():
    assert stage_kind_orders(["a100", "h100"], 2, 1) == [["a100", "h100"]]
    assert stage_kind_orders(["a", "b", "a", "b"], 2, 2) == [["a", "b"]]
    ranks = ["a", "a", "a", "b", "a", "b"]
    orders = stage_kind_orders(ranks, 3, 2)
    assert orders == [["a", "a", "b"]]
    for seq in itertools.product("ab", repeat=3):
        try:
            grid = assign_ranks(list(seq), ranks, 3, 2)
        except PlacementError:
            assert list(seq) not in orders
            continue
        assert list(seq) in orders
        for d in range(2):
            pipe = [grid[s][d] for s in range(3)]
            assert pipe == sorted(pipe) and [ranks[r] for r in pipe] == list(seq)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_detects_the_real_gpu():
    name = torch.cuda.get_device_name(0)
    cap = torch.cuda.get_device_capability(0)
    kind = detect_device_kind(0)
    assert kind == kind_from_name(name, cap)
    from lightning_hpp.planning.devices import DEVICE_SPECS

    if kind in DEVICE_SPECS:
        assert DEVICE_SPECS[kind].capability == cap
        assert supports_fp8(kind) == (cap >= (8, 9))
