"""The clipping rule without processes: Lightning's global norm, the plan's per-stage limits, tied weights."""

from __future__ import annotations

import torch

from lightning_hpp.precision.clipping import clip_stages
from lightning_hpp.precision.clipping import stage_norm as params_norm


def stage_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm of a stage whose parameters hold ``grads`` (the tensors themselves, as clipping scales them)."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return params_norm(params)


def _grads(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def test_global_clip_equals_torch_over_all_parameters_counting_a_tied_weight_once():
    tied = _grads(0, (6, 3))[0]  # one weight on both stages (an embedding and its LM head)
    stage0 = [tied.clone(), *_grads(1, (3,), (4, 4))]
    stage1 = [*_grads(2, (5,)), tied.clone()]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in (stage0 + stage1[:1])]  # the one process: tied once
    for p, g in zip(params, stage0 + stage1[:1]):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.7)
    norms = torch.stack([stage_norm(stage0), stage_norm(stage1)])
    repeated_sq = torch.tensor([0.0, float(tied.pow(2).sum())], dtype=torch.float64)
    clip_stages({0: stage0, 1: stage1}, norms, {0: None, 1: None}, "norm", "global", 0.7, repeated_sq)
    expected = [p.grad for p in params]
    for got, want in zip(stage0 + stage1[:1], expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stage1[1], stage0[0], rtol=0, atol=0)  # both copies scaled alike
    assert float(norms.pow(2).sum().sqrt()) > 0.7  # the clip is active


def test_global_clip_applies_the_plans_stage_limits_first():
    stage0, stage1 = [torch.full((4,), 1.5,
                                 dtype=torch.float64)], [torch.full((4,), 2.0, dtype=torch.float64)]  # norms 3, 4
    norms = torch.stack([stage_norm(stage0), stage_norm(stage1)])
    clip_stages({0: stage0, 1: stage1}, norms, {0: 1.5, 1: None}, "norm", "global", 2.0)
    # stage 0 at its own 1.5 first, then the pipeline's norm (of the clipped stage 0 and stage 1) down to 2
    own0 = 1.5 / (3.0 + 1e-6)
    coef = 2.0 / (((3.0 * own0) ** 2 + 4.0**2) ** 0.5 + 1e-6)
    torch.testing.assert_close(stage0[0], torch.full((4,), 1.5 * own0 * coef, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(stage1[0], torch.full((4,), 2.0 * coef, dtype=torch.float64), rtol=1e-12, atol=0)


def test_per_stage_mode_uses_the_trainers_value_as_each_stages_limit():
    stage0, stage1 = [torch.full((4,), 1.5,
                                 dtype=torch.float64)], [torch.full((4,), 2.0, dtype=torch.float64)]  # norms 3, 4
    norms = {0: stage_norm(stage0), 1: stage_norm(stage1)}
    clip_stages({0: stage0, 1: stage1}, norms, {0: 1.0, 1: None}, "norm", "per-stage", 2.0)
    torch.testing.assert_close(stage_norm(stage0), torch.tensor(1.0, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(stage_norm(stage1), torch.tensor(2.0, dtype=torch.float64), rtol=1e-5, atol=0)
