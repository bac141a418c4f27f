"""Tensor parallel inside a stage (lightning_hpp.pipeline.tensor_parallel): the plan a stage is split by (a
transformers model's ``base_model_tp_plan``, else the LightningModule's ``parallelize_stage``), its refusals,
and, on 2 gloo ranks, a tiny Llama split by its own plan: the user's modules as written and the model traced at
its local width give the losses and, after AdamW steps, the whole parameters of the unsplit model trained in
one process (1e-5); built on the meta device, each rank reads only its shards' rows and columns from a sharded
``save_pretrained`` directory (the bytes read counted), or draws them with the modules' own initializers.

Under ``HPPStrategy(pp_degree=2, sharding={"tp_degree": 2})`` on 4 ranks (the shared ``run_real`` jobs of
tests/conftest.py): a traced Llama by its own plan and a sequential MLP by its ``parallelize_stage`` hook equal
single-process training at every step's loss and every final parameter (1e-5), each rank holding half of
every split weight; on 2 ranks (pp 1 × tp 2) a model without a plan and a Llama whose key/value heads tp does
not divide are refused at setup on every rank."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_hpp.errors import PlanError
from lightning_hpp.pipeline.tensor_parallel import HOOK, TPPlan, check_frontend, resolve_tp_plan, torch_style
from tests.harness.results import load_rank
from tests.harness.zoo.real import LMWrapper

TOL = dict(rtol=1e-5, atol=1e-5)
META_LAYERS = 2


# ------------------------------------------------------------------------------------------ plans, offline
def test_a_transformers_llama_is_split_by_its_own_plan():
    plan = resolve_tp_plan(LMWrapper("llama", layers=2), 2)
    assert not plan.hook and "LlamaForCausalLM.config.base_model_tp_plan" in plan.source
    for layer in (0, 1):
        p = f"model.model.layers.{layer}"
        assert {plan.styles[f"{p}.self_attn.{x}_proj"] for x in "qkv"} == {"colwise"}
        assert plan.styles[f"{p}.self_attn.o_proj"] == "rowwise" and plan.styles[f"{p}.mlp.down_proj"] == "rowwise"
        assert plan.styles[f"{p}.mlp.gate_proj"] == plan.styles[f"{p}.mlp.up_proj"] == "colwise"
    assert len(plan.styles) == 14  # no head, no embedding, no norm: those stay whole


def test_a_model_without_a_plan_is_refused_naming_the_fix():
    with pytest.raises(PlanError, match=r"`LMWrapper` has no plan.*base_model_tp_plan.*parallelize_stage"):
        resolve_tp_plan(LMWrapper("deep_mlp", blocks=2, width=8), 2)


def test_head_counts_that_tp_does_not_divide_are_refused_naming_them():
    from transformers import LlamaConfig, LlamaForCausalLM

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=4,
                                                      num_key_value_heads=1))

    with pytest.raises(PlanError, match=r"tp_degree=2 does not divide: LlamaConfig.num_key_value_heads=1") as err:
        resolve_tp_plan(Wrapper(), 2)
    assert "num_attention_heads" not in str(err.value)  # 4 heads divide by 2
    with pytest.raises(PlanError, match=r"num_attention_heads=4.*num_key_value_heads=2"):
        resolve_tp_plan(LMWrapper("llama", layers=1), 3)


def test_the_hook_wins_and_is_refused_on_traced_stages():
    class Hooked(LMWrapper):
        def parallelize_stage(self, module, mesh):
            pass

    plan = resolve_tp_plan(Hooked("llama", layers=1), 2)
    assert plan.hook and plan.styles == {}
    check_frontend(plan, "sequential", "Hooked")
    with pytest.raises(PlanError, match=rf"`Hooked.{HOOK}.*traced"):
        check_frontend(plan, "traced", "Hooked")
    check_frontend(TPPlan({"x": "colwise"}), "traced", "M")  # a transformers plan is captured at its local width


def test_styles_are_torch_styles_and_unknown_ones_are_refused():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert isinstance(torch_style("colwise", "linear"), ColwiseParallel)
    row = torch_style("rowwise", "linear")
    assert isinstance(row,
                      RowwiseParallel) and row.input_layouts == (Shard(-1),) and row.output_layouts == (Replicate(),)
    assert torch_style("colwise_rep", "linear").output_layouts == (Replicate(),)
    with pytest.raises(PlanError, match=r"'packed_colwise' is not one lightning_hpp applies"):
        torch_style("packed_colwise", "linear")
    with pytest.raises(PlanError, match=r"'embedding_rowwise' splits an nn.Embedding, but the module is an nn.Linear"):
        torch_style("embedding_rowwise", "linear")


def test_fp8_stages_are_what_tensor_parallel_refuses_and_clipping_composes():
    from types import SimpleNamespace

    from lightning_hpp.assembly.callbacks import refuse_unkept_setups
    from lightning_hpp.assembly.compose import refuse_stage_precisions
    from lightning_hpp.errors import ShardingError
    from lightning_hpp.options import ShardingOptions

    tp2 = ShardingOptions(tp_degree=2)
    refuse_stage_precisions(tp2, ["bf16-mixed", "32-true"])
    with pytest.raises(ShardingError,
                       match=r"`ShardingOptions\(tp_degree=2\)` cannot split fp8 stages yet \(stage\(s\) "
                                            r"\[1\]\).*whole amax"):
        refuse_stage_precisions(tp2, ["bf16-mixed", "fp8"])
    with pytest.raises(ShardingError, match=r"data_parallel='fsdp'\)` cannot shard fp8 stages yet"):
        refuse_stage_precisions(ShardingOptions(data_parallel="fsdp", tp_degree=2), ["fp8"])
    # clipping composes: the norms are taken over the shards
    llama = LMWrapper("llama", layers=2)
    llama._trainer = SimpleNamespace(gradient_clip_val=0.5)
    refuse_unkept_setups(llama, None, checkpoint_io=None, fitting=True, precision_flag="32-true", sharding=tp2)


# ------------------------------------------------------------------------------------------ 2 gloo ranks
def _reference():
    """The unsplit Llama, one process, the worker's batches and optimizer."""
    from tests.workers import tp_worker

    torch.manual_seed(0)
    model = LMWrapper("llama", layers=2)
    torch.set_num_threads(1)
    losses = tp_worker.train(model, lambda ids, mask: model(ids, attention_mask=mask))
    return model.state_dict(), losses


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from tests.harness.launch import Job, run_job
    from tests.harness.results import rank_results

    out = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    eager = LMWrapper("llama", layers=META_LAYERS)
    eager.model.save_pretrained(out / "hf", max_shard_size="20KB")
    (out / "cases.json").write_text(json.dumps({"weights": str(out / "hf"), "meta_layers": META_LAYERS}))
    from pathlib import Path

    run_job(Job(Path(__file__).parent / "workers" / "tp_worker.py", str(out), ranks=2, start="per_rank", script=True,
                cwd=out, timeout=300))
    ranks = rank_results(out, 2)
    return out, ranks, eager


