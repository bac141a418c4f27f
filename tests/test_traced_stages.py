"""Traced stages beyond plain training: tied weights in sharded checkpoints, checkpoints that move
between frontends and cuts, per-stage precision and the V-placement schedules on real models.

The single-process tests check the tied-weight bookkeeping of
:mod:`lightning_hpp.checkpoint.lightning_state` directly; the ``slow`` ones run real multi-process
jobs through :mod:`tests.workers.run_real` and compare them to single-process training
(:func:`tests.test_real_models.reference`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_hpp.checkpoint.lightning_state import from_sharded, load_template, tensor_aliases, to_sharded
from lightning_hpp.checkpoint.sharded import checkpoint_keys, load_sharded, save_sharded
from tests.launch import load_rank, merged_state
from tests.real_models import LMWrapper

TOL = {"rtol": 1e-5, "atol": 1e-5}
WTE, HEAD = "model.transformer.wte.weight", "model.lm_head.weight"


# ============================================================================ tied weights, one process


def _trained_gpt2(seed: int) -> tuple[LMWrapper, torch.optim.Optimizer]:
    model = LMWrapper("gpt2", seed=seed, layers=2)
    opt = model.configure_optimizers()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    model._loss([ids, torch.ones_like(ids), ids]).backward()
    opt.step()
    return model, opt


def _lightning_checkpoint(model: torch.nn.Module) -> dict:
    return {"state_dict": model.state_dict(), "lr_schedulers": [], "epoch": 0, "global_step": 1}


def _load(url: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    template = load_template(model, [opt], set(checkpoint_keys(url)))
    ckpt = from_sharded(load_sharded(url, template), model, [opt], global_rank=0, position=0)
    model.load_state_dict(ckpt["state_dict"], strict=True)
    opt.load_state_dict(ckpt["optimizer_states"][0])
    return ckpt


def _assert_same_training_state(a: LMWrapper, opt_a, b: LMWrapper, opt_b) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"], rtol=0, atol=0)


def test_tensor_aliases_groups_tied_parameters_by_identity():
    model = LMWrapper("gpt2", layers=1)
    assert tensor_aliases(model) == {WTE: [WTE, HEAD]}
    assert tensor_aliases(torch.nn.Linear(2, 2)) == {}


def test_tied_parameter_is_saved_once_and_loads_under_all_its_names(tmp_path):
    saved, saved_opt = _trained_gpt2(seed=0)
    url = str(tmp_path / "step-1")
    state = to_sharded(_lightning_checkpoint(saved), saved, [saved_opt], global_rank=0, position=0, replica=0)
    save_sharded(state, url, step=1)
    keys = set(checkpoint_keys(url))
    assert ("model", WTE) in keys and ("model", HEAD) not in keys
    optim_names = {k[2] for k in keys if k[0] == "optim"}
    assert WTE in optim_names and HEAD not in optim_names
    # one entry per tensor: as many model entries as distinct parameters and persistent buffers
    distinct = {id(t) for t in saved.state_dict(keep_vars=True).values()}
    assert len([k for k in keys if k[0] == "model"]) == len(distinct)

    fresh, fresh_opt = _trained_gpt2(seed=1)
    ckpt = _load(url, fresh, fresh_opt)
    assert {WTE, HEAD} <= set(ckpt["state_dict"])  # Lightning gets it under both names
    assert fresh.model.lm_head.weight is fresh.model.transformer.wte.weight  # still tied
    _assert_same_training_state(saved, saved_opt, fresh, fresh_opt)


def test_tied_parameter_saved_under_its_other_name_or_under_both_still_loads(tmp_path):
    """Checkpoints from before (both names) and from a layout that knew the tensor under its other name."""
    saved, saved_opt = _trained_gpt2(seed=0)
    state = to_sharded(_lightning_checkpoint(saved), saved, [saved_opt], global_rank=0, position=0, replica=0)
    both = {**state, "model": dict(saved.state_dict())}
    other = {**state, "model": {HEAD if k == WTE else k: v for k, v in state["model"].items()},
             "optim": {"0": {HEAD if k == WTE else k: v for k, v in state["optim"]["0"].items()}}}
    for tag, variant in (("both", both), ("other", other)):
        url = str(tmp_path / tag / "step-1")
        save_sharded(variant, url, step=1)
        fresh, fresh_opt = _trained_gpt2(seed=1)
        _load(url, fresh, fresh_opt)
        _assert_same_training_state(saved, saved_opt, fresh, fresh_opt)


# ============================================================================ multi-process jobs

GPT2_CUT = ["model.transformer.h.2"]
GPT2_FOUR = ["model.transformer.h.1", "model.transformer.h.2", "model.transformer.h.3"]


def _gpt2_run(name: str, out: Path, **kw) -> dict:
    return {"name": name, "model": "gpt2", "points": GPT2_CUT, "schedule": "1f1b", "n_micro": 4, "steps": 3, "batch": 8,
            "out": str(out / name), **kw}


def _mlp_run(name: str, out: Path, frontend: str, point: str, steps: int, **kw) -> dict:
    return {"name": name, "model": "mlp", "points": [point], "frontend": frontend, "schedule": "1f1b", "n_micro": 4,
            "steps": steps, "batch": 16, "out": str(out / name), **kw}


def _ranks(out: Path, name: str, n: int = 2) -> list[dict]:
    return [load_rank(out / name, r) for r in range(n)]


def _assert_same_run(got: list[dict], want: list[dict]) -> None:
    """Parameters and momenta of two runs (each: every rank's output), whatever their cuts, at 1e-5."""
    def merge(outs: list[dict], key: str) -> dict:
        return {k: v for o in outs for k, v in o[key].items()}

    a, b = merge(got, "state"), merge(want, "state")
    assert sorted(a) == sorted(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], **TOL, msg=lambda m, k=k: f"parameter {k}: {m}")
    ma, mb = merge(got, "optim"), merge(want, "optim")
    assert sorted(ma) == sorted(mb)
    for k in mb:
        torch.testing.assert_close(ma[k]["momentum_buffer"], mb[k]["momentum_buffer"], **TOL,
                                   msg=lambda m, k=k: f"momentum of {k}: {m}")


