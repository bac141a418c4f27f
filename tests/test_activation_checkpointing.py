"""Activation checkpointing per stage: the same numbers as without it, and a real recompute.

In-process (no torch.distributed): the model is cut with ``cut_model`` and its stages are built as
``StageModule``s with and without ``checkpoint_activations``, then run as the pipeline runs them:
every micro-batch's forward first, then the backwards (so later micro-batches have already updated
the BatchNorm statistics and fp8 amax histories before an earlier one is recomputed).
"""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from torch import nn

from lightning_hpp import PlanError, StagePlan, StageSpec, stage
from lightning_hpp.model.frontend import cut_model
from lightning_hpp.pipeline.stage import StageModule
from tests.harness.zoo import MLP
from tests.harness.zoo.real import LMWrapper, dataset

STEPS, MICROBATCHES = 2, 2


class BNDropoutMLP(L.LightningModule):
    def __init__(self, cumulative: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Tanh(),
            # momentum=None: a cumulative average, whose factor reads num_batches_tracked (torch.export cannot
            # capture it)
            nn.Linear(16, 16), nn.BatchNorm1d(16, momentum=None if cumulative else 0.1), nn.Dropout(0.2), nn.Tanh(),
            nn.Linear(16, 4),
        )

    def forward(self, x):
        return self.layers(x)


def _stages(cut, checkpoint: bool) -> list[StageModule]:
    return [StageModule(cut.plan.stages[k].modules, cut.bodies["train"][k], k, spread=cut.spread[k],
                        captured=cut.frontend == "traced", checkpoint_activations=checkpoint)
            for k in range(cut.plan.num_stages)]


def _chain(stages: list[StageModule], inputs: tuple):
    x = inputs
    for sm in stages:
        x = sm(*x) if isinstance(x, tuple) else sm(x)
    return x


def _train(model: nn.Module, stages: list[StageModule], microbatches: list[tuple], loss_of, flatten=None):
    """``STEPS`` steps of forward-all / backward-all over the micro-batches (no optimizer: the gradients
    accumulate); the outputs, gradients and buffers after them."""
    torch.manual_seed(1234)  # dropout draws from here
    outputs = []
    for _ in range(STEPS):
        losses = []
        for mb in microbatches:
            y = _chain(stages, flatten(mb) if flatten else mb)
            outputs.append(y.detach().clone())
            losses.append(loss_of(y))
        for loss in reversed(losses):
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return outputs, grads, buffers


def _assert_identical(a, b):
    (out_a, grads_a, bufs_a), (out_b, grads_b, bufs_b) = a, b
    assert len(out_a) == len(out_b) == STEPS * MICROBATCHES
    for i, (x, y) in enumerate(zip(out_a, out_b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"output {i}")
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=0, atol=0, msg=name)
    assert bufs_a.keys() == bufs_b.keys()
    for name, v in bufs_a.items():
        torch.testing.assert_close(bufs_b[name], v, rtol=0, atol=0, msg=name)


def _count_unit_calls(stages: list[StageModule]) -> list[int]:
    calls = [0]

    def pre_hook(module, args):  # a pre-hook: the recompute may stop before the unit's forward returns
        calls[0] += 1

    for sm in stages:
        sm.units[0].register_forward_pre_hook(pre_hook)
    return calls


@pytest.mark.parametrize("frontend", ["sequential", "traced"])
def test_a_batchnorm_dropout_chain_is_bitwise_identical_with_checkpointing(frontend):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    microbatches = [(t,) for t in x.chunk(MICROBATCHES)]
    plan = StagePlan.split_at(["layers.4"])
    results, calls = {}, {}
    for checkpoint in (False, True):
        model = BNDropoutMLP(cumulative=frontend == "sequential")
        cut = cut_model(model, plan, (microbatches[0], {}), frontend=frontend)
        assert cut.frontend == frontend
        stages = _stages(cut, checkpoint)
        counter = _count_unit_calls(stages)
        results[checkpoint] = _train(model, stages, microbatches, lambda y: y.square().mean())
        calls[checkpoint] = counter[0]
    _assert_identical(results[False], results[True])
    # the first unit of each stage ran once per micro-batch, and once more in the recompute
    assert calls == {False: 2 * STEPS * MICROBATCHES, True: 2 * 2 * STEPS * MICROBATCHES}
    # the running statistics were updated once per micro-batch, not once more in the recompute
    buffers = results[True][2]
    tracked = [v for n, v in buffers.items() if n.endswith("num_batches_tracked")]
    assert [int(t) for t in tracked] == [STEPS * MICROBATCHES] * 2
    # and dropout did drop (outputs of the same micro-batch differ between the steps)
    assert not torch.equal(results[True][0][0], results[True][0][MICROBATCHES])


