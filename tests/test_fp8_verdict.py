"""fp8 verdicts taken for the devices that hold each stage (pure functions; the 2-rank job is tests/test_cluster.py)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_hpp.errors import FP8Error
from lightning_hpp.precision.fp8_verdict import DeviceCapability, decide, local_capability, simulated_devices

CPU = torch.device("cpu")
SIM = {"HPP_SIMULATED_DEVICES": json.dumps({"h100": {"te": True}, "a100": {}, "3": {"te": False}})}


def test_simulated_capabilities_come_from_the_kind_unless_the_rank_is_named():
    a100 = local_capability(0, "a100", CPU, SIM)
    assert (a100.capability, a100.memory_gb, a100.te_version, a100.simulated) == ((8, 0), 80, None, True)
    assert a100.reason == "compute capability 8.0 < 8.9"
    h100 = local_capability(1, "h100", CPU, SIM)
    assert h100.runs_te and h100.capability == (9, 0) and h100.name == "simulated h100"
    no_te = local_capability(3, "h100", CPU, SIM)  # the rank's own entry wins: Transformer Engine on some nodes only
    assert no_te.reason == "transformer_engine is not installed"
    real = local_capability(2, "cpu", CPU, {})  # not simulated: what this machine reports
    assert not real.simulated and real.reason.startswith("cpu has no fp8 tensor cores")
    with pytest.raises(FP8Error, match="HPP_SIMULATED_DEVICES='nope' is not JSON"):
        simulated_devices({"HPP_SIMULATED_DEVICES": "nope"})
    with pytest.raises(FP8Error, match=r"the fields \['capability', 'memory_gb', 'name', 'te'\]"):
        simulated_devices({"HPP_SIMULATED_DEVICES": '{"h100": {"tee": true}}'})


def _caps(*specs: tuple[str, bool]) -> list[DeviceCapability]:
    return [local_capability(r, kind, CPU, {"HPP_SIMULATED_DEVICES": json.dumps({str(r): {"te": te}})})
            for r, (kind, te) in enumerate(specs)]


def test_each_fp8_stage_is_decided_by_its_own_ranks_the_same_everywhere():
    caps = _caps(("a100", False), ("a100", False), ("h100", True), ("h100", True))  # pp2 x dp2
    verdicts = decide([1], {0: [0, 1], 1: [2, 3]}, caps, None, "delayed")
    assert verdicts[1].backend == "te" and verdicts[1].run_as == "emulate"  # the emulation stands in on simulated ranks
    assert verdicts[1].label == "fp8 (Transformer Engine, simulated: quantize-dequantize on cpu; not fp8 speed)"
    # stage 0 in fp8 is on the a100 ranks: refused, naming both of them, whichever rank decides
    with pytest.raises(FP8Error) as refused:
        decide([0, 1], {0: [0, 1], 1: [2, 3]}, caps, None, "delayed")
    text = str(refused.value)
    assert text.startswith("Stage 0 has precision 'fp8' but runs on device 'cpu' (device kind 'a100', rank 0: "
                           "simulated a100, compute capability 8.0), which cannot run fp8: compute capability 8.0 < "
                           "8.9; and on device 'cpu' (device kind 'a100', rank 1"), text
    assert "Stage 1" not in text and "fp8_backend='emulate'" in text


def test_transformer_engine_on_some_replicas_only_is_refused_and_emulation_is_never_refused():
    caps = _caps(("h100", True), ("h100", False))  # one stage, two replicas: TE on rank 0's node only
    with pytest.raises(FP8Error, match=r"rank 1: simulated h100, compute capability 9.0\), which cannot run fp8: "
                                       r"transformer_engine is not installed"):
        decide([0], {0: [0, 1]}, caps, "te", "current")
    emulated = decide([0], {0: [0, 1]}, [], "emulate", "current")
    assert emulated[0].run_as == "emulate" and emulated[0].label.startswith("fp8-emulated (quantize-dequantize on cpu")


def test_transformer_engine_with_activation_checkpointing_is_refused_by_every_rank():
    caps = _caps(("a100", False), ("h100", True))
    with pytest.raises(FP8Error, match=r"^Stage 1 runs Transformer Engine \(fp8\) with activation checkpointing"):
        decide([1], {0: [0], 1: [1]}, caps, None, "delayed", recompute=[False, True])
    assert decide([1], {0: [0], 1: [1]}, caps, None, "delayed", recompute=[True, False])[1].backend == "te"