@pytest.mark.slow
@pytest.mark.parametrize("case", ["eager", "traced"])
def test_llama_split_over_two_ranks_trains_as_the_unsplit_model(job, case):
    out, ranks, _ = job
    ref_state, ref_losses = _reference()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r[case]["losses"]), torch.tensor(ref_losses), **TOL)
        shards = r[case]["shards"]
        # every projection of the plan is split, each rank holding half of it; the rest is whole
        q, o = (shards[f"model.model.layers.0.self_attn.{x}_proj.weight"] for x in "qo")
        assert (q["dim"], q["local"], o["dim"], o["local"]) == (0, [16, 32], 1, [32, 16])
        assert shards["model.model.embed_tokens.weight"]["dim"] is None
        assert len(r[case]["split"]) == 14
    got = torch.load(out / f"{case}.pt")
    if case == "traced":
        assert ranks[0][case]["frontend"] == "traced"
        # the forward-only capture runs on the same shards: the trained model's eval logits
        from tests.workers import tp_worker

        model = LMWrapper("llama", layers=2)
        model.load_state_dict(ref_state)
        ids, mask, _ = tp_worker.batches()[0]
        with torch.no_grad():
            torch.testing.assert_close(got.pop("eval_logits"), model.eval()(ids, attention_mask=mask), **TOL)
    assert set(got) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(got[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert ref_losses[0] != ref_losses[-1]  # it trained


@pytest.mark.slow
def test_a_meta_llama_reads_only_its_shards_from_a_sharded_save_pretrained_directory(job):
    from safetensors import safe_open

    out, ranks, eager = job
    files = sorted((out / "hf").glob("*.safetensors"))
    assert len(files) > 1 and (out / "hf" / "model.safetensors.index.json").exists()
    full = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            full.update({k: h.get_tensor(k) for k in h.keys()})
    file_bytes = sum(t.numel() * t.element_size() for t in full.values())
    for rank, r in enumerate(ranks):
        rep = r["meta_weights"]
        assert rep["meta_left"] == [] and rep["materialized"] > 0
        # every byte read is one of this rank's shards (or a whole tensor it holds whole), each read once
        assert rep["read_bytes"] == rep["local_bytes"] < 0.75 * file_bytes, \
            (rep["read_bytes"], rep["local_bytes"], file_bytes)
        local = torch.load(out / f"meta_weights.rank{rank}.pt")
        for name, value in local.items():
            if name not in rep["shards"]:
                continue  # buffers: built real, not read
            short = name.removeprefix("model.")
            whole = full[short] if short in full else full["model.embed_tokens.weight"]
            dim = rep["shards"][name]["dim"]
            expected = whole if dim is None else whole.chunk(2, dim=dim)[rank]
            torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(eager.state_dict()[name], whole, rtol=0, atol=0)


@pytest.mark.slow
def test_a_meta_llama_split_draws_the_unsplit_models_initial_weights(job):
    from lightning_hpp.model.materialize import init_on_meta, materialize

    out, ranks, _ = job
    with init_on_meta():
        single = LMWrapper("llama", in_configure_model=True, layers=META_LAYERS)
        single.configure_model()
    materialize(single, torch.device("cpu"), seed=0)
    expected = single.state_dict()
    for rank, r in enumerate(ranks):
        rep = r["meta_init"]
        assert rep["read_bytes"] == 0 and rep["meta_left"] == []
        local = torch.load(out / f"meta_init.rank{rank}.pt")
        split = 0
        for name, shard in rep["shards"].items():
            dim = shard["dim"]
            split += dim is not None
            want = expected[name] if dim is None else expected[name].chunk(2, dim=dim)[rank]
            torch.testing.assert_close(local[name], want, rtol=0, atol=0, msg=name)
        assert split == 7 * META_LAYERS


# ------------------------------------------------------------------------------------------ under HPPStrategy
TP2 = {"strategy": {"sharding": {"tp_degree": 2}}, "pp": 2, "schedule": "1f1b", "n_micro": 4, "steps": 3, "batch": 8}
LLAMA_PP2_TP2 = {"name": "llama_pp2_tp2", "model": "llama", "points": ["model.model.layers.2"], **TP2}
MLP_KW = {"blocks": 4, "width": 32}
HOOK_PP2_TP2 = {"name": "hook_pp2_tp2", "model": "deep_mlp", "wrapper": "split_mlp", "model_kw": MLP_KW,
                "points": ["model.3"], **TP2}
REFUSED = {
    "tp_no_plan": {"model": "deep_mlp", "model_kw": MLP_KW, "points": None},
    "tp_kv_heads": {"model": "llama", "model_kw": {"layers": 1, "kv_heads": 1}, "points": None},
}


def _meta_llama(weights) -> dict:
    """The 4-layer Llama of test_big_models built on the meta device, its shards read from its ``save_pretrained``
    directory (written by ``test_big_models.write_weights``)."""
    return {"name": "llama_meta_pp2_tp2", "model": "llama", "model_kw": {"layers": 4, "in_configure_model": True},
            "points": ["model.model.layers.2"], **TP2,
            "strategy": {**TP2["strategy"], "init": {"weights": str(weights), "rename": "model."}}}


# The configurations of this module for the shared jobs of tests/conftest.py (``real_model_jobs``).
def four_rank_runs(out, weights) -> list[dict]:
    return [{**r, "out": str(out / r["name"])} for r in (LLAMA_PP2_TP2, HOOK_PP2_TP2, _meta_llama(weights))]


def refused_runs(out) -> list[dict]:
    """pp 1 × tp 2 setups that must fail, tried in turn by the 2 ranks of the refusal job."""
    return [{**TP2, "pp": 1, **kw, "name": name, "out": str(out / name),
             "refused": True} for name, kw in REFUSED.items()]


@pytest.fixture(scope="module")
def strategy_jobs(real_model_jobs):
    """(this module's 4-rank outputs, the refusal job's process and dir) from the shared ``run_real`` jobs."""
    return real_model_jobs.tp, real_model_jobs.refusals, real_model_jobs.refused


def _check_pp2_tp2(out_dir, kind, halved, **model_kw):
    """The run equals one process; rank r (stage r // 2) holds half of each parameter ``halved(stage)`` names, the
    rest of its stage whole. Returns every rank's outputs."""
    from tests.test_real_models import assert_matches, reference

    ref_model, ref_losses = reference(kind, 3, 8, 4, **model_kw)
    assert_matches(ref_model, ref_losses, out_dir, [0, 1, 2, 3])  # saved whole (DTensor.full_tensor)
    ref = dict(ref_model.named_parameters())
    ranks = [load_rank(out_dir, r) for r in range(4)]
    for r, out in enumerate(ranks):
        assert out["stage_ids"] == [r // 2]  # ranks 0, 1: stage 0 split over tp; ranks 2, 3: stage 1
        half = set(halved(r // 2))
        held = {n for n in out["state"] if n in ref}
        assert half <= held
        local = {n: out["local_shapes"].get(n, list(ref[n].shape)) for n in held}
        for name in held:
            numel = torch.Size(local[name]).numel()
            assert numel == (ref[name].numel() // 2 if name in half else ref[name].numel()), (r, name, local[name])
        assert out["param_bytes"] == sum(torch.Size(local[n]).numel() * ref[n].element_size() for n in held)
    return ranks


@pytest.mark.slow
def test_llama_pp2_tp2_by_its_own_plan_trains_as_one_process(strategy_jobs):
    out, _, _ = strategy_jobs

    def split(stage):  # stage 0: layers 0, 1; stage 1: layer 2 (the cut is at model.model.layers.2)
        return [f"model.model.layers.{i}.{m}" for i in ((0, 1) if stage == 0 else (2,)) for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]

    ranks = _check_pp2_tp2(out / "llama_pp2_tp2", "llama", lambda stage: [f"{m}.weight" for m in split(stage)])
    for r, o in enumerate(ranks):
        meta = o["plan"]["meta"]
        assert meta["frontend"] == "traced" and meta["tensor_parallel"]["degree"] == 2
        assert "LlamaForCausalLM.config.base_model_tp_plan" in meta["tensor_parallel"]["plan"]
        assert meta["tensor_parallel"]["split"] == sorted(split(r // 2))


@pytest.mark.slow
def test_a_meta_llama_pp2_tp2_materializes_and_reads_only_its_shards_and_trains_as_one_process(strategy_jobs):
    out, _, _ = strategy_jobs

    def split(stage):
        return [f"model.model.layers.{i}.{m}.weight" for i in ((0, 1) if stage == 0 else (2, 3)) for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]

    ranks = _check_pp2_tp2(out / "llama_meta_pp2_tp2", "llama", split, layers=4)
    for r, o in enumerate(ranks):
        assert o["meta_params"] == [] and set(split(r // 2)) <= set(o["materialized"])


@pytest.mark.slow
def test_a_sequential_model_split_by_its_parallelize_stage_hook_trains_as_one_process(strategy_jobs):
    out, _, _ = strategy_jobs
    units = {0: ["model.0", "model.1", "model.2"], 1: ["model.3", "model.4", "model.5"]}
    colwise, rowwise = {0: "model.1.0", 1: "model.3.0"}, {0: "model.2.0", 1: "model.4.0"}
    # colwise: weight and bias split by rows; rowwise: weight split by columns, its bias whole
    ranks = _check_pp2_tp2(out / "hook_pp2_tp2", "deep_mlp", lambda s: [f"{colwise[s]}.weight", f"{colwise[s]}.bias",
                                                                          f"{rowwise[s]}.weight"], **MLP_KW)
    for r, o in enumerate(ranks):
        assert o["plan"]["meta"]["frontend"] == "sequential"
        assert o["split_calls"] == [units[r // 2]]  # once per stage module this rank holds


@pytest.mark.slow
def test_tp_without_a_plan_or_with_indivisible_heads_is_refused_at_setup_on_every_rank(strategy_jobs):
    import re

    from tests.workers import refusals

    _, proc, out = strategy_jobs
    assert proc.returncode != 0
    for name, expected in (("tp_no_plan",
                            r"PlanError: HPPStrategy\(sharding=\{'tp_degree': 2\}\) splits every stage by "
                                          r"tensor parallel, but `LMWrapper` has no plan"),
                           ("tp_kv_heads",
                            r"PlanError: tp_degree=2 does not divide: LlamaConfig.num_key_value_heads=1")):
        records = refusals.read(out / name, 2)  # every rank raised itself; none was left waiting in a collective
        assert all(rec["error"] is not None for rec in records), records
        for r in (0, 1):
            error = (out / name / f"rank{r}_error.txt").read_text()
            assert re.match(expected, error), error
        assert not (out / name / "rank0.pt").exists()