def test_a_traced_gpt2_stage_with_dropout_is_bitwise_identical_with_checkpointing():
    ids, mask, labels = dataset("gpt2", 8)[:]
    microbatches = [((i,), {"attention_mask": m}) for i, m in zip(ids.chunk(MICROBATCHES), mask.chunk(MICROBATCHES))]
    plan = StagePlan.split_at(["model.transformer.h.2"])
    results, calls = {}, {}
    for checkpoint in (False, True):
        gpt = LMWrapper("gpt2")
        for m in gpt.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.1  # the tiny config turns dropout off; the recompute must replay its masks
        cut = cut_model(gpt, plan, microbatches[0])
        assert cut.frontend == "traced"
        stages = _stages(cut, checkpoint)
        assert len(stages[0].units) == 1  # the unit is the whole captured stage
        counter = _count_unit_calls(stages)
        results[checkpoint] = _train(gpt, stages, microbatches, lambda y: y.float().square().mean(),
                                     flatten=lambda mb: cut.flatten(*mb))
        calls[checkpoint] = counter[0]
    _assert_identical(results[False], results[True])
    assert calls == {False: 2 * STEPS * MICROBATCHES, True: 2 * 2 * STEPS * MICROBATCHES}
    assert not torch.equal(results[True][0][0], results[True][0][MICROBATCHES])  # dropout did drop


@pytest.mark.parametrize("precision, frontend", [("fp8", "sequential"), ("fp8", "traced"), ("bf16-mixed", "traced")])
def test_stage_precision_contexts_are_bitwise_identical_with_checkpointing(precision, frontend):
    """The recompute runs in the stage's context again (autocast, the fp8 emulation) and reads the amax
    history as the forward did, although the later micro-batches have advanced it since."""
    from lightning_hpp import HPPPrecision
    from lightning_hpp.precision.plugin import StageView
    from tests.harness.zoo import Wide

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    microbatches = [(t * (i + 1),) for i, t in enumerate(x.chunk(MICROBATCHES))]  # different amaxes per micro-batch
    plan = StagePlan.split_at(["layers.2"], precision=[precision, "32-true"])
    results, calls = {}, {}
    for checkpoint in (False, True):
        model = Wide()
        cut = cut_model(model, plan, (microbatches[0], {}), frontend=frontend)
        stages = _stages(cut, checkpoint)
        HPPPrecision(fp8_backend="emulate").configure_stages(cut.plan, StageView(dict(enumerate(stages))), "32-true",
                                                             torch.device("cpu"), "cpu")
        counter = _count_unit_calls(stages)
        results[checkpoint] = _train(model, stages, microbatches, lambda y: y.square().sum())
        calls[checkpoint] = counter[0]
    _assert_identical(results[False], results[True])
    # the recompute really ran (once more per micro-batch), so the identity above is not that of one forward
    assert calls == {False: 2 * STEPS * MICROBATCHES, True: 2 * 2 * STEPS * MICROBATCHES}


