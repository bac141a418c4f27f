"""Real models, unchanged, under HPPStrategy: transformers GPT-2 (tied embeddings, attention mask), BERT
cut inside its encoder (a module named ``self`` in every attention block),
Llama in 3 stages (RoPE, grouped-query attention, tied embeddings), a ViT classifier and a nanoGPT
written here, cut at modules inside the user's model by the traced frontend.

Every run is checked against single-process fp32 training of the same LightningModule on the same
data with the same micro-batches: the loss logged at every step (the first included) and every
parameter at the end, to 1e-5.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.harness.results import load_rank, merged_state
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo.real import LMWrapper, loader, uncompared

pytestmark = pytest.mark.slow
TOL = dict(rtol=1e-5, atol=1e-5)


def reference(kind: str, steps: int, batch: int, n_micro: int, gradient_clip_val: float | None = None, **model_kw):
    """The same LightningModule trained in one process, averaging its loss over the same micro-batches."""
    L.seed_everything(0)
    model = LMWrapper(kind, reference_microbatches=n_micro, **model_kw)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    trainer = quiet_trainer(devices=1, max_steps=steps, callbacks=[Record()], num_sanity_val_steps=0,
                            limit_val_batches=0, gradient_clip_val=gradient_clip_val)
    trainer.fit(model, loader(kind, batch, shuffle_like_lightning=True))
    return model, losses


def assert_matches(ref_model, ref_losses, out_dir, ranks, compare_losses=True):
    got = merged_state(out_dir, ranks)
    ref = ref_model.state_dict()
    assert set(got) <= set(ref), sorted(set(got) - set(ref))
    assert not uncompared(ref, set(got)), f"not compared (and not tied to a compared one): {uncompared(ref, set(got))}"
    for name, value in got.items():
        torch.testing.assert_close(value, ref[name], **TOL, msg=lambda m: f"{name}: {m}")
    if compare_losses:
        for r in ranks:
            losses = load_rank(out_dir, r)["losses"]
            assert len(losses) == len(ref_losses)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)


def _traced_runs() -> list[dict]:
    runs = [
        {"name": "gpt2_1f1b", "model": "gpt2", "points": ["model.transformer.h.2"], "schedule": "1f1b",
         "strategy": {"telemetry": {"every_n_steps": 1}}},  # telemetry times traced stages like any others
        {"name": "vit_gpipe", "model": "vit", "points": ["model.vit.layers.2"], "schedule": "gpipe"},
        # a module named `self` (attention.self) inside the traced stages, and BERT's tied decoder
        {"name": "bert_1f1b", "model": "bert", "points": ["model.bert.encoder.layer.1"], "schedule": "1f1b"},
        # Trainer(gradient_clip_val): one norm over the whole model, the tied embedding / head counted once
        {"name": "gpt2_clipped", "model": "gpt2", "points": ["model.transformer.h.2"], "schedule": "1f1b",
         "gradient_clip_val": 0.5},
        {"name": "nanogpt_balanced", "model": "nanogpt", "points": None, "schedule": "1f1b"},
        {"name": "gpt2_interleaved", "model": "gpt2", "points": ["model.transformer.h.1", "model.transformer.h.2",
                                                                 "model.transformer.h.3"],
         "schedule": "interleaved1f1b"},
    ]
    for r in runs:
        r.update(n_micro=4, steps=3, batch=8)
    return runs


def _batchnorm_runs() -> list[dict]:
    # torch's shape inference used to run the user's step once on zeros before the first step, so the
    # loss logged at step 1 (and BatchNorm's statistics) came from that pass
    runs = [{"name": f"bn_{s}", "model": "bn_mlp", "points": ["model.3"], "schedule": s} for s in ("1f1b", "gpipe")]
    for r in runs:
        r.update(n_micro=4, steps=4, batch=8)
    return runs


LLAMA3 = {"name": "llama3", "model": "llama", "points": ["model.model.layers.1", "model.model.layers.2"],
          "schedule": "1f1b",
          "n_micro": 4, "steps": 3, "batch": 8}
GPT2_PP2_DP2 = {"name": "gpt2_pp2_dp2", "model": "gpt2", "points": ["model.transformer.h.2"], "schedule": "1f1b",
                "pp": 2,
                "n_micro": 2, "steps": 3, "batch": 4}


def _into(out, runs: list[dict]) -> list[dict]:
    return [{**r, "out": str(out / r["name"])} for r in runs]


# The configurations of this module, by number of ranks, for the shared jobs of tests/conftest.py
# (``real_model_jobs``): ``out / name`` holds each run's outputs.
def two_rank_runs(out) -> list[dict]:
    return _into(out, _traced_runs() + _batchnorm_runs())


def three_rank_runs(out) -> list[dict]:
    return _into(out, [LLAMA3])


def four_rank_runs(out) -> list[dict]:
    return _into(out, [GPT2_PP2_DP2])


@pytest.fixture(scope="module")
def jobs(real_model_jobs):
    """This module's outputs from the shared ``run_real`` jobs (tests/conftest.py)."""
    return real_model_jobs.real


