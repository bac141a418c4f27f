"""Every tensor of a stage on the stage's device, checked on the CPU (tests/device_harness.py places the stages on
the ``meta`` device, where an op that mixes devices fails as it does on a GPU): both frontends, a BatchNorm stage in
bf16, a transformers Llama (RoPE ``inv_freq``, an attention mask moved inside ``forward``) eager and built on the
meta device, and GPT-2's tied embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hpp import StagePlan
from lightning_hpp.model.materialize import init_on_meta
from tests.device_harness import place_and_run
from tests.harness.zoo import MLP
from tests.harness.zoo.real import LMWrapper, dataset
from tests.workers.run_edges import BatchNormNet


def lm_call(kind: str) -> tuple[tuple, dict]:
    ids, mask, _ = dataset(kind, 4).tensors
    return (ids,), {"attention_mask": mask}


X = ((torch.randn(4, 8),), {})
CASES = {
    "mlp-sequential": (lambda: MLP(depth=4), ["layers.4"], X, "sequential", None),
    "mlp-traced": (lambda: MLP(depth=4), ["layers.4"], X, "traced", None),
    "batchnorm-traced-bf16": (BatchNormNet, ["b"], X, "traced", {1: torch.bfloat16}),
    "batchnorm-sequential-bf16": (lambda: LMWrapper("bn_mlp"), ["model.3"], X, "sequential", {0: torch.bfloat16}),
    "llama-traced": (lambda: LMWrapper("llama"), ["model.model.layers.2"], lm_call("llama"), "traced", None),
    # bf16 buffers (RoPE inv_freq) where the trace saw fp32 ones
    "llama-traced-bf16": (lambda: LMWrapper("llama"), ["model.model.layers.2"], lm_call("llama"), "traced",
                          {0: torch.bfloat16, 1: torch.bfloat16}),
    "gpt2-traced-tied": (lambda: LMWrapper("gpt2"), ["model.transformer.h.2"], lm_call("gpt2"), "traced", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_tensor_of_every_stage_is_on_the_stage_device(case):
    build, cuts, example, frontend, dtypes = CASES[case]
    used, problems = place_and_run(build(), StagePlan.split_at(cuts), example, frontend=frontend, param_dtype=dtypes)
    assert used == frontend
    assert problems == [], problems


def test_a_model_built_on_the_meta_device_traces_with_its_buffers_on_the_rank_device():
    # its buffers (RoPE inv_freq) are real, on the CPU, while the stand-ins of its parameters and the batch are on
    # the rank's device: the trace must meet them on one device
    with init_on_meta():
        model = LMWrapper("llama")
    assert next(model.parameters()).is_meta and not next(model.buffers()).is_meta
    used, problems = place_and_run(model, StagePlan.split_at(["model.model.layers.2"]), lm_call("llama"),
                                   frontend="traced")
    assert used == "traced"
    assert problems == [], problems


class AddOnes(nn.Module):
    """Creates a tensor without a device in ``forward``: wrong on a GPU, and the harness says so."""

    def forward(self, x):
        return x + torch.ones(x.shape[-1])


def test_the_harness_reports_a_tensor_left_on_the_cpu():
    model = nn.Sequential(nn.Linear(8, 8), AddOnes(), nn.Linear(8, 4))
    used, problems = place_and_run(model, StagePlan.split_at(["2"]), X, frontend="sequential")
    assert used == "sequential"
    assert len(problems) == 1 and problems[0].startswith("stage 0 forward:") and "device" in problems[0], problems
