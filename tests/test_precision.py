"""Per-stage precision: each mode against the fp32 reference, loss scaling, clipping, the NaN guard."""

from __future__ import annotations

import pytest
import torch

from lightning_hpp import StagePlan, StageSpec
from lightning_hpp.errors import FP8Error
from lightning_hpp.pipeline.stage import StageModule
from lightning_hpp.precision.plugin import HPPPrecision, StageView
from tests.harness.results import load_rank, merged_state
from tests.harness.zoo import MLP
from tests.reference import train_reference

TWO = [["layers.0-3"], ["layers.4-6"]]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


MODES = ["16-mixed", "bf16-mixed", "16-true", "bf16-true", "fp8"]


def _mode_runs() -> list[dict]:
    runs = [
        {"name": m, "stages": TWO, "schedule": "1f1b", "n_micro": 4, "steps": 5, "batch": 16,
         "precisions": ["32-true", m],
         "precision": {"fp8_backend": "emulate"}}
        for m in MODES
    ]
    # an fp16 stage whose gradients overflow at the initial scale: the step is skipped on every rank
    runs.append({"name": "overflow", "stages": TWO, "schedule": "1f1b", "n_micro": 4, "steps": 1, "batch": 16,
                 "precisions": ["16-mixed", "32-true"], "init_scale": 2.0**60})
    return runs


def _clip_runs() -> list[dict]:
    runs = [
        {"name": "per_stage", "clip_norms": [0.05, 0.02], "precision": {"clip": "per-stage"}},
        {"name": "global", "gradient_clip_val": 0.03, "precision": {"clip": "global"}},
        {"name": "norms_only", "precision": {"log_grad_norms": True}},  # nothing clips, the norms are asked for
        {"name": "no_clip"},  # nothing clips, nobody asks: the norms are not taken
    ]
    for r in runs:
        r.update(stages=TWO, schedule="gpipe", n_micro=2, steps=1, batch=16)
    return runs


def two_rank_runs(out) -> list[dict]:
    """This module's configurations for the shared 2-rank ``run_hpp`` job of tests/conftest.py (``hpp_jobs``):
    ``out / name`` holds each run's outputs."""
    return [{**r, "out": str(out / r["name"])} for r in _mode_runs() + _clip_runs()]


@pytest.fixture(scope="module")
def two_rank_runs_dir(hpp_jobs):
    return hpp_jobs.precision


@pytest.mark.slow
def test_each_mode_trains_close_to_fp32_and_overflow_skips_everywhere(two_rank_runs_dir):
    tmp_path, modes = two_rank_runs_dir, MODES
    reference, _ = train_reference(steps=5, batch=16)
    ref = reference.state_dict()
    for m in modes:
        got = merged_state(tmp_path / m, [0, 1])
        diff = _max_diff(got, ref)
        # no step overflows at the default loss scale here (the overflow run below is the one that does)
        assert [load_rank(tmp_path / m, r)["skipped_steps"] for r in (0, 1)] == [0, 0], m
        # close to fp32 (tolerance stated per mode, about 4x what was measured), but really computed in the
        # lower precision; measured: 2.4e-5, 1.6e-4, 2.5e-4, 2.0e-3, 1.7e-3
        bound = {"16-mixed": 1e-4, "bf16-mixed": 1e-3, "16-true": 1e-3, "bf16-true": 1e-2, "fp8": 1e-2}[m]
        assert 0 < diff < bound, f"{m}: max |param - fp32| = {diff}"
        meta = load_rank(tmp_path / m, 0)["plan_meta"]
        assert meta["boundary_dtypes"] == ["float32"]
    fp8_meta = load_rank(tmp_path / "fp8", 1)["plan_meta"]
    assert fp8_meta["precision"][1].startswith("fp8-emulated")
    assert load_rank(tmp_path / "16-mixed", 1)["plan_meta"]["loss_scaling"].startswith("dynamic")
    # overflow: both ranks skipped the step, lowered the scale, and kept their initial parameters
    init = MLP().state_dict()
    for rank in (0, 1):
        out = load_rank(tmp_path / "overflow", rank)
        assert out["skipped_steps"] == 1
        assert out["loss_scale"] == 2.0**59
    assert _max_diff(merged_state(tmp_path / "overflow", [0, 1]), init) == 0.0
    assert load_rank(tmp_path / "overflow", 0)["plan_meta"]["boundary_dtypes"] == ["float16"]


