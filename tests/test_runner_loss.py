"""The last stage's loss on one rank, in process: the micro-batches' mean (and the fp16 loss scale) enter
the backward as the loss's gradient, and a loss that is not one value is refused by name.

A one-stage pipeline on a one-rank gloo group: the runner, its schedule and torch's stage as a job runs
them, the user's ``training_step`` replayed on each micro-batch's output.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.dims import ParallelDims
from lightning_hpp.pipeline.mesh import Mesh
from lightning_hpp.pipeline.runner import PipelineRunner
from lightning_hpp.pipeline.stage import StageModule


class Regressor(L.LightningModule):
    def __init__(self, reduce: str = "mean") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.reduce = reduce

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = F.mse_loss(self(x).squeeze(-1), y, reduction="none")
        loss = {"mean": per_sample.mean(), "one": per_sample.mean().reshape(1), "none": per_sample}[self.reduce]
        self.log("train/loss", loss.mean())
        return loss


@pytest.fixture
def mesh():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = Mesh.build(ParallelDims(), 0)
    mesh.init_groups("cpu")
    yield mesh
    if owned:
        dist.destroy_process_group()


def _runner(module: Regressor, mesh: Mesh, schedule: str = "1f1b", n: int = 4) -> PipelineRunner:
    stage = StageModule(["body"], [module.body], 0, spread=True)
    return PipelineRunner(module, {0: stage}, 1, mesh, schedule, n, torch.device("cpu"))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, generator=g)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("reduce", ["mean", "one"])
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_gradients_are_the_mean_over_micro_batches_times_the_loss_scale(mesh, schedule, reduce, loss_scale):
    module = Regressor(reduce)
    reference = copy.deepcopy(module)
    x, y = _batch()
    runner = _runner(module, mesh, schedule)
    loss, _, _ = runner.train_step(module.training_step, (x, y), 0, loss_scale=loss_scale)
    # one process, the same four micro-batches: the mean of their losses, scaled, backpropagated at once
    losses = [F.mse_loss(reference(xm).squeeze(-1), ym) for xm, ym in zip(x.chunk(4), y.chunk(4))]
    (torch.stack(losses).mean() * loss_scale).backward()
    assert torch.allclose(loss, torch.stack(losses).mean().detach(), rtol=1e-6, atol=0)
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_loss_that_is_not_one_value_is_refused_with_its_shape(mesh):
    module = Regressor("none")
    runner = _runner(module, mesh)
    with pytest.raises(PlanError,
                       match=r"`training_step` returned a loss of shape \(2,\); the loss must hold one value"):
        runner.train_step(module.training_step, _batch(), 0)
