"""Pipeline × data parallel × tensor parallel together, on 8 gloo ranks (the one 8-rank job of tests/conftest.py,
``eight_rank_job``): every run is compared on every rank with one process training the same LightningModule under
Lightning's own strategy on the same samples (every parameter at the end, each DTensor gathered whole, to 2e-5; the
mean loss of every step), and each rank's share of its stage is checked.

* pp2 × fsdp2 × tp2 and pp2 × dp2 × tp2 on a transformers Llama split by its own ``base_model_tp_plan``, with
  ``Trainer(gradient_clip_val=...)`` (the one norm over every shard of every stage): each fsdp2 × tp2 rank holds a
  quarter of its stage's split weights and half of the others;
* zbv × fsdp2 × tp2 on a Llama whose embedding and LM head are tied: the V puts both on the first position's ranks
  (two FSDP2 groups, one copy each, their gradients summed);
* ``@stage(clip_norm=...)`` decorators on a model its ``parallelize_stage`` hook splits (pp2 × dp2 × tp2), and the
  same model clipping in its own ``configure_gradient_clipping`` through ``self.clip_gradients`` (pp2 × fsdp2 × tp2);
* ``plan="auto"`` over all of it: from a cost profile (``PlacementOptions(profile=...)``) and a memory limit that
  only tensor-parallel layouts meet, it chooses pp4 × tp2, the plan the offline search (and the CLI) gives for that
  profile and those ranks, and trains it as one process;
* what does not compose is refused at setup on every rank, naming why.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.results import load_rank

WORLD = 8
TOL = dict(rtol=2e-5, atol=2e-5)
LLAMA_CUT = ["model.model.layers.1"]
V_CUTS = ["model.model.layers.0", "model.model.layers.1", "model.model.norm"]  # rank 0's V: stages 0 and 3
FSDP_TP = {"sharding": {"data_parallel": "fsdp", "tp_degree": 2}}
DDP_TP = {"sharding": {"tp_degree": 2}}
DEFAULTS = {"schedule": "1f1b", "pp": 2, "n_micro": 2, "steps": 3, "batch": 4}
LLAMA = {"model": "llama", "model_kw": {"layers": 2}, "points": LLAMA_CUT, "gradient_clip_val": 0.5}
RUNS = {
    "fsdp_tp": {**LLAMA, "strategy": FSDP_TP},
    "ddp_tp": {**LLAMA, "strategy": DDP_TP},
    "zbv_fsdp_tp": {**LLAMA, "points": V_CUTS, "schedule": "zbv", "n_micro": 4, "batch": 8, "strategy": FSDP_TP},
    "decorated_tp": {"model": "deep_mlp", "wrapper": "decorated", "points": None, "strategy": DDP_TP},
    "hook_fsdp_tp": {"model": "deep_mlp", "wrapper": "per_half_clipped", "points": None, "strategy": FSDP_TP},
}
AUTO_LIMIT = 20e6
"""Bytes per rank ``plan="auto"`` must fit: every layout without tensor parallel holds a whole 8 MB layer's training
state (32 MB) on some rank."""
RUNS["auto_tp"] = {"model": "llama", "model_kw": {"layers": 4}, "points": "auto", "batch": 8, "pp": None,
                   "schedule": None, "n_micro": None}
REFUSED = {
    "fp8_tp": ({**LLAMA, "precision": ["fp8", "32-true"], "fp8_backend": "emulate", "strategy": DDP_TP},
               "`ShardingOptions(tp_degree=2)` cannot split fp8 stages yet (stage(s) [0])"),
    "fp8_fsdp_tp": ({**LLAMA, "precision": ["32-true", "fp8"], "fp8_backend": "emulate", "strategy": FSDP_TP},
                    "`ShardingOptions(data_parallel='fsdp')` cannot shard fp8 stages yet (stage(s) [1])"),
    "bias_monitor_fsdp_tp": ({**LLAMA, "bias_monitor": True, "strategy": FSDP_TP},
                             "`BiasMonitor` compares each replica's gradient norm before the data-parallel reduction"),
    "hsdp_tp": ({**LLAMA, "strategy": {"sharding": {"data_parallel": "hsdp", "dp_replicate": 4, "tp_degree": 2}}},
                "`ShardingOptions(data_parallel='hsdp', dp_replicate=4)`: each stage has 2 replicas (world_size / "
                "(pp × tp)), which 4 groups cannot split evenly"),
}


def auto_profile():
    """A cost profile of the 4-layer Llama's planning units (its layers, the embedding and the head folded in): 8 MB
    of parameters each, 95 % of them split by its tensor-parallel plan (tp 2 only: two key/value heads)."""
    from lightning_hpp.planning.profile import CostProfile, Overheads, ProfileEntry, UnitCost

    names = [f"model.model.layers.{i}" for i in range(4)]
    units = [UnitCost(n, 1.0, 2.0, 8_000_000, 4096, 8192) for n in names]
    oh = Overheads(p2p_latency_ms=0.05, p2p_gbps=1.0, allreduce_gbps=1.0, allreduce_overlap=0.0)
    return CostProfile("LMWrapper", names, [1] * 4, [[2, 16], [2, 16]],
                       [ProfileEntry("cpu", "32-true", units, overheads=oh)],
                       tp_split=[0.95] * 4, tp_allreduces=[[2, 5]] * 4, tp_degrees=[1, 2])


def eight_rank_runs(out) -> list[dict]:
    """This module's configurations for the 8-rank job (tests/conftest.py: ``eight_rank_job``)."""
    auto_profile().save(out / "auto_profile.json")
    placement = {"placement": {"profile": str(out / "auto_profile.json"), "memory": {"cpu": AUTO_LIMIT}}}
    runs = [{**DEFAULTS, **cfg, "name": name, "out": str(out / name),
             **({"strategy": placement} if name == "auto_tp" else {})} for name, cfg in RUNS.items()]
    runs += [{**DEFAULTS, **cfg, "name": name, "out": str(out / name), "refused": True}
             for name, (cfg, _) in REFUSED.items()]
    return runs


