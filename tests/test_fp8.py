"""fp8 backends on CPU: the quantize-dequantize emulation, conversion, and the fp8 stage check.

Bounds used below (round to nearest, per-tensor scale so that amax maps to the format's max):

* e4m3 (3 mantissa bits): relative error <= 2**-4 for values in the normal range after scaling;
  below it (|x * scale| < 2**-6) the absolute error is <= half the subnormal step, 2**-10 / scale.
* e5m2 (2 mantissa bits): relative error <= 2**-3; subnormal half step 2**-17 / scale.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
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
from lightning_hpp.precision.fp8_recipe import E4M3, E4M3_MAX, E5M2, E5M2_MAX, FP8Recipe

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.fixture(autouse=True)
def _one_thread_and_seed():
    """Small tensors: one intra-op thread is faster on a shared 2-core machine; seed per test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def _wide_range_tensor(n: int = 100_000) -> torch.Tensor:
    """Signed values whose magnitudes span 1e-4 .. 1e3 (log-uniform)."""
    g = torch.Generator().manual_seed(1)
    mag = 10 ** (torch.rand(n, generator=g) * 7 - 4)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


def _current_scale(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    return fp8_scale(x.abs().amax(), fmt)


# ------------------------------------------------------------------ quantization numerics
@pytest.mark.parametrize(
    ("fmt", "rel_bound", "sub_half_step"),
    [(E4M3, 2.0**-4, 2.0**-10), (E5M2, 2.0**-3, 2.0**-17)],
    ids=["e4m3", "e5m2"],
)
def test_round_trip_error_is_bounded(fmt, rel_bound, sub_half_step):
    x = _wide_range_tensor()
    scale = _current_scale(x, fmt)
    q = quantize_dequantize(x, fmt, scale)
    err = (q - x).abs()
    # Per element: relative bound, plus the subnormal half step for the smallest values.
    bound = rel_bound * x.abs() + sub_half_step / scale
    assert torch.all(err <= bound * (1 + 1e-6)), float((err - bound).max())
    normal = (x * scale).abs() >= torch.finfo(fmt).smallest_normal
    rel = err[normal] / x[normal].abs()
    assert rel.max() <= rel_bound * (1 + 1e-6)
    # It really rounds: a sizeable mean error, and an 8-bit code book (<= 256 distinct values).
    assert rel.mean() > rel_bound / 8
    assert torch.unique(q).numel() <= 256
    assert torch.unique(x).numel() > 90_000


def test_values_beyond_the_range_are_scaled_not_clipped():
    x = _wide_range_tensor() * 100  # magnitudes up to 1e5: beyond e4m3's 448 and e5m2's 57344
    assert x.abs().max() > E5M2_MAX
    for fmt, rel_bound in ((E4M3, 2.0**-4), (E5M2, 2.0**-3)):
        q = quantize_dequantize(x, fmt, _current_scale(x, fmt))
        assert torch.isfinite(q).all()
        big = x.abs() > 448
        assert torch.all((q[big] - x[big]).abs() <= rel_bound * x[big].abs() * (1 + 1e-6))
        assert q.abs().max() >= x.abs().max() * (1 - rel_bound)
    # Without a scale (scale 1) the same cast saturates at the format's max: what scaling avoids.
    unscaled = quantize_dequantize(x, E4M3, 1.0)
    assert unscaled.abs().max() == E4M3_MAX
    assert torch.isfinite(quantize_dequantize(x, E5M2, 1.0)).all()


def test_non_finite_values_pass_through_for_the_guards():
    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), -3.0])
    q = quantize_dequantize(x, E4M3, torch.tensor(2.0))
    assert q[1] == float("inf") and q[2] == -float("inf") and torch.isnan(q[3])
    assert q[0] == 1.0 and q[4] == -3.0
    # A scale is never derived from a zero or non-finite amax.
    assert fp8_scale(torch.tensor(0.0), E4M3) == 1.0
    assert fp8_scale(torch.tensor(float("inf")), E4M3) == 1.0
    assert fp8_scale(torch.tensor(2.0), E4M3, margin=1) == 448.0 / 2 / 2


# ------------------------------------------------------------------ the emulated linear
def test_forward_is_the_gemm_of_e4m3_operands():
    lin = EmulatedFP8Linear(32, 16, recipe="current")
    x = torch.randn(4, 8, 32)
    out = lin(x)
    xq = quantize_dequantize(x, E4M3, _current_scale(x, E4M3))
    wq = quantize_dequantize(lin.weight, E4M3, _current_scale(lin.weight, E4M3))
    torch.testing.assert_close(out, xq @ wq.t() + lin.bias, rtol=1e-6, atol=1e-6)
    exact = F.linear(x, lin.weight, lin.bias)
    rel = (out - exact).norm() / exact.norm()
    assert 1e-3 < rel < 2.0**-4  # quantization is on, and the error stays within e4m3's bound