def _tied_weight_runs(tmp_path: Path) -> list[dict]:
    gpt2_ckpt, seq_ckpt, traced_ckpt = (str(tmp_path / d) for d in ("ckpt_gpt2", "ckpt_seq", "ckpt_traced"))
    return [
        # GPT-2 in 2 traced stages (cut h.2), saved after 2 of 4 steps; resumed below under 3 stages
        _gpt2_run("gpt2_saved", tmp_path, steps=2, ckpt_dir=gpt2_ckpt, every=2),
        # the MLP: uninterrupted; saved by one frontend at step 4 (mid-epoch), resumed by the other at another cut
        _mlp_run("mlp_full", tmp_path, "sequential", "layers.3", 10),
        _mlp_run("mlp_saved_seq", tmp_path, "sequential", "layers.3", 4, ckpt_dir=seq_ckpt, every=4),
        _mlp_run("mlp_resumed_traced", tmp_path, "traced", "layers.4", 10, resume=f"{seq_ckpt}/step-4"),
        _mlp_run("mlp_saved_traced", tmp_path, "traced", "layers.4", 4, ckpt_dir=traced_ckpt, every=4),
        _mlp_run("mlp_resumed_seq", tmp_path, "sequential", "layers.3", 10, resume=f"{traced_ckpt}/step-4"),
    ]


def _precision_runs(tmp_path: Path) -> list[dict]:
    # one batch of 8 samples, seen at every step: the loss can fall (the batches of random tokens cannot be learned in
    # a few steps otherwise); the fp32 reference is the same pipeline in 32-true (equal to one process, see
    # tests/test_real_models.py)
    return [_gpt2_run("gpt2_bf16", tmp_path, precision=["bf16-mixed", "32-true"], steps=6, n=8),
            _gpt2_run("gpt2_fp8emu", tmp_path, precision=["32-true", "fp8"], fp8_backend="emulate", steps=6, n=8),
            _gpt2_run("gpt2_fp32", tmp_path, steps=6, n=8)]


V_SCHEDULES = ("zbv", "dualpipev")


def _v_runs(tmp_path: Path) -> list[dict]:
    """GPT-2 (tied embeddings: the stricter case) in 4 traced stages on 2 ranks under both V-placement schedules."""
    return [_gpt2_run(f"gpt2_{s}", tmp_path, model="gpt2", points=GPT2_FOUR, schedule=s) for s in V_SCHEDULES]


REFUSED = {"gpt2_fp8_cpu": {}, "gpt2_fp8_te": {"fp8_capable": True}}


def _resumed_three_runs(tmp_path: Path) -> list[dict]:
    # GPT-2 saved with cut h.2 (2 stages, gpt2_saved) resumed with cuts h.1, h.3 (3 stages)
    return [_gpt2_run("gpt2_resumed3", tmp_path, points=["model.transformer.h.1", "model.transformer.h.3"], steps=4,
                      resume=f"{tmp_path / 'ckpt_gpt2'}/step-2")]


# The configurations of this module, by number of ranks and kind, for the shared jobs of tests/conftest.py
# (``real_model_jobs``), each in its own launch round: the 3-rank resume reads what a 2-rank run wrote.
def two_rank_runs(out: Path) -> list[dict]:
    """Every 2-rank training run: the tied-weight checkpoints, the per-stage precisions, the V schedules."""
    return _tied_weight_runs(out) + _precision_runs(out) + _v_runs(out)


