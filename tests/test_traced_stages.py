"""Traced stages beyond plain training: tied weights in sharded checkpoints, checkpoints that move
between frontends and cuts, per-stage precision and the V-placement schedules on real models.

The single-process tests check the tied-weight bookkeeping of
:mod:`lightning_hpp.checkpoint.lightning_state` directly; the ``slow`` ones run real multi-process
jobs through :mod:`tests.workers.run_real` and compare them to single-process training
(:func:`tests.test_real_models.reference`; per-stage precision: :func:`staged_reference`, the same
precision per stage in one process).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_hpp.checkpoint.lightning_state import from_sharded, load_template, tensor_aliases, to_sharded
from lightning_hpp.checkpoint.dcp_index import checkpoint_keys
from lightning_hpp.checkpoint.load import load_sharded
from lightning_hpp.checkpoint.save import save_sharded
from lightning_hpp.precision.fp8_emulation import EmulatedFP8Mode
from tests.harness.results import load_rank, merged_state
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo.real import LMWrapper, loader

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
    # a few steps otherwise); each is compared with one process running the same precision per stage
    # (:class:`StagedGPT2`)
    return [_gpt2_run("gpt2_bf16", tmp_path, precision=["bf16-mixed", "32-true"], steps=6, n=8),
            _gpt2_run("gpt2_fp8emu", tmp_path, precision=["32-true", "fp8"], fp8_backend="emulate", steps=6, n=8)]


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
    return [{**_gpt2_run(name, out, precision=["32-true", "fp8"], **kw),
             "refused": True} for name, kw in REFUSED.items()]


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


class StagedGPT2(LMWrapper):
    """GPT-2 in one process with the precision of each stage of the cut at ``cut``, stepping as the pipeline's
    last stage does.

    The code before ``cut`` (stage 0) runs in ``contexts[0]()``, the code from ``cut`` to the logits (stage 1) in
    ``contexts[1]()``; the activation entering ``cut`` is rounded to ``wire`` and back to float32, as the boundary
    sends it (its gradient is rounded on the way back too). Each micro-batch's forward is followed by its backward,
    the order of 1F1B's last stage, in which a delayed-scaling fp8 stage's amax history sees them.
    """

    def __init__(self, cut: str, contexts: list[Callable[[], contextlib.AbstractContextManager]], wire: torch.dtype,
                 n_micro: int) -> None:
        super().__init__("gpt2")
        self.contexts, self.wire, self.n_micro = contexts, wire, n_micro
        self.automatic_optimization = False
        self._stage = contextlib.ExitStack()
        self.get_submodule(cut).register_forward_pre_hook(self._boundary)

    def forward(self, x, attention_mask=None):
        with self._stage:
            self._stage.enter_context(self.contexts[0]())
            return super().forward(x, attention_mask=attention_mask)

    def _boundary(self, module, args):
        self._stage.close()  # leaves stage 0's context, enters stage 1's
        self._stage.enter_context(self.contexts[1]())
        return (args[0].to(self.wire).float(), *args[1:])

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        losses = []
        for micro in zip(*(t.chunk(self.n_micro) for t in batch)):
            loss = self._loss(list(micro))
            self.manual_backward(loss / self.n_micro)
            losses.append(loss.detach())
        opt.step()
        self.log("train/loss", torch.stack(losses).mean())


def staged_reference(run: dict, contexts: list[Callable[[], contextlib.AbstractContextManager]],
                     wire: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``run`` trained by :class:`StagedGPT2` under Lightning's default strategy: (its state, the loss of every step).

    The same initial weights (seed 0) and the order of samples Lightning's distributed sampler gives the pipeline.
    """
    import lightning as L

    L.seed_everything(0)
    (cut,) = run["points"]
    model = StagedGPT2(cut, contexts, wire, run["n_micro"])
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    trainer = quiet_trainer(devices=1, max_steps=run["steps"], callbacks=[Record()], num_sanity_val_steps=0,
                            limit_val_batches=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: one intra-op thread is faster on a shared 2-core machine
    try:
        trainer.fit(model, loader("gpt2", run["batch"], n=run["n"], shuffle_like_lightning=True))
    finally:
        torch.set_num_threads(threads)
    return model.state_dict(), losses


def _bf16_autocast() -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _furthest(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in got)


def _assert_like_reference(out: Path, name: str, want: dict[str, torch.Tensor], want_losses: list[float],
                           atol: float, loss_atol: float) -> dict[str, torch.Tensor]:
    """Every rank's parameters (each copy, :func:`merged_state`) and every rank's loss of every step against the
    reference; returns the merged parameters."""
    got = merged_state(out / name, [0, 1])
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        assert value.dtype == torch.float32, key
        torch.testing.assert_close(value, want[key], rtol=0, atol=atol, msg=lambda m, key=key: f"{name} {key}: {m}")
    for rank in (0, 1):
        losses = load_rank(out / name, rank)["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=0, atol=loss_atol,
                                   msg=lambda m, rank=rank: f"{name} rank {rank} losses: {m}")
    return got


# Against one process running the same precision per stage, after 6 steps of lr 0.05: parameters and losses within
# 2e-5 (measured: bf16 6.9e-6 and 5.3e-6, the first five losses equal; fp8 7e-9 and 0, 2.4e-6 with the reference on
# two threads). Not 1e-8 as in fp32: the pipeline sums gradients in another order (the tied embedding's two stages),
# and each bf16 rounding this flips carries the difference on (two such references, the same but for the order of
# their backward passes, differ by 6.1e-6). The reference without autocast, without the rounded boundary or with
# the fp8 stage in another order of micro-batches is 1.6e-4, 1.7e-4 and 8.9e-4 away; fp32 training 1.6e-4 (bf16)
# and 1.6e-3 (fp8).
STAGED_TOL = {"atol": 2e-5, "loss_atol": 2e-5}


@pytest.mark.slow
def test_precision_per_traced_stage_trains_and_is_recorded(two_rank_runs_dir):
    tmp_path = two_rank_runs_dir
    runs = {r["name"]: r for r in _precision_runs(tmp_path)}
    fp32, _ = staged_reference(runs["gpt2_bf16"], [contextlib.nullcontext] * 2)  # both runs: one model, data, steps
    # the default precision is recorded too (a 2-rank GPT-2 of the same job without one)
    assert _ranks(tmp_path, "gpt2_saved")[0]["plan"]["meta"]["precision"] == ["32-true", "32-true"]

    # bf16-mixed in stage 0: autocast (its weights stay fp32) and a bf16 boundary
    outs = _ranks(tmp_path, "gpt2_bf16")
    losses = outs[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
    for o in outs:
        assert o["plan"]["meta"]["cut_points"] == GPT2_CUT
        assert o["plan"]["meta"]["precision"] == ["bf16-mixed", "32-true"]
        assert o["plan"]["meta"]["boundary_dtypes"] == ["bfloat16"]
    written = json.loads((tmp_path / "gpt2_bf16" / "stage_plan.json").read_text())
    assert [s["precision"] for s in written["stages"]] == ["bf16-mixed", "32-true"]
    assert written["meta"]["precision"] == ["bf16-mixed", "32-true"]
    assert written["meta"]["boundary_dtypes"] == ["bfloat16"]
    want, want_losses = staged_reference(runs["gpt2_bf16"], [_bf16_autocast, contextlib.nullcontext], torch.bfloat16)
    got = _assert_like_reference(tmp_path, "gpt2_bf16", want, want_losses, **STAGED_TOL)
    assert _furthest(got, fp32) > STAGED_TOL["atol"]  # bf16 did run: fp32 training would fail the bound

    # emulated fp8 in the traced LM-head stage (the GEMMs on its weights rounded to fp8, delayed scaling): one
    # EmulatedFP8Mode over stage 1, as HPPPrecision gives each fp8 traced stage, its amax histories kept across steps
    outs = _ranks(tmp_path, "gpt2_fp8emu")
    losses = outs[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
    for o in outs:
        assert o["plan"]["meta"]["precision"][0] == "32-true"
        assert o["plan"]["meta"]["precision"][1].startswith("fp8-emulated"), o["plan"]["meta"]["precision"]
        assert o["plan"]["meta"]["boundary_dtypes"] == ["float32"]
    stage1 = EmulatedFP8Mode("delayed")
    want, want_losses = staged_reference(runs["gpt2_fp8emu"], [contextlib.nullcontext, lambda: stage1])
    got = _assert_like_reference(tmp_path, "gpt2_fp8emu", want, want_losses, **STAGED_TOL)
    assert _furthest(got, fp32) > STAGED_TOL["atol"]  # fp8 rounding did happen


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