@pytest.mark.slow
def test_clipping_per_stage_and_global_equal_hand_computed_reference(two_rank_runs_dir):
    tmp_path = two_rank_runs_dir

    # hand-computed: the first batch of the (shuffled) reference order, one SGD step (momentum buffer = grad)
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.harness.zoo import make_dataset

    ds = make_dataset(128)
    x, y = next(iter(DataLoader(ds, batch_size=16,
                                sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))))
    model = MLP()
    F.cross_entropy(model(x), y).backward()
    stage_params = [[p for n, p in model.named_parameters() if int(n.split(".")[1]) <= 3],
                    [p for n, p in model.named_parameters() if int(n.split(".")[1]) >= 4]]
    norms = [torch.sqrt(sum((p.grad**2).sum() for p in ps)) for ps in stage_params]
    expected = {}
    for mode in ("per_stage", "global"):
        if mode == "per_stage":
            coefs = [min(1.0, 0.05 / float(norms[0])), min(1.0, 0.02 / float(norms[1]))]
        else:
            coefs = [min(1.0, 0.03 / float(torch.sqrt(norms[0] ** 2 + norms[1] ** 2)))] * 2
        expected[mode] = {n: (p - 0.1 * p.grad * coefs[0 if int(n.split(".")[1]) <= 3 else 1]).detach()
                          for n, p in model.named_parameters()}
        assert max(coefs) < 1.0  # the thresholds really clip
    for mode in ("per_stage", "global"):
        got = merged_state(tmp_path / mode, [0, 1])
        for name, value in expected[mode].items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
        m0 = load_rank(tmp_path / mode, 0)["metrics"]
        assert m0["grad_norm/stage_0"] == pytest.approx(float(norms[0]), rel=1e-4)
        assert m0["grad_norm/stage_1"] == pytest.approx(float(norms[1]), rel=1e-4)
    unclipped = {n: (p - 0.1 * p.grad).detach() for n, p in model.named_parameters()}
    for mode in ("norms_only", "no_clip"):
        got = merged_state(tmp_path / mode, [0, 1])
        for name, value in unclipped.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    m0 = load_rank(tmp_path / "norms_only", 0)["metrics"]
    assert m0["grad_norm/stage_0"] == pytest.approx(float(norms[0]), rel=1e-4)
    assert m0["grad_norm/stage_1"] == pytest.approx(float(norms[1]), rel=1e-4)
    assert not any(k.startswith("grad_norm/") for k in load_rank(tmp_path / "no_clip", 0)["metrics"])


def _stage_modules(model, precisions):
    plan = StagePlan([StageSpec(modules=m, precision=p) for m, p in zip(TWO, precisions)])
    names = [f"layers.{i}" for i in range(7)]
    plan = plan.with_modules(plan.resolve(names))
    sms = {k: StageModule(ms, [model.get_submodule(n) for n in ms], k,
                          spread=(k == 0)) for k, ms in enumerate(plan.stages[i].modules for i in range(2))}
    view = StageView(stages=sms, microbatch=lambda s: 3)  # no process group; step -1
    return plan, sms, view


def test_fp8_stage_on_cpu_is_refused_without_emulation():
    model = MLP()
    plan, sms, view = _stage_modules(model, ["32-true", "fp8"])
    with pytest.raises(FP8Error, match="Stage 1 .*'cpu'.*fp8_backend='emulate'"):
        HPPPrecision().configure_stages(plan, view, "32-true", torch.device("cpu"), "cpu")


