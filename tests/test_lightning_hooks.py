"""Lightning hooks under HPPStrategy in a real 2-rank pipeline (pp=2): a ``configure_gradient_clipping``
override is called per stage and its clipping matches a single-process reference that applies the same
rule to each stage's parameters; manual optimization is refused at setup on every rank."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.harness.launch import Job, run_job
from tests.harness.results import load_rank, merged_state
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, make_dataset
from tests.workers import run_hooks as worker

pytestmark = pytest.mark.slow

STAGE_OF_LAYER = {0: 0, 2: 0, 4: 1, 6: 1}  # the Linear layers of tests.harness.zoo.MLP(depth=4), by stage


def stage_params(model: MLP) -> list[list[torch.nn.Parameter]]:
    out: list[list[torch.nn.Parameter]] = [[], []]
    for name, p in model.named_parameters():
        out[STAGE_OF_LAYER[int(name.split(".")[1])]].append(p)
    return out


class RefLightningClip(MLP):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        for params in stage_params(self):
            torch.nn.utils.clip_grad_norm_(params, worker.step_limit(self.global_step))


class RefTorchClip(MLP):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        for params in stage_params(self):
            torch.nn.utils.clip_grad_value_(params, 0.004)


class RefGlobal(MLP):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.global_step >= 1:
            torch.nn.utils.clip_grad_norm_(list(self.parameters()), gradient_clip_val)


def reference(cls: type[MLP], **trainer_kw) -> dict[str, torch.Tensor]:
    """One process, fp32, the same global batches in the same (shuffled) order, the same steps."""
    L.seed_everything(0)
    model = cls()
    trainer = quiet_trainer(devices=1, max_steps=worker.STEPS, num_sanity_val_steps=0, limit_val_batches=0,
                            **trainer_kw)
    ds = make_dataset(128)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(model, DataLoader(ds, batch_size=worker.BATCH, sampler=sampler, drop_last=True))
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hooks")
    run_job(Job("tests.workers.run_hooks", {"out": str(out)}, ranks=2, start="forked"))
    return out


def test_configure_gradient_clipping_is_called_per_stage_and_matches_the_reference(runs):
    unclipped = reference(MLP)
    for case, ref_cls, kw in (
        ("lightning_clip", RefLightningClip, {}),
        ("torch_clip", RefTorchClip, {}),
        ("global_clip", RefGlobal, {"gradient_clip_val": 0.03}),
    ):
        expected = reference(ref_cls, **kw)
        got = merged_state(runs / case, [0, 1])
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(
                got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, c=case: f"{c} {n}: {m}"
            )
        # the rule really clipped: without it the parameters end elsewhere
        assert max(float((expected[k] - unclipped[k]).abs().max()) for k in expected) > 1e-4, case
        for rank in (0, 1):
            calls = load_rank(runs / case, rank)["calls"]
            # once per step, with this rank's stage only (its two Linear layers: 4 tensors)
            assert [(c[0], c[1]) for c in calls] == [(s, rank) for s in range(worker.STEPS)], (case, calls)
            if case != "global_clip":
                assert all(c[2] == 4 for c in calls)
            else:
                assert all(c[3] == 0.03 for c in calls)  # the Trainer's value reaches the hook


def test_manual_optimization_is_refused_on_every_rank_before_training(runs):
    for rank in (0, 1):
        res = load_rank(runs / "manual", rank)
        assert res["global_step"] == 0 and res["unchanged"]
        msg = res["error"]
        assert msg is not None and msg.startswith(
            "`Manual.automatic_optimization = False` cannot run under HPPStrategy"
        )
        assert "manual_backward" in msg and "configure_gradient_clipping" in msg
