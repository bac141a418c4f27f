"""Frontend choice, the traced cut and its errors, without processes (cut_model is collective-free)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_hpp import PlanError, StagePlan
from lightning_hpp.errors import TraceError
from lightning_hpp.model.frontend import balanced_plan, cut_model
from tests.harness.zoo import MLP
from tests.harness.zoo.real import LMWrapper, dataset


def _run_chain(cut, mode, args, kwargs):
    x = cut.flatten(args, kwargs) if cut.flatten else args
    for k, bodies in enumerate(cut.bodies[mode]):
        if cut.spread[k]:
            x = bodies[0](*x) if isinstance(x, tuple) else bodies[0](x)
        else:
            x = bodies[0](x)
        for b in bodies[1:]:
            x = b(x)
    return cut.unflatten(x) if cut.unflatten else x


def test_a_chain_model_runs_sequential_and_traced_alike():
    model = MLP(depth=4)
    x = torch.randn(4, 8)
    plan = StagePlan.split_at(["layers.3"])
    seq = cut_model(model, plan, ((x,), {}))
    assert seq.frontend == "sequential" and seq.plan.stages[1].modules[0] == "layers.3"
    traced = cut_model(model, plan, ((x,), {}), frontend="traced")
    assert traced.frontend == "traced" and traced.plan.meta["cut_points"] == ["layers.3"]
    torch.testing.assert_close(_run_chain(traced, "train", (x,), {}), model(x), rtol=0, atol=0)
    torch.testing.assert_close(_run_chain(seq, "train", (x,), {}), model(x), rtol=0, atol=0)
    # every rank keeps the same parameters whatever the frontend
    assert seq.params == traced.params


def test_non_chain_forwards_and_keyword_calls_fall_back_to_traced():
    class Residual(MLP):
        def forward(self, x):
            h = self.layers[:4](x)
            return self.layers[4:](torch.relu(h) + 1)

    model, x = Residual(depth=4), torch.randn(4, 8)
    cut = cut_model(model, StagePlan.split_at(["layers.4"]), ((x,), {}))
    assert cut.frontend == "traced" and "not sequential at unit 'layers.4'" in cut.reason
    torch.testing.assert_close(_run_chain(cut, "eval", (x,), {}), model(x))
    with pytest.raises(PlanError, match="`forward` is not sequential at unit 'layers.4'"):
        cut_model(model, StagePlan.split_at(["layers.4"]), ((x,), {}), frontend="sequential")

    gpt = LMWrapper("gpt2")
    ids, mask, _ = dataset("gpt2", 2)[:]
    cut = cut_model(gpt, StagePlan.split_at(["model.transformer.h.2"]), ((ids,), {"attention_mask": mask}))
    assert cut.frontend == "traced"
    torch.testing.assert_close(_run_chain(cut, "train", (ids,), {"attention_mask": mask}),
                               gpt(ids, attention_mask=mask))
    # the tied embedding / LM head is one parameter used by both stages
    assert cut.shared == {"model.transformer.wte.weight": [0, 1]}
    with pytest.raises(PlanError, match="the cut points lie inside the top-level units \\(model\\)"):
        cut_model(gpt, StagePlan.split_at(["model.transformer.h.2"]), ((ids,), {"attention_mask": mask}),
                  frontend="sequential")


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # control flow on a tensor value
            h = h * 2
        return self.b(h)


class _ToList(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        n = int(x[0, 0].abs().ceil().tolist()) + 1
        return self.b(self.a(x)[:, :n])


@pytest.mark.parametrize("model_cls", [_DataDependent, _ToList])
def test_a_model_export_cannot_capture_gets_a_clear_error(model_cls):
    model = model_cls()
    with pytest.raises(TraceError) as info:
        cut_model(model, StagePlan.split_at(["b"]), ((torch.randn(3, 4),), {}), frontend="traced")
    msg = str(info.value)
    assert "torch.export cannot capture `" + model_cls.__name__ + ".forward`" in msg
    assert re.search(r"test_frontend\.py:\d+", msg), msg  # the user's line
    assert "torch.where" in msg and "frontend='sequential'" in msg
    # the user's modules are left as they were (the tracer's split markers removed from the traced instance)
    assert "forward" not in model.b.__dict__ and "_orig_forward" not in model.b.__dict__


def test_bad_cut_points_are_refused_with_the_names_to_use():
    gpt = LMWrapper("gpt2")
    ids, mask, _ = dataset("gpt2", 2)[:]
    with pytest.raises(PlanError,
                       match=r"\['model.transformer.h.9'\] is no module of the model.*top-level ones are \['model'\]"):
        cut_model(gpt, StagePlan.split_at(["model.transformer.h.9"]), ((ids,), {"attention_mask": mask}))

    class Unused(MLP):
        def __init__(self):
            super().__init__(depth=4)
            self.spare = nn.Linear(8, 8)

    with pytest.raises(PlanError, match="gave 1 stages instead of 2: a cut point whose module `forward` never calls"):
        cut_model(Unused(), StagePlan.split_at(["spare"]), ((torch.randn(4, 8),), {}), frontend="traced")


def test_split_at_and_balanced_plans():
    plan = StagePlan.split_at(["a.1", "a.3"], precision=["bf16-mixed", None, "32-true"], clip_norm=0.5)
    assert [s.precision for s in plan.stages] == ["bf16-mixed", None, "32-true"]
    assert [s.clip_norm for s in plan.stages] == [0.5] * 3
    assert StagePlan.from_json(plan.to_json()).meta["cut_points"] == ["a.1", "a.3"]
    with pytest.raises(PlanError, match="names a cut point twice"):
        StagePlan.split_at(["a.1", "a.1"])
    with pytest.raises(PlanError, match="has 2 values for 3 stages"):
        StagePlan.split_at(["a.1", "a.3"], precision=["bf16-mixed", None])

    nano = LMWrapper("nanogpt")
    assert balanced_plan(nano, 2).meta["cut_points"] == ["model.transformer.h.2"]
    assert balanced_plan(nano, 4).meta["cut_points"] == ["model.transformer.h.1", "model.transformer.h.2",
                                                         "model.transformer.h.3"]
    with pytest.raises(PlanError, match="has no list of at least 2 blocks"):
        balanced_plan(_DataDependent(), 2)


UNCAPTURABLE = [
    ("second_call", r"`training_step` calls `self\(...\)` more than once"),
    ("data_dependent",
     r"torch.export cannot capture `DataDependent.forward` for the traced frontend at .*run_traced_cases\.py:\d+"),
]


@pytest.fixture(scope="module")
def uncapturable_job(tmp_path_factory):
    """One 2-rank job whose ranks try every uncapturable step in turn, each in its own Trainer
    (tests/workers/refusals.py)."""
    from tests.harness.launch import Job, run_job

    out = tmp_path_factory.mktemp("uncapturable")
    from tests.workers.refusals import COLLECTIVE_TIMEOUT_S

    proc = run_job(Job("tests.workers.run_traced_cases", {"cases": [c for c, _ in UNCAPTURABLE], "out": str(out),
                                                          "timeout": COLLECTIVE_TIMEOUT_S},
                       ranks=2, start="forked", timeout=600), check=False)
    return proc, out


@pytest.mark.slow
@pytest.mark.parametrize("case, message", UNCAPTURABLE)
def test_uncapturable_steps_stop_every_rank_at_setup(uncapturable_job, case, message):
    from tests.workers import refusals

    proc, out = uncapturable_job
    assert proc.returncode != 0 and f"TRAINED {case}" not in proc.stdout
    # both ranks raise the same error themselves (no rank is left waiting in a collective), well before a timeout
    for record in refusals.read(out / case, 2):
        assert re.match(r"lightning_hpp\.errors\.\w+Error: " + message,
                        record["error"] or ""), (record, proc.stderr[-3000:])
        assert record["global_step"] == 0 and record["seconds"] < refusals.BOUND_S, record


def test_fp8_emulation_on_a_traced_stage_equals_the_converted_layers():
    import copy

    from lightning_hpp import HPPPrecision
    from lightning_hpp.pipeline.stage import StageModule
    from lightning_hpp.precision.plugin import StageView
    from tests.harness.zoo import Wide

    x = torch.randn(8, 32)
    plan = StagePlan.split_at(["layers.2"], precision=["fp8", "32-true"])
    results = {}
    for frontend in ("sequential", "traced"):
        model = copy.deepcopy(Wide())
        cut = cut_model(model, plan, ((x,), {}), frontend=frontend)
        stages = {k: StageModule(cut.plan.stages[k].modules, cut.bodies["train"][k], k, spread=cut.spread[k],
                                 captured=frontend == "traced") for k in range(2)}
        HPPPrecision(
            fp8_backend="emulate").configure_stages(cut.plan, StageView(stages), "32-true", torch.device("cpu"), "cpu")
        for _ in range(2):  # the second step uses the first one's amax history (delayed scaling)
            y = stages[1](stages[0](x))
            y.square().sum().backward()
        results[frontend] = (y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    fp32 = Wide()(x)
    assert (results["traced"][0] - fp32).abs().max() > 1e-4  # the fp8 rounding did happen
    torch.testing.assert_close(results["traced"][0], results["sequential"][0], rtol=0, atol=0)
    for name, grad in results["sequential"][1].items():
        torch.testing.assert_close(results["traced"][1][name], grad, rtol=0, atol=0, msg=name)


def test_stage_specs_name_modules_at_any_depth_and_are_checked_against_the_cut():
    from lightning_hpp import StageSpec

    gpt = LMWrapper("gpt2")
    ids, mask, _ = dataset("gpt2", 2)[:]
    example = ((ids,), {"attention_mask": mask})
    plan = StagePlan([StageSpec(modules=["model.transformer.wte", "model.transformer.wpe", "model.transformer.h.0-1"]),
                      StageSpec(modules=["model.transformer.h.2-3", "model.transformer.ln_f"], precision="bf16-mixed")])
    cut = cut_model(gpt, plan, example)
    assert cut.plan.meta["cut_points"] == ["model.transformer.h.2"]  # a range begins at its first item
    assert cut.plan.stages[1].precision == "bf16-mixed"
    assert "model.transformer.h.3" in cut.plan.stages[1].modules
    assert "model.transformer.h.1" in cut.plan.stages[0].modules
    wrong = StagePlan([StageSpec(modules=["model.transformer.wte", "model.transformer.ln_f"]),
                       StageSpec(modules=["model.transformer.h.2-3"])])
    with pytest.raises(PlanError,
                       match="Stage 0 lists 'model.transformer.ln_f', but with the cut points .* "
                             "forward runs it in stage 1"):
        cut_model(gpt, wrong, example)