def three_rank_runs(out: Path) -> list[dict]:
    return _resumed_three_runs(out)


def refused_runs(out: Path) -> list[dict]:
    """The traced GPT-2s whose setup must fail, tried in turn by the ranks of one job (tests/workers/refusals.py)."""
    return [{**_gpt2_run(name, out, precision=["32-true", "fp8"], **kw), "refused": True} for name, kw in REFUSED.items()]


@pytest.fixture(scope="module")
def two_rank_runs_dir(real_model_jobs) -> Path:
    """This module's training outputs (both rounds) from the shared ``run_real`` jobs."""
    return real_model_jobs.traced


@pytest.mark.slow
def test_tied_weights_saved_once_and_checkpoints_move_between_frontends_and_cuts(two_rank_runs_dir):
    from tests.test_real_models import assert_matches, reference

    tmp_path = two_rank_runs_dir
    gpt2_ckpt = str(tmp_path / "ckpt_gpt2")

    # 1. the tied embedding / LM head is one checkpoint entry, under its first name, with its momentum once
    keys = set(checkpoint_keys(f"{gpt2_ckpt}/step-2"))
    assert ("model", WTE) in keys and ("model", HEAD) not in keys
    assert ("optim", "0", WTE, "momentum_buffer") in keys and not any(k[:3] == ("optim", "0", HEAD) for k in keys)
    meta = json.loads((Path(gpt2_ckpt) / "step-2" / "metadata.json").read_text())
    assert meta["plan"]["meta"]["frontend"] == "traced" and meta["plan"]["meta"]["cut_points"] == GPT2_CUT
    saved = _ranks(tmp_path, "gpt2_saved")
    assert {WTE, HEAD} <= set(saved[1]["state"])  # the LM-head rank holds it under both names, yet it is saved once
    assert len([k for k in keys if k[0] == "model"]) == len(set(merged_state(tmp_path / "gpt2_saved", [0, 1])) - {HEAD})

    # 2. the MLP: sequential -> traced and traced -> sequential, each at another cut, equal the uninterrupted run
    full = _ranks(tmp_path, "mlp_full")
    for saved_tag, resumed_tag, frontend in (("mlp_saved_seq", "mlp_resumed_traced", "traced"),
                                             ("mlp_saved_traced", "mlp_resumed_seq", "sequential")):
        assert _ranks(tmp_path, saved_tag)[0]["global_step"] == 4
        resumed = _ranks(tmp_path, resumed_tag)
        assert resumed[0]["plan"]["meta"]["frontend"] == frontend
        assert resumed[0]["resumed_from"].endswith("step-4") and resumed[0]["global_step"] == 10
        assert len(resumed[0]["losses"]) == 6
        torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(full[0]["losses"][4:]), **TOL)
        _assert_same_run(resumed, full)
    assert _ranks(tmp_path, "mlp_resumed_traced")[0]["plan"]["meta"]["cut_points"] == ["layers.4"]

    # 2b. GPT-2 saved with cut h.2 (2 stages) resumes with cuts h.1, h.3 (3 stages, a job of its own) and equals
    # single-process training
    resumed = _ranks(tmp_path, "gpt2_resumed3", 3)
    assert resumed[0]["resumed_from"].endswith("step-2") and resumed[0]["global_step"] == 4
    ref_model, ref_losses = reference("gpt2", 4, 8, 4)
    assert_matches(ref_model, None, tmp_path / "gpt2_resumed3", [0, 1, 2], compare_losses=False)
    for r in range(3):
        torch.testing.assert_close(torch.tensor(resumed[r]["losses"]), torch.tensor(ref_losses[2:]), **TOL)
    # ... loaded into both ranks that use it (stage 0's embedding, stage 2's LM head), still one tensor
    assert WTE in resumed[0]["state"] and HEAD in resumed[2]["state"] and WTE in resumed[2]["state"]
    assert HEAD not in resumed[1]["state"] and WTE not in resumed[1]["state"]
    torch.testing.assert_close(resumed[0]["state"][WTE], resumed[2]["state"][HEAD], rtol=0, atol=0)