@pytest.fixture(scope="module")
def runs(eight_rank_job):
    out = eight_rank_job.three_d
    missing = [n for n in RUNS if not all((out / n / f"rank{r}.pt").exists() for r in range(WORLD))]
    assert not missing, f"runs {missing} did not finish\n--- stderr\n{eight_rank_job.proc.stderr[-8000:]}"
    return out


def _ranks(out, name):
    return [load_rank(out / name, r) for r in range(WORLD)]


def _llama_reference(batch: int, clip: float | None = 0.5, layers: int = 2):
    import lightning as L

    from tests.harness.zoo.real import LMWrapper
    from tests.test_sharding import one_process

    L.seed_everything(0)
    return one_process(LMWrapper("llama", reference_microbatches=4, layers=layers), 3, batch, clip=clip)


def _assert_every_rank_equals(outs, want: dict) -> None:
    from tests.test_sharding import assert_params

    assert_params(outs, want, tol=TOL)


def _split_weights(outs) -> set[str]:
    """The parameters tensor parallel splits (their ``DTensor`` is sharded over the ``tp`` dimension)."""
    return {n for o in outs for n, (_, _, placements, dims) in o["split"].items()
            if "tp" in dims and "Replicate" not in placements[dims.index("tp")]}


@pytest.mark.slow
def test_pp2_fsdp2_tp2_llama_with_gradient_clipping_equals_one_process_each_rank_a_quarter_of_its_split_weights(runs):
    from tests.test_sharding import replica_mean_losses

    outs = _ranks(runs, "fsdp_tp")
    want, losses = _llama_reference(8)
    _assert_every_rank_equals(outs, want)
    torch.testing.assert_close(replica_mean_losses(outs, [0, 1]), losses, **TOL)
    split = _split_weights(outs)
    assert len(split) == 14  # q, k, v, o, gate, up, down of both layers
    for o in outs:
        assert (o["position"], o["dp_shard"], o["tp"]) == (o["stage_ids"][0], 2, 2)
        assert o["device_mesh_shape"] == [2, 1, 2, 2]
        for name, n in o["local"].items():
            # a quarter of each split weight (half its rows or columns, half of that sharded), of its gradient and
            # of its momentum; half of every other parameter (the embedding, the norms: sharded over 2)
            share = 4 if name in split else 2
            assert n["param"] * share == n["full"] and n["optim"] * share == n["full"], (name, n)
            assert n["grad"] * share == n["full"], (name, n)
    # the clip clipped: the pipeline's norm was above the limit
    assert all(max(o["metrics"]["grad_norm/stage_0"], o["metrics"]["grad_norm/stage_1"]) > 0.5 for o in outs)


