"""Setups where Lightning works and HPPStrategy used to refuse, crash or warn, in real 2-rank jobs compared with one
process: ``sync_dist=True`` in ``validation_step`` (no warning to add it), a cut at a container of units,
``dualpipev`` evaluating batches of fewer micro-batches than stages, the traced frontend on one-sample micro-batches,
a traced bf16 stage's BatchNorm statistics.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.harness.launch import Job, run_job
from tests.harness.results import load_rank, merged_state
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import make_dataset
from tests.workers.run_edges import CASES

pytestmark = pytest.mark.slow
TOL = dict(rtol=1e-5, atol=1e-6)
SYNC_WARNING = "It is recommended to use `self.log("


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("edges")
    run_job(Job("tests.workers.run_edges", {"out": str(out)}, ranks=2, start="forked", timeout=600))
    return out


def reference(case: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The same module and steps in one process, drawing the order Lightning's distributed sampler gives."""
    cfg = CASES[case]
    L.seed_everything(0)
    model = cfg["model"](depth=cfg["depth"]) if "depth" in cfg else cfg["model"]()
    trainer = quiet_trainer(devices=1, max_steps=cfg["steps"], num_sanity_val_steps=0,
                            limit_val_batches=cfg.get("limit_val_batches", 0))
    ds = make_dataset(128)
    train = DataLoader(ds, batch_size=cfg["batch"],
                       sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0),
                       drop_last=True)
    val = DataLoader(make_dataset(cfg.get("val_n", 64), seed=1), batch_size=cfg.get("val_batch", 16))
    trainer.fit(model, train, val)
    if cfg.get("limit_val_batches"):
        trainer.validate(model, val, verbose=False)
    return model.state_dict(), {k: float(v) for k, v in trainer.callback_metrics.items()}


def assert_like_one_process(out, case: str) -> None:
    ref_state, ref_metrics = reference(case)
    got = merged_state(out / case, [0, 1])
    assert set(got) == set(ref_state)
    for name, value in got.items():
        torch.testing.assert_close(value, ref_state[name], **TOL, msg=lambda m, n=name: f"{case} {n}: {m}")
    for rank in (0, 1):
        metrics = load_rank(out / case, rank)["callback_metrics"]
        for key, want in ref_metrics.items():
            assert metrics[key] == pytest.approx(want, rel=1e-5, abs=1e-6), f"{case} rank {rank}: {key}"


def test_sync_dist_values_keep_the_users_flag_and_lightning_asks_for_nothing(runs):
    assert_like_one_process(runs, "sync_dist")
    for rank in (0, 1):
        caught = load_rank(runs / "sync_dist", rank)["warnings"]
        assert not [w for w in caught if SYNC_WARNING in w], caught


def test_values_logged_without_sync_dist_on_one_replica_are_the_jobs_and_lightning_asks_for_nothing(runs):
    # pp=2 x dp=1: every rank holds the last stage's value, so `sync_dist` would change nothing
    assert_like_one_process(runs, "unsynced")
    for rank in (0, 1):
        caught = load_rank(runs / "unsynced", rank)["warnings"]
        assert not [w for w in caught if SYNC_WARNING in w], caught


def test_a_cut_at_a_container_cuts_before_its_first_unit(runs):
    assert_like_one_process(runs, "container")
    plan = load_rank(runs / "container", 0)["plan"]
    assert [s["modules"] for s in plan["stages"]] == [["a.0", "a.1", "a.2", "a.3"], ["b.0", "b.1", "b.2"]]


def test_dualpipev_evaluates_batches_of_fewer_micro_batches_than_stages(runs):
    # validation batches of 34 and 30 samples: 2 and 3 equal micro-batches for 4 stages
    assert_like_one_process(runs, "dualpipev")
    assert [load_rank(runs / "dualpipev", r)["stage_ids"] for r in (0, 1)] == [[0, 3], [1, 2]]


def test_the_traced_frontend_trains_one_sample_micro_batches_and_validates_other_sizes(runs):
    assert_like_one_process(runs, "traced_one_sample")
    assert load_rank(runs / "traced_one_sample", 0)["plan"]["meta"]["frontend"] == "traced"


class MicroBatchedBN(L.LightningModule):
    """The reference of ``traced_bn_bf16`` in one process: BatchNormNet's stage ``b`` in bf16 (its input cast there,
    as the stage casts it), each step's batch run as the pipeline runs it, in 4 micro-batches whose mean loss is
    the step's (BatchNorm normalises, and updates its statistics, once per micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.workers.run_edges import BatchNormNet

        self.net = BatchNormNet()
        self.net.b.to(torch.bfloat16)

    def training_step(self, batch, batch_idx):
        losses = [torch.nn.functional.cross_entropy(self.net.b(self.net.a(x).to(torch.bfloat16)).float(), y)
                  for x, y in zip(*(t.chunk(4) for t in batch))]
        return torch.stack(losses).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


def test_a_traced_bf16_stage_updates_the_modules_batchnorm_statistics(runs):
    # the bf16 cast replaces buffers with new tensors: the traced stage must read and update the module's own,
    # so that state_dict(), checkpoints and exports hold the trained statistics
    L.seed_everything(0)
    ref = MicroBatchedBN()
    ds = make_dataset(128)
    trainer = quiet_trainer(devices=1, max_steps=3, limit_val_batches=0)
    trainer.fit(ref, DataLoader(ds, batch_size=16,
                                sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0),
                                drop_last=True))
    want = {k: v for k, v in ref.net.state_dict().items()}
    held = load_rank(runs / "traced_bn_bf16", 1)
    state = held["state"]
    assert int(state["b.1.num_batches_tracked"]) == 3 * 4  # once per micro-batch of the 3 steps
    for key in ("b.1.running_mean", "b.1.running_var"):
        assert state[key].dtype == torch.bfloat16, key
        assert not torch.equal(state[key],
                               torch.zeros_like(state[key]) if "mean" in key else torch.ones_like(state[key]))
        # the same micro-batches' statistics in bf16: within one bf16 rounding (measured: equal)
        torch.testing.assert_close(state[key].float(), want[key].float(), rtol=8e-3, atol=0,
                                   msg=lambda m, k=key: f"{k}: {m}")
        # the stage itself reads the very tensors the module holds
        stage_keys = [k for k in held["stage_state"] if k.endswith(key)]
        assert stage_keys and all(torch.equal(held["stage_state"][k], state[key]) for k in stage_keys), stage_keys
    got = merged_state(runs / "traced_bn_bf16", [0, 1])
    assert set(got) == set(want)
    # bf16 weights within one rounding of |w| < 0.5 (measured: 9.8e-4; a.0 in fp32 4.7e-4)
    for name, value in got.items():
        torch.testing.assert_close(value.float(), want[name].float(), rtol=0, atol=2e-3,
                                   msg=lambda m, n=name: f"{n}: {m}")