@pytest.mark.slow
def test_precision_per_traced_stage_trains_and_is_recorded(two_rank_runs_dir):
    tmp_path = two_rank_runs_dir
    ref = _ranks(tmp_path, "gpt2_fp32")
    want, ref_losses = merged_state(tmp_path / "gpt2_fp32", [0, 1]), ref[0]["losses"]
    assert ref[0]["plan"]["meta"]["precision"] == ["32-true", "32-true"]

    # bf16-mixed in stage 0: autocast (its weights stay fp32) and a bf16 boundary; bf16 keeps 8 bits of mantissa
    # (~4e-3 relative per rounding). Loose tolerances: every parameter within 2e-3 of fp32 training after 6 steps of
    # lr 0.05 and every loss within 1e-3 (measured: 1.6e-4 and 4e-5), against 1e-5 for the fp32 pipeline itself
    outs = _ranks(tmp_path, "gpt2_bf16")
    losses = outs[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
    for o in outs:
        assert o["plan"]["meta"]["precision"] == ["bf16-mixed", "32-true"]
        assert o["plan"]["meta"]["boundary_dtypes"] == ["bfloat16"]
    written = json.loads((tmp_path / "gpt2_bf16" / "stage_plan.json").read_text())
    assert [s["precision"] for s in written["stages"]] == ["bf16-mixed", "32-true"]
    assert written["meta"]["precision"] == ["bf16-mixed", "32-true"]
    assert written["meta"]["boundary_dtypes"] == ["bfloat16"]
    got = merged_state(tmp_path / "gpt2_bf16", [0, 1])
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        assert value.dtype == torch.float32, name
        torch.testing.assert_close(value, want[name], rtol=0, atol=2e-3, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-3)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) > 1e-6  # bf16 did run: not fp32 to the last bit

    # emulated fp8 in the traced LM-head stage (the GEMMs on its weights rounded to fp8): it trains, close to fp32
    # within the looser bounds of fp8 (e4m3 keeps 3 bits of mantissa, ~6e-2 relative per rounding): parameters within
    # 2e-2 and losses within 1e-2 (measured: 1.6e-3 and 7e-4)
    outs = _ranks(tmp_path, "gpt2_fp8emu")
    losses = outs[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
    assert outs[0]["plan"]["meta"]["precision"][0] == "32-true"
    assert outs[0]["plan"]["meta"]["precision"][1].startswith("fp8-emulated"), outs[0]["plan"]["meta"]["precision"]
    got = merged_state(tmp_path / "gpt2_fp8emu", [0, 1])
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=2e-2, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-2)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) > 1e-5  # fp8 rounding did happen


@pytest.fixture(scope="module")
def refused_jobs(real_model_jobs):
    """(the refusal job's finished process, its dir) from the shared ``run_real`` jobs."""
    return real_model_jobs.refusals, real_model_jobs.refused


def _refused(refused_jobs, name: str) -> list[str]:
    """Every rank's error (type: message) for the run ``name`` of :func:`refused_runs`."""
    from tests.workers import refusals

    proc, out = refused_jobs
    assert proc.returncode != 0  # ended, and not successfully (a hang would raise TimeoutExpired)
    records = refusals.read(out / name, 2)  # every rank raised itself; none was left waiting in a collective
    assert all(r["error"] is not None for r in records), records
    assert not (out / name / "rank0.pt").exists() and not (out / name / "rank1.pt").exists()
    return [(out / name / f"rank{r}_error.txt").read_text() for r in (0, 1)]


@pytest.mark.slow
def test_fp8_on_a_traced_stage_without_an_fp8_device_fails_at_setup_on_every_rank(refused_jobs):
    for error in _refused(refused_jobs, "gpt2_fp8_cpu"):
        assert error.startswith("FP8Error: Stage 1 has precision 'fp8' but runs on device 'cpu'"), error
        assert "fp8_backend='emulate'" in error, error


@pytest.mark.slow
def test_transformer_engine_fp8_on_a_traced_stage_is_refused_with_the_stage_on_every_rank(refused_jobs):
    # fp8_capable: the worker makes every device count as an H100 with Transformer Engine
    for error in _refused(refused_jobs, "gpt2_fp8_te"):
        assert error.startswith("PlanError: Stage 1 runs in fp8 through Transformer Engine"), error
        assert "traced frontend runs stage 1 as a captured graph" in error and "fp8_backend='emulate'" in error, error


@pytest.fixture(scope="module")
def v_runs(two_rank_runs_dir: Path) -> tuple[Path, list[dict]]:
    """The V-placement runs of :func:`two_rank_runs`."""
    return two_rank_runs_dir, _v_runs(two_rank_runs_dir)


def _check_v_run(out: Path, run: dict) -> None:
    from tests.test_real_models import assert_matches, reference

    outs = _ranks(out, run["name"])
    # V placement: rank 0 holds the first and the last stage, rank 1 the two middle ones
    assert [o["stage_ids"] for o in outs] == [[0, 3], [1, 2]]
    assert outs[0]["plan"]["meta"]["frontend"] == "traced"
    ref_model, ref_losses = reference(run["model"], 3, 8, 4)
    assert_matches(ref_model, ref_losses, run["out"], [0, 1])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedules_on_traced_gpt2_with_tied_embeddings_on_one_rank_match_single_process(v_runs, schedule):
    out, runs = v_runs
    _check_v_run(out, next(r for r in runs if r["name"] == f"gpt2_{schedule}"))