def test_gradients_flow_and_use_e5m2():
    lin = EmulatedFP8Linear(32, 16, recipe="current")
    x = torch.randn(64, 32, requires_grad=True)
    g = torch.randn(64, 16) * 1e-3
    lin(x).backward(g)

    gq = quantize_dequantize(g, E5M2, _current_scale(g, E5M2))
    xq = quantize_dequantize(x.detach(), E4M3, _current_scale(x.detach(), E4M3))
    wq = quantize_dequantize(lin.weight.detach(), E4M3, _current_scale(lin.weight.detach(), E4M3))
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(lin.weight.grad, gq.t() @ xq, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(lin.bias.grad, g.sum(0), rtol=1e-6, atol=1e-9)  # from the unquantized grad
    # The incoming gradient was rounded to e5m2, not e4m3 and not left in fp32.
    g_e4m3 = quantize_dequantize(g, E4M3, _current_scale(g, E4M3))
    assert not torch.allclose(x.grad, g_e4m3 @ wq, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(x.grad, g @ wq, rtol=1e-6, atol=1e-9)
    assert lin.amax_history[0, 2] == g.abs().max()


def test_gemm_runs_in_the_autocast_dtype():
    lin = EmulatedFP8Linear(32, 16, recipe="current")
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)
    assert out.dtype == torch.bfloat16
    xq = quantize_dequantize(x, E4M3, _current_scale(x, E4M3)).bfloat16()
    wq = quantize_dequantize(lin.weight.detach(), E4M3, _current_scale(lin.weight, E4M3)).bfloat16()
    torch.testing.assert_close(out, xq @ wq.t() + lin.bias.detach().bfloat16())


def test_delayed_scaling_updates_its_amax_history():
    lin = EmulatedFP8Linear(16, 16, bias=False, recipe=FP8Recipe("delayed", amax_history_len=2))
    assert lin.amax_history.shape == (2, 3)
    small = torch.full((4, 16), 0.5)
    big = torch.full((4, 16), 50.0)

    lin(small)  # empty history: starts from this tensor's own amax
    assert lin.amax_history[:, 0].tolist() == [0.5, 0.0]
    out = lin(big)  # scale still from the history (0.5): 50 saturates at 0.5, as in TE
    assert lin.amax_history[:, 0].tolist() == [50.0, 0.5]
    wq = quantize_dequantize(lin.weight.detach(), E4M3, _current_scale(lin.weight, E4M3))
    torch.testing.assert_close(out, small @ wq.t(), rtol=1e-6, atol=1e-6)
    out = lin(big)  # history now holds 50: no saturation (50 is exact in e4m3 at scale 448/50)
    torch.testing.assert_close(out, big @ wq.t(), rtol=1e-6, atol=1e-5)
    lin(small)
    lin(small)  # history of length 2: 50 has rolled out
    assert lin.amax_history[:, 0].tolist() == [0.5, 0.5]
    # most_recent ignores older, larger entries
    mr = EmulatedFP8Linear(16, 16, bias=False,
                           recipe=FP8Recipe("delayed", amax_history_len=4, amax_compute_algo="most_recent"))
    mr(big)
    mr(small)
    out = mr(big)  # scale from the most recent (0.5): saturates although 50 is in the history
    assert out.abs().max() < F.linear(big, mr.weight).abs().max() / 10


def test_state_dict_keys_match_nn_linear_and_load_both_ways():
    plain = nn.Linear(32, 16)
    emulated = EmulatedFP8Linear(32, 16)
    assert list(emulated.state_dict()) == list(plain.state_dict()) == ["weight", "bias"]
    emulated.load_state_dict(plain.state_dict())
    torch.testing.assert_close(emulated.weight, plain.weight, rtol=0, atol=0)
    back = nn.Linear(32, 16)
    back.load_state_dict(emulated.state_dict())
    torch.testing.assert_close(back.bias, plain.bias, rtol=0, atol=0)


# ------------------------------------------------------------------ conversion
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)

    def forward(self, x):
        h = self.norm(x)
        return x + self.mlp(h) + self.attn(h, h, h, need_weights=False)[0]


def test_convert_keeps_names_values_and_parameter_objects():
    block = _Block()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    params = dict(block.named_parameters())
    x = torch.randn(2, 5, 32)
    ref = block(x)

    out_module = convert_module_to_fp8(block, "emulate", "current")
    assert out_module is block
    assert isinstance(block.mlp[0], EmulatedFP8Linear) and isinstance(block.mlp[2], EmulatedFP8Linear)
    assert type(block.norm) is nn.LayerNorm  # the emulation leaves LayerNorm in high precision
    assert not isinstance(block.attn.out_proj, EmulatedFP8Linear)  # MHA never calls its forward
    assert list(block.state_dict()) == list(before)
    for k, v in block.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p is params[n] for n, p in block.named_parameters())
    out = block(x)
    rel = (out - ref).norm() / ref.norm()
    assert 1e-4 < rel < 2.0**-4