def test_nan_guard_names_the_stage_and_microbatch_and_sanitize_replaces():
    def resolve(view):  # what the runner does once per step: every check gets every position's flag
        for check in view.step_checks:
            check.resolve([float(check.flag())])

    model = MLP()
    plan, sms, view = _stage_modules(model, ["32-true", "32-true"])
    HPPPrecision(nonfinite="raise").configure_stages(plan, view, "32-true", torch.device("cpu"), "cpu")
    with torch.no_grad():  # a forward-only pass checks in the forward (training: before the backward, below)
        sms[0](torch.randn(4, 8))
        resolve(view)  # finite: nothing to report
        model.layers[2].bias.fill_(float("nan"))
        sms[0](torch.randn(4, 8))  # flagged on the device, decided once per step
    with pytest.raises(FloatingPointError, match=r"leaving stage 0 \(micro-batch 3, step -1\)"):
        resolve(view)
    for check in view.step_checks:
        check.reset()
    with pytest.raises(FloatingPointError, match=r"pipeline position\(s\) \[1\]"):
        view.step_checks[0].resolve([0.0, 1.0])  # another position found it: this rank raises as well
    model2 = MLP()
    plan, sms, view = _stage_modules(model2, ["32-true", "32-true"])
    HPPPrecision(nonfinite="sanitize").configure_stages(plan, view, "32-true", torch.device("cpu"), "cpu")
    with torch.no_grad():
        model2.layers[2].bias.fill_(float("nan"))
    out = sms[0](torch.randn(4, 8))
    assert torch.isfinite(out).all()
    with pytest.warns(RuntimeWarning, match="Replaced with finite values"):
        resolve(view)


def test_nan_guard_checks_gradients_at_boundaries_only():
    model = MLP()
    plan, sms, view = _stage_modules(model, ["32-true", "32-true"])
    HPPPrecision(nonfinite="raise").configure_stages(plan, view, "32-true", torch.device("cpu"), "cpu")
    (guard,) = view.step_checks
    hidden = sms[0](torch.randn(4, 8))
    out = sms[1](hidden.detach().requires_grad_())
    assert guard._events == []  # a training forward's activations are checked before the stage's backward
    # what the pipeline stage hands its gradient hooks before each backward (stage, micro-batch, the forward's output,
    # the arriving gradients): the last stage's gradient comes from the user's loss, not from another stage (None);
    # stage 0's from stage 1
    for k, output, grads in ((1, (out,), None), (0, (hidden,), (torch.full_like(hidden, float("nan")), None))):
        for hook in sms[k].grad_hooks:
            hook(k, 5, output, grads)
    kinds = [(where[0], where[1]) for where, _, _ in guard._events]
    assert kinds == [("forward", 1), ("forward", 0), ("gradient", 0)]
    with pytest.raises(FloatingPointError, match=r"gradient arriving at stage 0 from stage 1 \(micro-batch 5"):
        guard.resolve([float(guard.flag())])
    with torch.no_grad():  # evaluation: checked in the forward
        sms[0](torch.randn(4, 8))
    assert [where[0] for where, _, _ in guard._events] == ["forward"]
    sanitized = HPPPrecision(nonfinite="sanitize")
    plan, sms, view = _stage_modules(MLP(), ["32-true", "32-true"])
    sanitized.configure_stages(plan, view, "32-true", torch.device("cpu"), "cpu")
    grad = torch.tensor([1.0, float("nan"), float("inf")])
    for hook in sms[0].grad_hooks:
        hook(0, 0, (), (grad,))
    assert torch.isfinite(grad).all() and grad[0] == 1.0  # replaced in place, before the backward reads it


def test_bad_precision_options_are_refused():
    from lightning_hpp import PlanError

    with pytest.raises(PlanError, match="`HPPPrecision\\(clip='both'\\)` is not supported"):
        HPPPrecision(clip="both")
    with pytest.raises(PlanError, match="`HPPPrecision\\(nonfinite='ignore'\\)`"):
        HPPPrecision(nonfinite="ignore")


def test_precision_options_given_to_the_strategy_name_hpp_precision():
    from lightning_hpp import HPPStrategy, PlanError

    for name, value in (("clip", "global"), ("fp8_backend", "emulate"), ("fp8_recipe", "current"),
                        ("nonfinite", "warn")):
        # the error names the option's new home
        with pytest.raises(PlanError,
                           match=rf"unexpected keyword argument '{name}'\. It moved: .*HPPPrecision\({name}=\.\.\.\)"):
            HPPStrategy(**{name: value})
