"""Models larger than one device: built in ``configure_model()`` on the meta device, each rank
materializing only its own stages, from their own initializers or from weights on disk read
stage-locally; activation checkpointing per stage. Checked against single-process training."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from tests.harness.results import load_rank
from tests.harness.zoo.real import LMWrapper
from tests.test_real_models import assert_matches, reference

pytestmark = pytest.mark.slow


def _param_names(state: dict, model: torch.nn.Module) -> set[str]:
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {k for k in state if k in names}


def _llama_weights(tmp_path) -> LMWrapper:
    # a Llama (tied embeddings) built eagerly, saved as transformers saves it (sharded)
    L.seed_everything(0)
    eager = LMWrapper("llama", layers=4)
    eager.model.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    return eager


def _llama_runs(tmp_path) -> list[dict]:
    return [{"name": "llama_meta4", "model": "llama", "model_kw": {"layers": 4, "in_configure_model": True},
             "points": ["model.model.layers.1", "model.model.layers.2", "model.model.layers.3"], "schedule": "1f1b",
             "strategy": {"init": {"weights": str(tmp_path / "hf"), "rename": "model."}},
             "n_micro": 4, "steps": 3, "batch": 8, "out": str(tmp_path / "llama_meta4")}]


def _chain_weights(tmp_path) -> LMWrapper:
    from safetensors.torch import save_model

    L.seed_everything(0)
    eager = LMWrapper("deep_mlp", blocks=6, width=32)
    save_model(eager, str(tmp_path / "mlp.safetensors"))
    return eager


CHAIN_KW = {"blocks": 6, "width": 32, "in_configure_model": True}


def _chain_runs(tmp_path) -> list[dict]:
    kw = CHAIN_KW
    runs = [
        {"name": "file", "model": "deep_mlp", "model_kw": kw, "points": ["model.4"], "schedule": "gpipe",
         "strategy": {"init": {"weights": str(tmp_path / "mlp.safetensors")}}},
        # activation checkpointing changes nothing numerically
        {"name": "file_recompute", "model": "deep_mlp", "model_kw": kw, "points": ["model.4"], "schedule": "1f1b",
         "strategy": {"init": {"weights": str(tmp_path / "mlp.safetensors")}, "activation_checkpointing": True}},
        # their own initializers, seeded per module: the same weights under any cut (lr 0 keeps them)
        {"name": "init_a", "model": "deep_mlp", "model_kw": {**kw, "lr": 0.0}, "points": ["model.4"],
         "schedule": "1f1b"},
        {"name": "init_b", "model": "deep_mlp", "model_kw": {**kw, "lr": 0.0}, "points": ["model.2"],
         "schedule": "1f1b"},
    ]
    for r in runs:
        r.update(n_micro=4, steps=3, batch=8, out=str(tmp_path / r["name"]))
    return runs


# For the shared jobs of tests/conftest.py (``real_model_jobs``): the weights the jobs load, then this
# module's configurations by number of ranks.
def write_weights(out) -> tuple[LMWrapper, LMWrapper]:
    """Write the weights the jobs load into ``out``; return the eager Llama and chain they come from."""
    return _llama_weights(out), _chain_weights(out)


def two_rank_runs(out) -> list[dict]:
    return _chain_runs(out)


def four_rank_runs(out) -> list[dict]:
    return _llama_runs(out)


@pytest.fixture(scope="module")
def jobs(real_model_jobs):
    """(this module's dir, eager Llama, eager chain) from the shared ``run_real`` jobs (tests/conftest.py)."""
    return real_model_jobs.big, real_model_jobs.llama, real_model_jobs.chain


def test_meta_model_in_four_stages_loads_its_weights_stage_locally(jobs):
    tmp_path, eager, _ = jobs
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1  # sharded: each rank opens only its shards
    # the reference trains a fresh construction, which LMWrapper seeds: the weights just saved
    torch.testing.assert_close(eager.state_dict(), LMWrapper("llama", layers=4).state_dict(), rtol=0, atol=0)
    ref_model, ref_losses = reference("llama", 3, 8, 4, layers=4)
    assert_matches(ref_model, ref_losses, tmp_path / "llama_meta4", [0, 1, 2, 3])
    total = sum(p.numel() * p.element_size() for p in eager.parameters())
    for r in range(4):
        out = load_rank(tmp_path / "llama_meta4", r)
        assert out["meta_params"] == [] and out["plan"]["meta"]["frontend"] == "traced"
        held = _param_names(out["state"], eager)
        # this rank materialized exactly its stage's parameters, nothing of the other stages
        assert set(out["materialized"]) == {n for n in held if n in dict(eager.named_parameters())} | (
            set(out["materialized"]) & held), (r, out["materialized"])
        assert set(out["materialized"]) <= held
        stage_bytes = sum(p.numel() * p.element_size() for n, p in eager.named_parameters() if n in held)
        assert out["param_bytes"] == stage_bytes < 0.6 * total, (r, out["param_bytes"], stage_bytes, total)


def test_meta_chain_model_from_a_safetensors_file_and_from_its_initializers(jobs):
    tmp_path, _, eager = jobs
    ref_model, ref_losses = reference("deep_mlp", 3, 8, 4, blocks=6, width=32)
    kw = CHAIN_KW
    for name in ("file", "file_recompute"):
        assert load_rank(tmp_path / name, 0)["plan"]["meta"]["frontend"] == "sequential"
        assert_matches(ref_model, ref_losses, tmp_path / name, [0, 1])

    from lightning_hpp.model.materialize import init_on_meta, materialize

    with init_on_meta():
        single = LMWrapper("deep_mlp", **kw)
        single.configure_model()
    assert all(p.is_meta for p in single.parameters())
    materialize(single, torch.device("cpu"), seed=0)
    expected = single.state_dict()
    for name in ("init_a", "init_b"):
        got = {**load_rank(tmp_path / name, 0)["state"], **load_rank(tmp_path / name, 1)["state"]}
        assert sorted(got) == sorted(expected)
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    # and not the weights of an eager construction (stated in the README)
    assert not torch.equal(expected["model.1.0.weight"], copy.deepcopy(eager).state_dict()["model.1.0.weight"])
