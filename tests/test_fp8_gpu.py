"""fp8 on a real GPU: Transformer Engine on sm_89+, the refusal on older GPUs, the emulation on CUDA.

Skipped without CUDA; the Transformer Engine tests also skip without ``transformer_engine`` or on a
GPU of compute capability < 8.9, and the refusal test skips on GPUs that can run fp8.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util

import pytest
import torch
from torch import nn

from lightning_hpp.errors import FP8Error
from lightning_hpp.precision.fp8 import (
    check_fp8_stage,
    convert_module_to_fp8,
    describe_backend,
    fp8_autocast_context,
    fp8_capable,
)
from lightning_hpp.precision.fp8_emulation import EmulatedFP8Linear, fp8_scale, quantize_dequantize
from lightning_hpp.precision.fp8_recipe import E4M3, MIN_CAPABILITY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32)
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _step(model: nn.Module, x: torch.Tensor, ctx_factory) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with ctx_factory():
        out = model(x)
    out.float().pow(2).mean().backward()
    return out.detach()


@pytest.mark.skipif(not HAS_TE, reason="needs transformer_engine")
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_fp8_mlp_matches_bf16(recipe):
    """Forward and backward of a TE-converted MLP under fp8 autocast, against the same MLP in bf16.

    Tolerances (relative Frobenius error): outputs 0.1, first-layer weight gradient 0.25; the fp8 run
    must also differ from bf16 by more than 1e-3 (so fp8 really ran) and stay within 0.1 of the CPU
    emulation's prediction run on the same GPU.
    """
    if _capability() < MIN_CAPABILITY:
        pytest.skip(f"compute capability {_capability()} < {MIN_CAPABILITY}")
    ok, reason = fp8_capable(torch.device("cuda", 0))
    assert ok, reason
    assert check_fp8_stage(1, torch.device("cuda", 0), "h100", None) == "te"
    try:
        label = describe_backend("te", recipe)
    except FP8Error as err:  # an older TE without Float8CurrentScaling
        pytest.skip(str(err))
    assert label.startswith("fp8 (Transformer Engine ") and f"{recipe} scaling" in label

    device = torch.device("cuda", 0)
    ref = _mlp().to(device, torch.bfloat16)
    te_model = convert_module_to_fp8(copy.deepcopy(ref), "te", recipe)
    emu = convert_module_to_fp8(copy.deepcopy(ref), "emulate", recipe)
    assert [n for n, _ in te_model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert type(te_model[1]).__module__.startswith("transformer_engine")
    assert type(te_model[0]).__module__.startswith("transformer_engine")  # LayerNorm too
    for (n, p), q in zip(te_model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, generator=g)
    for _ in range(3):  # let delayed scaling fill its amax history
        _step(te_model, x, lambda: fp8_autocast_context("te", recipe))
        _step(emu, x, lambda: fp8_autocast_context("emulate", recipe))
    out_te = _step(te_model, x, lambda: fp8_autocast_context("te", recipe))
    out_emu = _step(emu, x, lambda: fp8_autocast_context("emulate", recipe))
    out_ref = _step(ref, x, contextlib.nullcontext)

    assert torch.isfinite(out_te).all()
    assert 1e-3 < _rel(out_te, out_ref) < 0.1
    assert _rel(te_model[1].weight.grad, ref[1].weight.grad) < 0.25
    assert _rel(out_te, out_emu) < 0.1


def test_fp8_refused_on_a_gpu_below_sm89():
    if _capability() >= MIN_CAPABILITY:
        pytest.skip(f"compute capability {_capability()} can run fp8")
    device = torch.device("cuda", 0)
    ok, reason = fp8_capable(device)
    assert not ok and f"compute capability {_capability()[0]}.{_capability()[1]} < 8.9" in reason
    with pytest.raises(FP8Error) as info:
        check_fp8_stage(1, device, "a100", None)
    msg = str(info.value)
    for part in ("Stage 1", "'cuda:0'", "'a100'", "< 8.9", "fp8_backend='emulate'", "'h100' or 'h200'"):
        assert part in msg, (part, msg)
    assert check_fp8_stage(1, device, "a100", "emulate") == "emulate"


def test_emulation_on_cuda_matches_the_cpu_emulation():
    torch.manual_seed(0)
    cpu = EmulatedFP8Linear(64, 32, recipe="current")
    gpu = copy.deepcopy(cpu).cuda()
    assert gpu.amax_history.device.type == "cuda"
    x = torch.randn(16, 64)
    out_cpu = cpu(x)
    out_gpu = gpu(x.cuda())
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-5, atol=1e-5)
    xq = quantize_dequantize(x, E4M3, fp8_scale(x.abs().amax(), E4M3))
    torch.testing.assert_close(
        quantize_dequantize(x.cuda(), E4M3, fp8_scale(x.cuda().abs().amax(), E4M3)).cpu(), xq, rtol=0, atol=0
    )
