"""``torch.compile`` per block (``HPPStrategy(compile=...)``, lightning_hpp.pipeline.compile): the options refused
early, the blocks a stage holds compiled after tensor parallel and before FSDP2, the modules a user compiled in
place kept compiled; and, in the shared 2-rank job of tests/conftest.py (``real_model_jobs``), a sequential MLP and
a traced Llama cut in two, every block compiled (``aot_eager``: torch's compiler stack without code generation,
which takes minutes on these cores), train equal to one process at every step's loss and every parameter (1e-5).
The speed of inductor's C++ code is measured in benchmarks/throughput (``--compile``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hpp import HPPStrategy
from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.compile import compile_blocks, compile_options, eager, user_compiled

AOT = {"backend": "aot_eager"}
RUNS = {
    "mlp_compiled": {"model": "deep_mlp", "points": ["model.4"], "n_micro": 2, "batch": 8},
    "llama_compiled": {"model": "llama", "points": ["model.model.layers.1"], "n_micro": 2, "batch": 8},
}


def two_rank_runs(out) -> list[dict]:
    """This module's configurations for the shared 2-rank job (tests/conftest.py: ``real_model_jobs``)."""
    return [{"schedule": "1f1b", "pp": 2, "steps": 3, **cfg, "strategy": {"compile": AOT}, "name": name,
             "out": str(out / name)} for name, cfg in RUNS.items()]


def test_compile_options_are_checked_when_the_strategy_is_built():
    assert compile_options(False) is None and compile_options(True) == {} and compile_options(AOT) == AOT
    assert HPPStrategy(compile=True).spec.compile is True
    with pytest.raises(PlanError, match=r"`HPPStrategy\(compile='yes'\)`: give True.*backend, mode, fullgraph"):
        HPPStrategy(compile="yes")
    with pytest.raises(PlanError, match=r"compile=\{'speed': 1\}"):
        HPPStrategy(compile={"speed": 1})


def test_the_blocks_a_stage_holds_are_compiled_deepest_first_and_a_users_compiled_modules_kept():
    class Stage(nn.Module):  # the sequential frontend's stage: the user's modules as its units
        def __init__(self, units):
            super().__init__()
            self.units = nn.ModuleList(units)

    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 4), nn.Linear(4, 2))
    model[2].compile(**AOT)
    assert user_compiled(model) == ["2"]
    with eager(model) as names:  # the cut captures the module's own computation
        assert names == ["2"] and model[2]._compiled_call_impl is None
    assert model[2]._compiled_call_impl is not None
    done = compile_blocks({0: Stage([model[0], model[1]])}, ["0", "0.0", "1", "2"], model, AOT)
    assert done == ["0.0", "1"]  # "0" holds a compiled block already; "2" is another stage's
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), nn.Sequential(*[m for m in model])(x))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_compiled_blocks_train_as_one_process(real_model_jobs, name):
    from tests.harness.results import load_rank
    from tests.test_real_models import assert_matches, reference

    out = real_model_jobs.compiled / name
    cfg = RUNS[name]
    ref_model, ref_losses = reference(cfg["model"], 3, cfg["batch"], cfg["n_micro"])
    assert_matches(ref_model, ref_losses, out, [0, 1])
    for r in (0, 1):
        compiled = load_rank(out, r)["plan"]["meta"]["compiled"]
        assert compiled and all(n.startswith("model.") for n in compiled), compiled
