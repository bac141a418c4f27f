"""Cost profiles: what profile_units measures, the JSON cache, and mismatch errors."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from torch import nn

from lightning_hpp.errors import ProfileError, ProfileMismatchError
from lightning_hpp.planning import measure as measure_module
from lightning_hpp.planning.cache import load_or_profile
from lightning_hpp.planning.measure import profile_units
from lightning_hpp.planning.profile import CostProfile, Overheads, check_profile_matches
from lightning_hpp.planning.search import search_plan
from lightning_hpp.planning.speeds import mean_over_ranks

LIBRARY_WINDOW_S = measure_module.MIN_WINDOW_S


@pytest.fixture(autouse=True)
def _short_window(monkeypatch):
    """Each unit is timed for at least MIN_WINDOW_S (0.3 s, for CPU quotas); these tests check bytes, calls,
    caching and files, not times, so 10 ms will do. The test that compares times keeps the library's window."""
    monkeypatch.setattr(measure_module, "MIN_WINDOW_S", 0.01)


@pytest.fixture(autouse=True)
def _one_thread():
    # Two shared cores: intra-op threads make tiny ops wait on each other and the timings noisy.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


class Counting(nn.Module):
    """A Linear layer that counts its forward calls (to see whether a profile was re-measured)."""

    def __init__(self, i, o):
        super().__init__()
        self.lin = nn.Linear(i, o)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