def test_convert_a_bare_linear_and_keep_unaligned_layers_with_a_warning():
    lin = nn.Linear(32, 32)
    assert isinstance(convert_module_to_fp8(lin, "emulate"), EmulatedFP8Linear)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    with pytest.warns(UserWarning, match=r"divisible by 16: '2' \(64->10\)"):
        convert_module_to_fp8(model, "emulate")
    assert isinstance(model[0], EmulatedFP8Linear)
    assert type(model[2]) is nn.Linear


# ------------------------------------------------------------------ training against fp32
def _regression_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=g)
    w = torch.randn(32, 16, generator=g) / 32**0.5
    y = torch.tanh(x @ w) * 3 + 0.1 * torch.randn(1024, 16, generator=g)
    return x, y


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 100) -> tuple[float, float]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with torch.no_grad():
        first = F.mse_loss(model(x), y).item()
    for i in range(steps):
        s = (i * 128) % len(x)
        loss = F.mse_loss(model(x[s : s + 128]), y[s : s + 128])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return first, F.mse_loss(model(x), y).item()


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_emulated_mlp_trains_within_tolerance_of_fp32(recipe):
    """100 Adam steps, same seed and data: the fp8 MLP's final loss is within 15% of fp32's."""
    x, y = _regression_data()
    ref = _mlp()
    first32, last32 = _train(ref, x, y)
    fp8 = convert_module_to_fp8(_mlp(), "emulate", recipe)
    _, last8 = _train(fp8, x, y)
    assert last32 < first32 / 5  # the reference learns
    assert abs(last8 - last32) <= 0.15 * last32, (last8, last32)
    # The emulation is really on: same seed and data, yet the weights moved apart.
    drift = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), fp8.parameters()))
    assert drift > 1e-3


# ------------------------------------------------------------------ fp8 stage checks and labels
def test_check_fp8_stage_refuses_cpu_without_emulate():
    ok, reason = fp8_capable(torch.device("cpu"))
    assert not ok and reason.startswith("cpu")
    with pytest.raises(FP8Error) as info:
        check_fp8_stage(1, torch.device("cpu"), "h100", None)
    msg = str(info.value)
    for part in ("Stage 1", "'cpu'", "'h100'", "cpu has no fp8", "fp8_backend='emulate'", "'h100' or 'h200'"):
        assert part in msg, (part, msg)
    with pytest.raises(FP8Error, match="Stage 2 .*'cpu'"):
        check_fp8_stage(2, "cpu", "cpu", "te")
    assert check_fp8_stage(1, torch.device("cpu"), "cpu", "emulate") == "emulate"


@pytest.mark.parametrize("bad", ["fp16", "TE", ""])
def test_bad_backend_is_refused_everywhere(bad):
    for call in (
        lambda: check_fp8_stage(0, "cpu", "cpu", bad),
        lambda: convert_module_to_fp8(nn.Linear(16, 16), bad),
        lambda: fp8_autocast_context(bad),
        lambda: describe_backend(bad),
    ):
        with pytest.raises(FP8Error, match=repr(bad)):
            call()


def test_bad_recipes_are_refused():
    with pytest.raises(FP8Error, match="'hybrid'"):
        EmulatedFP8Linear(16, 16, recipe="hybrid")
    with pytest.raises(FP8Error, match="margin is 2 with scaling='current'"):
        FP8Recipe("current", margin=2)
    with pytest.raises(FP8Error, match=r"`FP8Recipe\(amax_history_len=0\)`: must be a positive integer"):
        FP8Recipe("delayed", amax_history_len=0)
    with pytest.raises(FP8Error, match="'mean'"):
        FP8Recipe("delayed", amax_compute_algo="mean")


def test_labels_and_contexts():
    assert describe_backend("emulate") == "fp8-emulated (quantize-dequantize on cpu; not fp8 speed)"
    assert describe_backend("emulate",
                            device=torch.device("cuda", 1)).startswith("fp8-emulated (quantize-dequantize on cuda;")
    with fp8_autocast_context("emulate", "current"):
        pass
    lin = EmulatedFP8Linear(16, 16, recipe="current")
    x = torch.randn(4, 16)
    with fp8_autocast_context("emulate"):
        inside = lin(x)
    torch.testing.assert_close(inside, lin(x), rtol=0, atol=0)


@pytest.mark.skipif(HAS_TE, reason="checks the message given when Transformer Engine is absent")
def test_te_backend_without_transformer_engine_says_how_to_fix():
    for call in (
        lambda: convert_module_to_fp8(nn.Linear(16, 16), "te"),
        lambda: fp8_autocast_context("te"),
        lambda: describe_backend("te"),
    ):
        with pytest.raises(FP8Error, match="not installed.*fp8_backend='emulate'"):
            call()
