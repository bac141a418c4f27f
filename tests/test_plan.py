"""Stage plans: decorators, explicit specs and JSON produce the same validated plan."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_hpp import PlanError, StagePlan, StageSpec, stage
from lightning_hpp.model.units import find_units


@stage(0, device="a100", precision="16-mixed", clip_norm=1.0)
class Encoder(nn.Linear):
    pass


@stage(1, device="h100", precision="bf16-mixed", clip_norm=0.3)
class Block(nn.Linear):
    pass


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder(4, 4)
        self.blocks = nn.ModuleList([Block(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)
        self.loss = nn.CrossEntropyLoss()


def test_units_expand_containers_and_skip_loss_modules():
    assert [n for n, _ in find_units(Model())] == ["encoder", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_decorators_give_the_same_plan_as_explicit_specs_and_json(tmp_path):
    units = find_units(Model())
    from_decorators = StagePlan.from_decorators(units)
    explicit = StagePlan(
        [
            StageSpec(modules=["encoder"], device="a100", precision="16-mixed", clip_norm=1.0),
            StageSpec(modules=["blocks.0-2"], device="h100", precision="bf16-mixed", clip_norm=0.3),
            StageSpec(modules=["head"]),
        ]
    )
    names = [n for n, _ in units]
    assert from_decorators.resolve(names) == explicit.resolve(names)
    assert from_decorators.to_dict() == explicit.with_modules(explicit.resolve(names)).to_dict()
    path = tmp_path / "stage_plan.json"
    from_decorators.save(str(path))
    assert StagePlan.load(str(path)).to_dict() == from_decorators.to_dict()
    # an undecorated trailing unit opens the stage after the last decorated one
    assert from_decorators.stages[2].modules == ["head"] and from_decorators.stages[2].precision is None


def test_container_name_means_all_its_items():
    names = [n for n, _ in find_units(Model())]
    plan = StagePlan([StageSpec(modules=["encoder", "blocks"]), StageSpec(modules=["head"])])
    assert plan.resolve(names) == [["encoder", "blocks.0", "blocks.1", "blocks.2"], ["head"]]


@pytest.mark.parametrize(
    "stages, message",
    [
        ([["encoder", "blocks.0-2"], []], "Stage 1 has no units"),
        ([["encoder"], ["blocks.0-1"]], "are in no stage"),
        ([["encoder", "blocks.0-2", "head"], ["head"]], "in stage 0 and stage 1"),
        ([["blocks.0-2"], ["encoder", "head"]], "contiguous units in model order"),
        ([["encoder", "blocks.0-5", "head"]], "names units that do not exist"),
        ([["encoder", "decoder"], ["blocks", "head"]], "'decoder' is not a unit"),
    ],
)
def test_bad_plans_are_refused_with_the_reason(stages, message):
    names = [n for n, _ in find_units(Model())]
    with pytest.raises(PlanError, match=message):
        StagePlan([StageSpec(modules=m) for m in stages]).resolve(names)


def test_decorator_stage_ids_with_gaps_are_refused():
    @stage(0)
    class A(nn.Linear):
        pass

    @stage(2)
    class B(nn.Linear):
        pass

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = A(2, 2), B(2, 2)

    with pytest.raises(PlanError, match=r"have gaps \(missing \[1\]\)"):
        StagePlan.from_decorators(find_units(M()))


def test_bad_fields_are_refused():
    with pytest.raises(PlanError, match="precision 'fp4' is not supported"):
        StageSpec(modules=["a"], precision="fp4")
    with pytest.raises(PlanError, match="must be > 0"):
        StageSpec(modules=["a"], clip_norm=0)
    with pytest.raises(PlanError, match=r"`@stage\(stage_id=-1\)`: must be an integer >= 0"):
        stage(-1)
    with pytest.raises(PlanError, match="unknown keys \\['precison'\\]"):
        StagePlan.from_dict({"stages": [{"modules": ["a"], "precison": "fp8"}]})
    with pytest.raises(PlanError, match="not valid JSON"):
        StagePlan.from_json("{stages: ")
    with pytest.raises(PlanError, match="does not exist"):
        StagePlan.load("/nonexistent/stage_plan.json")


def test_parameters_registered_on_the_module_itself_are_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(nn.init.ones_(nn.Linear(1, 1).weight))
            self.a = nn.Linear(1, 1)

    with pytest.raises(PlanError, match=r"registers parameters \['scale'\] directly"):
        find_units(M())


def test_decorators_of_one_stage_must_agree_on_activation_checkpointing():
    @stage(0, activation_checkpointing=True)
    class A(nn.Linear):
        pass

    @stage(0, activation_checkpointing=False)
    class B(nn.Linear):
        pass

    @stage(0)
    class C(nn.Linear):
        pass

    class M(nn.Module):
        def __init__(self, second):
            super().__init__()
            self.a, self.b = A(2, 2), second(2, 2)

    with pytest.raises(PlanError,
                       match="Stage 0 is declared twice with different activation_checkpointing: True and False"):
        StagePlan.from_decorators(find_units(M(B)))
    # a declaration that leaves it unset takes the stage's value
    assert StagePlan.from_decorators(find_units(M(C))).stages[0].activation_checkpointing is True