def test_checkpointing_is_off_without_gradients_and_while_torch_infers_metadata():
    model = MLP(depth=4)  # no BatchNorm: the metadata pass restores buffers in place, which a backward would refuse
    x = torch.randn(8, 8)
    cut = cut_model(model, StagePlan.split_at(["layers.4"]), ((x,), {}), frontend="sequential")
    stages = _stages(cut, True)
    calls = _count_unit_calls(stages)
    with torch.no_grad():
        _chain(stages, (x,))
    assert calls[0] == 2
    for sm in stages:
        sm.inferring = True
    y = _chain(stages, (x,))
    y.sum().backward()
    assert calls[0] == 4  # no recompute in the backward
    for sm in stages:
        sm.inferring = False
    y = _chain(stages, (x,))
    y.sum().backward()
    assert calls[0] == 8


def test_a_transformer_engine_module_is_refused():
    te_linear = type("Linear", (nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"})
    sm = StageModule(["a"], [te_linear(4, 4)], 3, spread=True, checkpoint_activations=True)
    with pytest.raises(PlanError, match="Stage 3 runs `Linear` from Transformer Engine .* activation checkpointing"):
        sm(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        sm(torch.randn(2, 4))  # forward-only: nothing to recompute


# ---------------------------------------------------------------------------------- the plan field
def test_stage_spec_validates_activation_checkpointing():
    assert StageSpec(modules=["a"]).activation_checkpointing is None
    assert StageSpec(modules=["a"], activation_checkpointing=True).activation_checkpointing is True
    for bad in ("yes", "true", 1, 0.0):
        with pytest.raises(PlanError,
                           match=rf"`StageSpec\(activation_checkpointing={re.escape(repr(bad))}\)`: "
                                 r"must be True, False or None"):
            StageSpec(modules=["a"], activation_checkpointing=bad)


def test_activation_checkpointing_round_trips_through_json_and_old_plans_still_load(tmp_path):
    plan = StagePlan([StageSpec(modules=["a"], activation_checkpointing=True), StageSpec(modules=["b"])])
    assert plan.to_dict()["stages"][0]["activation_checkpointing"] is True
    path = tmp_path / "stage_plan.json"
    plan.save(str(path))
    loaded = StagePlan.load(str(path))
    assert [s.activation_checkpointing for s in loaded.stages] == [True, None]
    assert loaded.to_dict() == plan.to_dict()
    old = {"stages": [{"modules": ["a"], "device": None, "precision": None, "clip_norm": None}], "meta": {}}
    assert StagePlan.from_dict(old).stages[0].activation_checkpointing is None
    with pytest.raises(PlanError, match="unknown keys \\['act_ckpt'\\]; allowed: .*activation_checkpointing"):
        StagePlan.from_dict({"stages": [{"modules": ["a"], "act_ckpt": True}]})
    with pytest.raises(PlanError, match="must be True, False or None"):
        StagePlan.from_json('{"stages": [{"modules": ["a"], "activation_checkpointing": "on"}]}')


def test_split_at_and_stage_decorator_take_activation_checkpointing():
    plan = StagePlan.split_at(["a.1", "a.3"], activation_checkpointing=[True, False, None])
    assert [s.activation_checkpointing for s in plan.stages] == [True, False, None]
    assert [s.activation_checkpointing for s in StagePlan.split_at(
        ["a.1"], activation_checkpointing=True).stages] == [True, True]
    with pytest.raises(PlanError, match="must be True, False or None"):
        StagePlan.split_at(["a.1"], activation_checkpointing=["on", None])

    @stage(0, activation_checkpointing=True)
    class Enc(nn.Linear):
        pass

    @stage(1)
    class Head(nn.Linear):
        pass

    decorated = StagePlan.from_decorators([("enc", Enc(2, 2)), ("head", Head(2, 2))])
    assert [s.activation_checkpointing for s in decorated.stages] == [True, None]
    with pytest.raises(PlanError, match="must be True, False or None"):
        stage(0, activation_checkpointing="yes")


def test_table_shows_activation_checkpointing_only_when_a_stage_sets_it():
    assert "act_ckpt" not in StagePlan.split_at(["a.1"]).table()
    table = StagePlan.split_at(["a.1", "a.2"], activation_checkpointing=[True, None, False]).table().splitlines()
    assert table[0].split()[-1] == "act_ckpt"
    assert [row.split()[-1] for row in table[1:]] == ["on", "default", "off"]