def test_transformers_and_nanogpt_two_stages_traced(jobs):
    tmp_path = jobs
    runs = [{**r, "out": str(tmp_path / r["name"])} for r in _traced_runs()]
    for r in runs:
        out = load_rank(r["out"], 0)
        assert out["plan"]["meta"]["frontend"] == "traced"
        ref_model, ref_losses = reference(r["model"], 3, 8, 4, gradient_clip_val=r.get("gradient_clip_val"))
        assert_matches(ref_model, ref_losses, r["out"], [0, 1])
    # the clip really clipped (the same run without it ends elsewhere)
    clipped, free = (load_rank(tmp_path / n, 1)["state"]["model.lm_head.weight"] for n in ("gpt2_clipped", "gpt2_1f1b"))
    assert float((clipped - free).abs().max()) > 1e-4
    metrics = load_rank(tmp_path / "gpt2_1f1b", 0)["metrics"]
    assert 0 <= metrics["pipeline/bubble"] < 1 and metrics["pipeline/stage_1/fwd_ms"] > 0
    # a model without a plan is cut over its blocks, balanced by parameter count
    assert load_rank(tmp_path / "nanogpt_balanced", 0)["plan"]["meta"]["cut_points"] == ["model.transformer.h.2"]
    # the tied embedding / LM head stays one tensor, identical on both stages after training
    s0, s1 = (load_rank(tmp_path / "gpt2_1f1b", r)["state"] for r in (0, 1))
    torch.testing.assert_close(s0["model.transformer.wte.weight"], s1["model.lm_head.weight"], rtol=0, atol=0)


def test_llama_three_stages_and_pp2_dp2(jobs):
    tmp_path = jobs
    ref_model, ref_losses = reference("llama", 3, 8, 4)
    assert_matches(ref_model, ref_losses, tmp_path / "llama3", [0, 1, 2])
    assert load_rank(tmp_path / "llama3", 1)["stage_ids"] == [1]

    ref_model, ref_losses = reference("gpt2", 3, 8, 4)  # two replicas of batch 4 = one batch of 8 (token-mean loss)
    assert_matches(ref_model, None, tmp_path / "gpt2_pp2_dp2", [0, 1, 2, 3], compare_losses=False)
    # each replica logs its own loss (no sync_dist), on both its ranks; their mean is the one process's
    losses = {r: torch.tensor(load_rank(tmp_path / "gpt2_pp2_dp2", r)["losses"]) for r in range(4)}
    for a, b in ((0, 2), (1, 3)):  # ranks a and b: positions 0 and 1 of one replica
        torch.testing.assert_close(losses[a], losses[b], rtol=0, atol=0)
    torch.testing.assert_close((losses[0] + losses[1]) / 2, torch.tensor(ref_losses), **TOL)


def test_a_chain_with_batchnorm_logs_the_right_loss_from_the_first_step(jobs):
    runs = _into(jobs, _batchnorm_runs())
    ref_model, ref_losses = reference("bn_mlp", 4, 8, 4)
    for r in runs:
        assert load_rank(r["out"], 0)["plan"]["meta"]["frontend"] == "sequential"
        assert_matches(ref_model, ref_losses, r["out"], [0, 1])