@pytest.mark.slow
def test_pp2_dp2_tp2_llama_with_gradient_clipping_equals_one_process(runs):
    from tests.test_sharding import replica_mean_losses

    outs = _ranks(runs, "ddp_tp")
    want, losses = _llama_reference(8)
    _assert_every_rank_equals(outs, want)
    torch.testing.assert_close(replica_mean_losses(outs, [0, 1]), losses, **TOL)
    split = _split_weights(outs)
    assert len(split) == 14
    for o in outs:
        assert o["device_mesh_shape"] == [2, 2, 1, 2] and (o["dp_shard"], o["dp_replicate"], o["tp"]) == (1, 2, 2)
        for name, n in o["local"].items():
            share = 2 if name in split else 1
            assert n["param"] * share == n["full"] and n["grad"] * share == n["full"], (name, n)


@pytest.mark.slow
def test_zbv_fsdp2_tp2_with_tied_embeddings_on_one_rank_equals_one_process(runs):
    from tests.test_sharding import replica_mean_losses

    outs = _ranks(runs, "zbv_fsdp_tp")
    want, losses = _llama_reference(16)
    _assert_every_rank_equals(outs, want)
    torch.testing.assert_close(replica_mean_losses(outs, [0, 1]), losses, **TOL)
    for o in outs:  # the V: the first position holds the embedding's stage and the head's, tied
        assert o["stage_ids"] == ([0, 3] if o["position"] == 0 else [1, 2])
        if o["position"] == 0:
            embed, head = o["state"]["model.model.embed_tokens.weight"], o["state"]["model.lm_head.weight"]
            torch.testing.assert_close(embed, head, rtol=0, atol=0)  # the two copies took the same steps


def _decorated_reference():
    import lightning as L

    from tests.harness.zoo.real import PerHalfClipped
    from tests.test_sharding import one_process

    L.seed_everything(0)
    return one_process(PerHalfClipped(), 3, 8)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["decorated_tp", "hook_fsdp_tp"])
def test_stage_clip_norm_from_decorators_and_the_users_hook_with_tp_equal_one_process(runs, name):
    from tests.harness.zoo.real import CLIP_NORMS
    from tests.test_sharding import replica_mean_losses

    outs = _ranks(runs, name)
    want, losses = _decorated_reference()
    _assert_every_rank_equals(outs, want)
    torch.testing.assert_close(replica_mean_losses(outs, [0, 1]), losses, **TOL)
    for o in outs:
        assert [s["clip_norm"] for s in o["plan"]["stages"][:2]] == [CLIP_NORMS[0], CLIP_NORMS[1]]
        assert {n for n in o["split"] if "fc" in n} == {n for n in o["state"] if "fc" in n}  # split by the hook
    # each stage clipped at its own limit: its norm before clipping was above it
    assert all(outs[0]["metrics"][f"grad_norm/stage_{k}"] > CLIP_NORMS[k] for k in (0, 1))


@pytest.mark.slow
def test_plan_auto_chooses_tensor_parallel_where_only_it_fits_and_trains_as_one_process(runs):
    from lightning_hpp.planning.search import search_plan

    outs = _ranks(runs, "auto_tp")
    offline = search_plan(auto_profile(), ["cpu"] * WORLD, batch_size=8, tp_degree=None, data_parallel=None,
                          memory_bytes={"cpu": AUTO_LIMIT})
    assert (offline.pp_degree, offline.tp_degree, offline.dp_degree) == (4, 2, 1)
    for o in outs:
        predicted = o["plan"]["meta"]["predicted"]
        assert {k: v for k, v in predicted.items() if k != "label"} == {
            k: v for k, v in offline.predicted().items() if k != "label"}
        assert (o["tp"], o["dp_shard"], o["dp_replicate"]) == (2, 1, 1) and o["stage_ids"] == [o["position"]]
    want, losses = _llama_reference(8, clip=None, layers=4)
    _assert_every_rank_equals(outs, want)
    torch.testing.assert_close(torch.tensor(outs[0]["losses"]), losses, **TOL)


def test_what_does_not_compose_is_refused_at_setup_on_every_rank(eight_rank_job):
    from tests.workers import refusals

    proc, out = eight_rank_job.proc, eight_rank_job.three_d
    assert proc.returncode == 1, proc.stderr[-4000:]  # the refused cases, and nothing else, failed
    for name, (_, text) in REFUSED.items():
        records = refusals.read(out / name, WORLD)
        for r in records:
            assert r["error"] is not None and text in r["error"], (name, r)
            assert r["seconds"] < refusals.BOUND_S, (name, r)  # each rank raised itself, none waited