class Pair(nn.Module):
    """A first unit that takes two positional inputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 64)

    def forward(self, x, scale):
        return self.lin(x) * scale


def small_units():
    return [
        ("wide", nn.Linear(32, 256)),
        ("act", nn.ReLU()),
        ("bn", nn.BatchNorm1d(256)),
        ("head", nn.Linear(256, 8)),
    ]


def test_measures_bytes_exactly_and_time_relatively(monkeypatch):
    monkeypatch.setattr(measure_module, "MIN_WINDOW_S", LIBRARY_WINDOW_S)
    heavy = nn.Linear(512, 512)
    units = [("heavy", heavy), ("light", nn.ReLU()), ("head", nn.Linear(512, 4))]
    x = torch.randn(256, 512)
    prof = profile_units(units, x, "cpu", repeats=5, warmup=1, model_name="M")
    costs = {u.name: u for u in prof.get("cpu", "32-true").units}
    assert costs["heavy"].param_bytes == (512 * 512 + 512) * 4
    assert costs["light"].param_bytes == 0
    assert costs["heavy"].activation_bytes == 256 * 512 * 4
    assert costs["head"].activation_bytes == 256 * 4 * 4
    # ReLU keeps its output for the backward; the Linear keeps its input (its weight is not counted).
    assert costs["light"].saved_bytes == 256 * 512 * 4
    assert costs["head"].saved_bytes == 256 * 512 * 4
    # A 512x512 matmul on 256 rows is ~100x the work of a ReLU over the same tensor.
    assert costs["heavy"].fwd_ms > 3 * costs["light"].fwd_ms
    assert costs["heavy"].bwd_ms > 3 * costs["light"].bwd_ms
    assert prof.unit_names == ["heavy", "light", "head"]
    assert prof.param_counts == [512 * 512 + 512, 0, 2052]
    assert prof.input_shapes == [[256, 512]] and prof.microbatch_size == 256


def test_profiling_leaves_grads_buffers_and_rng_alone():
    units = small_units() + [("drop", nn.Dropout(0.5))]
    bn = units[2][1]
    before = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    x = torch.randn(16, 32)
    rng = torch.get_rng_state()
    profile_units(units, x, "cpu", repeats=2, warmup=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for _, m in units for p in m.parameters())
    torch.testing.assert_close(bn.running_mean, before[0], rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var, before[1], rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == before[2].item()


def test_each_unit_gets_the_previous_output_and_the_first_gets_positional_args():
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append((tuple(x.shape), x.requires_grad))
            return x * 2

    units = [("pair", Pair()), ("spy", Spy())]
    profile_units(units, (torch.randn(4, 32), torch.tensor(3.0)), "cpu", repeats=1, warmup=0)
    # boundary input: the previous unit's output shape, requiring grad like a pipeline stage's input
    assert seen and all(s == ((4, 64), True) for s in seen)


class Block(nn.Module):
    """A residual block; ``window`` changes what it computes, ``layer_idx`` only numbers it."""

    def __init__(self, width=32, layer_idx=0, window=None, p=0.0):
        super().__init__()
        self.lin, self.drop = nn.Linear(width, width), nn.Dropout(p)
        self.layer_idx, self.window = layer_idx, window

    def forward(self, x):
        return x + self.drop(self.lin(x))


def test_identical_units_get_the_mean_of_their_times(monkeypatch):
    """Repeated blocks (same classes, hyperparameters, shapes and input) are one computation: each gets
    the mean of their measured times, so a cut search does not read measurement noise as a reason to cut
    unevenly; a block with another window, dropout rate, width or a hook, or the first unit (an input
    without grad), keeps its own."""
    units = [("b0", Block(layer_idx=0)), ("b1", Block(layer_idx=1)), ("b2", Block(layer_idx=2)),
             ("sliding", Block(layer_idx=3, window=4)), ("b4", Block(layer_idx=4)), ("dropped", Block(p=0.1)),
             ("b6", Block(layer_idx=6)), ("hooked", Block(layer_idx=7)), ("wide", nn.Linear(32, 64)), ("b8", Block(64))]
    units[7][1].register_forward_hook(lambda mod, args, out: out * 2)  # a hook is part of the computation
    times = iter([(1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (9.0, 9.0), (5.0, 6.0), (7.0, 7.0), (4.0, 5.0),
                  (10.0, 10.0), (8.0, 8.0), (6.0, 6.0)])
    measure = measure_module._measure_unit

    def scripted(*args, **kwargs):
        cost, out = measure(*args, **kwargs)
        cost.fwd_ms, cost.bwd_ms = next(times)
        return cost, out

    monkeypatch.setattr(measure_module, "_measure_unit", scripted)
    prof = profile_units(units, torch.randn(4, 32), "cpu", repeats=1, warmup=0)
    got = {u.name: (u.fwd_ms, u.bwd_ms) for u in prof.entries[0].units}
    # b0 gets the batch (no grad), b1, b2, b4 and b6 a boundary tensor that requires grad: one group
    assert prof.meta["identical_units"] == [["b1", "b2", "b4", "b6"]]
    assert got["b1"] == got["b2"] == got["b4"] == got["b6"] == pytest.approx(((2 + 3 + 5 + 4) / 4, (3 + 4 + 6 + 5) / 4))
    assert got["b0"] == (1.0, 2.0) and got["sliding"] == (9.0, 9.0) and got["dropped"] == (7.0, 7.0)
    assert got["hooked"] == (10.0, 10.0) and got["wide"] == (8.0, 8.0) and got["b8"] == (6.0, 6.0)
    assert CostProfile.from_dict(
        json.loads(json.dumps(prof.to_dict()))).meta["identical_units"] == [["b1", "b2", "b4", "b6"]]


@pytest.mark.parametrize("precision, param_scale, act_scale", [("bf16-true", 0.5, 0.5), ("bf16-mixed", 1.0, 0.5)])
def test_precision_changes_the_measured_bytes(precision, param_scale, act_scale):
    units = small_units()
    x = torch.randn(16, 32)
    fp32 = profile_units(units, x, "cpu", repeats=1, warmup=0).entries[0]
    low = profile_units(units, x, "cpu", precision, repeats=1, warmup=0).entries[0]
    assert low.precision == precision
    assert low.units[0].param_bytes == fp32.units[0].param_bytes * param_scale
    assert low.units[0].activation_bytes == fp32.units[0].activation_bytes * act_scale
    assert units[0][1].weight.dtype == torch.float32  # the model itself is not converted


def test_json_round_trip_and_merge(tmp_path):
    units = small_units()
    x = torch.randn(16, 32)
    a = profile_units(units, x, "cpu", repeats=1, warmup=0, model_name="M")
    b = profile_units(units, x, "fast", "bf16-mixed", repeats=1, warmup=0, model_name="M")
    both = a.merge(b)
    assert sorted(both.pairs()) == [("cpu", "32-true"), ("fast", "bf16-mixed")]
    path = tmp_path / "p.json"
    both.save(path)
    again = CostProfile.load(path)
    assert again.to_dict() == both.to_dict()
    other = profile_units([("x", nn.Linear(32, 4))], x, "cpu", repeats=1, warmup=0, model_name="M")
    with pytest.raises(ProfileMismatchError, match="different models"):
        both.merge(other)


def test_load_or_profile_caches_by_signature_kind_and_precision(tmp_path):
    path = tmp_path / "cache" / "profile.json"
    unit = Counting(32, 16)
    units = [("lin", unit), ("act", nn.Tanh())]
    x = torch.randn(8, 32)
    first = load_or_profile(path, units, x, "cpu", model_name="M", repeats=1, warmup=0)
    calls = unit.calls
    assert calls > 0 and path.exists()
    second = load_or_profile(path, units, x, "cpu", model_name="M", repeats=1, warmup=0)
    assert unit.calls == calls  # served from the file
    assert second.to_dict() == first.to_dict()
    third = load_or_profile(path, units, x, "cpu", "bf16-mixed", model_name="M", repeats=1, warmup=0)
    assert unit.calls > calls and sorted(third.pairs()) == [("cpu", "32-true"), ("cpu", "bf16-mixed")]
    assert sorted(CostProfile.load(path).pairs()) == [("cpu", "32-true"), ("cpu", "bf16-mixed")]
    # Another input shape is another signature: measured again and the file replaced.
    fourth = load_or_profile(path, units, torch.randn(4, 32), "cpu", model_name="M", repeats=1, warmup=0)
    assert fourth.input_shapes == [[4, 32]] and fourth.pairs() == [("cpu", "32-true")]


def test_a_corrupt_cache_file_is_reported_not_overwritten(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="is not valid JSON"):
        load_or_profile(path, small_units(), torch.randn(4, 32), "cpu")
    assert path.read_text() == "{not json"
    path.write_text(json.dumps({"stages": []}))
    with pytest.raises(ProfileError, match="is not a cost profile"):
        CostProfile.load(path)
    with pytest.raises(ProfileError, match="does not exist"):
        CostProfile.load(os.path.join(tmp_path, "absent.json"))


def test_mismatch_names_missing_and_extra_units():
    prof = profile_units(small_units(), torch.randn(4, 32), "cpu", repeats=1, warmup=0, model_name="M")
    check_profile_matches(prof, ["wide", "act", "bn", "head"])
    with pytest.raises(ProfileMismatchError) as err:
        check_profile_matches(prof, ["wide", "act", "norm", "head", "extra"])
    msg = str(err.value)
    assert "missing units ['norm', 'extra']" in msg and "extra units ['bn']" in msg
    with pytest.raises(ProfileMismatchError, match="different order"):
        check_profile_matches(prof, ["act", "wide", "bn", "head"])
    with pytest.raises(ProfileMismatchError, match="'wide': profile 8448 vs model 99"):
        check_profile_matches(prof, ["wide", "act", "bn", "head"], [99, 0, 512, 2056])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp8"}, "cannot measure precision 'fp8' by itself: pass the fp8 backend's hooks"),
        ({"precision": "int4"}, "precision 'int4' is not supported"),
        ({"repeats": 0}, r"`profile_units\(repeats=0\)`: must be a positive integer"),
        ({"device_kind": "a 100"}, "is not a device kind"),
    ],
)
def test_bad_profiling_arguments(kwargs, match):
    args = {"device_kind": "cpu", **kwargs}
    with pytest.raises(ValueError, match=match):
        profile_units(small_units(), torch.randn(4, 32), **args)


def test_backend_hooks_convert_a_copy_and_wrap_the_forward():
    entered = []
    converted = []

    class Marked(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    def prepare(m):
        converted.append(m)
        return Marked(m)

    @contextlib.contextmanager
    def context():
        entered.append(1)
        yield

    units = small_units()
    prof = profile_units(units, torch.randn(8, 32), "h100", "fp8", repeats=2, warmup=1, prepare=prepare,
                         context=context, source="hooks test")
    entry = prof.get("h100", "fp8")
    assert entry.source == "hooks test"
    assert len(converted) == 4 and all(c is not m for c, (_, m) in zip(converted, units))
    # per unit: the saved-bytes pass, the warmup, and timed repetitions filling the time window
    assert len(entered) >= 4 * (1 + 1 + 2)
    assert not any(isinstance(m, Marked) for _, m in units)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profiles_on_the_gpu_in_bf16_autocast():
    units = [("a", nn.Linear(256, 1024).cuda()), ("b", nn.GELU()), ("c", nn.Linear(1024, 16).cuda())]
    prof = profile_units(units, torch.randn(64, 256, device="cuda"), "gpu", "bf16-mixed", repeats=3, warmup=2)
    costs = prof.get("gpu", "bf16-mixed").units
    assert costs[0].activation_bytes == 64 * 1024 * 2  # autocast output is bf16
    assert costs[0].param_bytes == (256 * 1024 + 1024) * 4  # parameters stay fp32
    assert all(c.fwd_ms > 0 and c.bwd_ms >= 0 for c in costs)


def test_measured_profile_drives_the_planner():
    units = [(f"layers.{i}", nn.Linear(64, 64)) for i in range(4)]
    prof = profile_units(units, torch.randn(32, 64), "cpu", repeats=3, warmup=1)
    # micro-batches of the profiled size (32 samples): each stage computes what its units measured
    res = search_plan(prof, ["cpu", "cpu"], batch_size=128, pp_degree=2, n_microbatches=4, schedule="1f1b")
    measured = [u.step_ms for u in prof.get("cpu", "32-true").units]
    k = len(res.stages[0].units)
    assert res.stages[0].compute_ms == pytest.approx(sum(measured[:k]))
    assert res.stages[1].compute_ms == pytest.approx(sum(measured[k:]))
    assert res.plan.resolve(prof.unit_names) == [prof.unit_names[:k], prof.unit_names[k:]]


def test_mean_over_ranks_averages_each_kind_measured_by_several_ranks():
    """plan="auto" profiles on every rank at once: a kind measured by several ranks gets their mean (unit
    times and overheads), a kind measured once is kept, and profiles of other units are refused."""
    units = small_units()
    x = torch.randn(16, 32)
    parts = [profile_units(units, x, kind, repeats=1, warmup=0) for kind in ("cpu", "cpu", "slow")]
    for i, part in enumerate(parts):
        for j, u in enumerate(part.entries[0].units):
            u.fwd_ms, u.bwd_ms, u.fixed_ms = 1.0 + i + j, 2.0 * (1 + i), 0.1 * i
        part.entries[0].overheads = Overheads(microbatch_ms=1.0 + i, p2p_latency_ms=0.5 * i)
    mean = mean_over_ranks(parts)
    cpu, slow = mean.get("cpu", "32-true"), mean.get("slow", "32-true")
    assert [(u.fwd_ms, u.bwd_ms, u.fixed_ms) for u in cpu.units] == [
        pytest.approx((1.5 + j, 3.0, 0.05)) for j in range(len(units))]
    assert cpu.overheads.microbatch_ms == 1.5 and cpu.overheads.p2p_latency_ms == 0.25
    assert "mean of 2 ranks" in cpu.source
    assert [u.fwd_ms for u in slow.units] == [3.0 + j for j in range(len(units))] and slow.source == "measured"
    other = profile_units(units[:2], x, "cpu", repeats=1, warmup=0)
    with pytest.raises(ProfileMismatchError):
        mean_over_ranks([parts[0], other])
