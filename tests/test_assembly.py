"""The assembly layer and the strategy's contract pieces, without processes: the pipeline options kept as
given, the setups refused, the checkpoint session's refusals, the protocol callbacks read, the example call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

from lightning_hpp import HPPPrecision, HPPStrategy, StagePlan
from lightning_hpp.assembly import PipelineSpec, example_call
from lightning_hpp.assembly.callbacks import refuse_unkept_setups
from lightning_hpp.checkpoint.session import CheckpointSession
from lightning_hpp.errors import CheckpointError, PlanError, ScheduleError
from lightning_hpp.options import CheckpointOptions
from lightning_hpp.pipeline.view import PipelineView, pipeline_view
from tests.harness.zoo import MLP


def test_the_options_as_given_are_kept_and_validated():
    plan = StagePlan.split_at(["layers.2"])
    strategy = HPPStrategy(plan=plan, n_microbatches=8)
    assert strategy.spec == PipelineSpec(plan=plan, n_microbatches=8)
    assert (strategy.schedule, strategy.n_microbatches, strategy.plan) == ("1f1b", 8, None)  # before setup
    assert HPPStrategy(plan="auto").spec.auto and HPPStrategy(plan="auto").spec.schedule is None
    with pytest.raises(ScheduleError, match=r"`HPPStrategy\(schedule='2f2b'\)` is unknown"):
        PipelineSpec(schedule="2f2b")
    with pytest.raises(PlanError, match=r"`HPPStrategy\(pp_degree=0\)`: must be a positive integer or None"):
        PipelineSpec(pp_degree=0)
    with pytest.raises(PlanError, match=r"`HPPStrategy\(n_microbatches=True\)`"):
        PipelineSpec(n_microbatches=True)
    with pytest.raises(PlanError, match="got int"):
        PipelineSpec(plan=3)


def test_pp_degree_before_setup_comes_from_the_plan_or_the_world():
    assert PipelineSpec(plan=StagePlan.split_at(["layers.2", "layers.4"])).pp_before_setup(6, None) == 3
    assert PipelineSpec(plan=StagePlan.split_at(["a", "b", "c"]),
                        schedule="interleaved1f1b").pp_before_setup(8, None) == 2
    assert PipelineSpec(pp_degree=2).pp_before_setup(8, None) == 2
    assert PipelineSpec().pp_before_setup(4, MLP()) == 4  # no plan, no decorators: one position per rank


class _Manual(MLP):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _OtherIO(TorchCheckpointIO):
    pass


def test_setups_a_pipeline_would_silently_change_are_refused():
    refuse_unkept_setups(MLP(), HPPPrecision(), checkpoint_io=TorchCheckpointIO(), fitting=True,
                         precision_flag="32-true")
    with pytest.raises(PlanError, match="the CheckpointIO plugin _OtherIO would not be used"):
        refuse_unkept_setups(MLP(), HPPPrecision(), checkpoint_io=_OtherIO(), fitting=True, precision_flag="32-true")
    with pytest.raises(PlanError, match=r"`_Manual.automatic_optimization = False` cannot run under HPPStrategy"):
        refuse_unkept_setups(_Manual(), HPPPrecision(), checkpoint_io=None, fitting=True, precision_flag="32-true")
    refuse_unkept_setups(_Manual(), HPPPrecision(), checkpoint_io=None, fitting=False,
                         precision_flag="32-true")  # validate
    with pytest.raises(PlanError,
                       match=r"`Trainer\(precision='bf16-mixed'\)` and `HPPPrecision\(default='16-mixed'\)` disagree"):
        refuse_unkept_setups(MLP(), HPPPrecision(default="16-mixed"), checkpoint_io=None, fitting=True,
                             precision_flag="bf16-mixed")


def test_the_checkpoint_session_refuses_what_it_would_ignore(tmp_path):
    session = CheckpointSession(CheckpointOptions(dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match=r"`Trainer\(enable_checkpointing=False\)` turns checkpointing off"):
        session.check_setup(fitting=True, checkpointing=False)
    session.check_setup(fitting=False, checkpointing=False)
    with pytest.raises(CheckpointError, match=r"`storage_options=\{'key': 'x'\}` is not used by HPPStrategy"):
        session.save({}, tmp_path / "ckpt", MLP(), [], global_rank=0, position=0, replica=0, extra={},
                     storage_options={"key": "x"})
    step_saver = session.step_callback([])
    assert step_saver is not None and step_saver.dirpath == str(tmp_path)
    assert session.step_callback([step_saver]) is None  # one is there already
    meta = session.metadata(plan={"stages": []}, metrics={"loss": torch.tensor(0.5), "vec": torch.ones(2)},
                            hyper_parameters=None, fingerprint=None)
    assert meta["metrics"] == {"loss": 0.5}


def test_callbacks_read_the_pipeline_view_of_a_strategy_that_implements_it():
    class Trainer:
        def __init__(self, strategy):
            self.strategy = strategy

    hpp = HPPStrategy()
    assert pipeline_view(Trainer(hpp)) is hpp  # before setup too: no property is evaluated
    assert pipeline_view(Trainer(DDPStrategy())) is None
    assert {"plan", "mesh", "runner", "stage_ids", "dp_group", "step_stats", "device_kind"} <= set(vars(PipelineView))


class _Collects(MLP):
    def __init__(self):
        super().__init__()
        self.outputs, self.calls = [], 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.outputs.append(loss)
        self.calls += 1
        return loss


def test_the_example_call_leaves_the_step_state_and_never_takes_one_sample():
    model = _Collects()
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    args, kwargs = example_call(model, model.training_step, batch, parts=4)
    assert args[0].shape == (2, 8) and not kwargs  # a one-sample micro-batch is taken two samples large
    assert model.outputs == [] and model.calls == 0  # what the checking run appended is put back
    args, _ = example_call(model, model.training_step, batch, parts=4, at_least_two=False)
    assert args[0].shape == (1, 8)
    with pytest.raises(PlanError, match="calls `self\\(...\\)` more than once"):
        twice = MLP()
        twice.training_step = lambda b, i: twice(b[0]).sum() + twice(b[0]).sum()
        twice.training_step.__name__ = "training_step"
        example_call(twice, twice.training_step, batch, parts=2)
