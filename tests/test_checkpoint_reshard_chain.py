"""One training run carried through eight layouts by its checkpoints, under ``Trainer(strategy=HPPStrategy(...))``.

``tests.harness.zoo.MLP`` (SGD with momentum, a StepLR schedule) trains with the same global batch under each layout
in turn, each resuming (``resume="auto"``) from the checkpoint the previous one wrote into the same directory:
the first two in the one 8-rank job (tests/conftest.py, ``eight_rank_job``), the others in a 4-rank job after it:

    pp2 × fsdp2 × tp2 (steps 1-2) → pp4 × tp2 (3-4)                                         8 ranks
    → pp2 × dp2 (5-6) → pp2 × fsdp2 (7-8) → pp4 (9-10) → pp2 × tp2 (11-12)                   4 ranks

(tensor parallel by the model's ``parallelize_stage`` hook: Linear pairs colwise then rowwise, a stage's unpaired
Linear colwise with its output gathered). The losses of every step (under dp=2: each replica's, of its half of
the global batch) and the final parameters and momentum equal one uninterrupted single-process run (Lightning's
own strategy, the same data order) at 1e-5; the checkpoints written under pp2 × fsdp2 × tp2 (2-D shards) and at
the end export to one ``.ckpt`` equal to that run at those steps.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from tests.harness.launch import Job, run_job
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders

pytestmark = pytest.mark.slow

TWO = [["layers.0-3"], ["layers.4-6"]]
FOUR = [["layers.0-1"], ["layers.2-3"], ["layers.4-5"], ["layers.6"]]
GLOBAL_BATCH = 16
FSDP, TP = {"data_parallel": "fsdp"}, {"tp_degree": 2}
CHAIN = [  # (tag, stages, pp, dp, ranks, strategy options, steps at the end)
    ("fsdp_tp", TWO, 2, 2, 8, {"sharding": {**FSDP, **TP}}, 2),
    ("pp4_tp", FOUR, 4, 1, 8, {"sharding": TP}, 4),
    ("ddp", TWO, 2, 2, 4, {}, 6),
    ("fsdp", TWO, 2, 2, 4, {"sharding": FSDP}, 8),
    ("pp4", FOUR, 4, 1, 4, {}, 10),
    ("tp", TWO, 2, 1, 4, {"sharding": TP}, 12),
]


def _runs(out: Path, ranks: int) -> list[dict]:
    ckpt = str(out / "ckpt")
    return [{"worker": "resume", "stages": stages, "pp": pp, "devices": ranks, "batch": GLOBAL_BATCH // dp,
             "steps": steps, "strategy": options, "tag": tag, "out": str(out), "ckpt_dir": ckpt, "every": 2,
             "resume": "auto", "timeout": 300, "tp_hook": "tp_degree" in options.get("sharding", {})}
            for tag, stages, pp, dp, n, options, steps in CHAIN if n == ranks]


def eight_rank_runs(out: Path) -> list[dict]:
    """The chain's 8-rank layouts, for the 8-rank job (tests/conftest.py: ``eight_rank_job``)."""
    return _runs(out, 8)


@pytest.fixture(scope="module")
def chain(eight_rank_job) -> Path:
    out = eight_rank_job.chain
    assert all((out / f"pp4_tp_rank{r}.pt").exists() for r in range(8)), eight_rank_job.proc.stderr[-8000:]
    run_job(Job("tests.workers.run_resume", {"runs": _runs(out, 4)}, ranks=4, start="forked", timeout=1200))
    return out


class _Losses(L.Callback):
    """Each step's loss before the update: of the whole batch, and of the part each of 2 data-parallel
    replicas trains on (the model logs its loss unsynced, so a rank of a dp=2 layout reports its replica's)."""

    def __init__(self) -> None:
        self.losses: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            # DistributedSampler hands replica r every other index of the permutation: [r::2] of each batch
            parts = {str(r): float(F.cross_entropy(pl_module(x[r::2]), y[r::2])) for r in (0, 1)}
            self.losses.append({"all": float(F.cross_entropy(pl_module(x), y)), **parts})


def _reference(steps: int) -> tuple[MLP, L.Trainer, list[float]]:
    """The uninterrupted run: one process, Lightning's own strategy, the data order of the distributed runs."""
    L.seed_everything(0)
    model = MLP()
    losses = _Losses()
    trainer = quiet_trainer(devices=1, max_steps=steps, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[losses])
    train, val = loaders(GLOBAL_BATCH)
    # Lightning shuffles distributed loaders with DistributedSampler(seed=0); over dp replicas the union of
    # one step's replica batches is this sampler's next batch
    sampler = DistributedSampler(train.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(model, DataLoader(train.dataset, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True), val)
    return model, trainer, losses.losses


def _ranks(out: Path, tag: str) -> list[dict]:
    ranks = next(n for t, *_, n, _, _ in CHAIN if t == tag)
    return [torch.load(out / f"{tag}_rank{r}.pt", weights_only=False) for r in range(ranks)]


def test_losses_after_each_reshard_equal_the_uninterrupted_run(chain: Path) -> None:
    _, _, ref = _reference(CHAIN[-1][-1])
    start = 0
    for tag, _, _, dp, ranks, _, steps in CHAIN:
        expected = {part: [step[part] for step in ref[start:steps]] for part in ("all", "0", "1")}
        seen = []
        for r, got in enumerate(_ranks(chain, tag)):
            assert got["global_step"] == steps
            if start:
                assert got["resumed_from"] == str(chain / "ckpt" / f"step-{start}"), (tag, r)
            parts = ["all"] if dp == 1 else ["0", "1"]
            match = [p for p in parts if got["losses"] == pytest.approx(expected[p], abs=1e-5)]
            assert match, (tag, r, got["losses"], expected)
            seen += match
        assert sorted(
            seen) == (["all"] * ranks if dp == 1 else ["0"] * (ranks // 2) + ["1"] * (ranks // 2)), (tag, seen)
        start = steps


def test_final_parameters_and_momentum_equal_the_uninterrupted_run(chain: Path) -> None:
    model, trainer, _ = _reference(CHAIN[-1][-1])
    from lightning_hpp.checkpoint.lightning_state import optimizer_to_named, param_names

    momentum, _ = optimizer_to_named(trainer.optimizers[0], param_names(model))
    state, optim = {}, {}
    for got in _ranks(chain, CHAIN[-1][0]):
        state.update(got["state"])
        optim.update(got["optim"])
    assert sorted(state) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=name)
    for name, slot in momentum.items():
        torch.testing.assert_close(optim[name]["momentum_buffer"], slot["momentum_buffer"], rtol=0, atol=1e-5, msg=name)


def test_fsdp_and_tp_checkpoints_hold_shards_and_the_ddp_one_whole_tensors(chain: Path) -> None:
    from lightning_hpp.checkpoint.dcp_index import read_index

    def chunks(step: int, key: str) -> list:
        meta = read_index(str(chain / "ckpt" / f"step-{step}")).state_dict_metadata[key]
        return sorted((list(c.offsets), list(c.sizes)) for c in meta.chunks)

    for key in ("model/layers.0.weight", "optim/0/layers.0.weight/momentum_buffer"):
        # pp2 × fsdp2 × tp2: colwise rows split over the 2 tp ranks, each half sharded over the 2 dp_shard ranks
        assert chunks(2, key) == [([0, 0], [4, 8]), ([4, 0], [4, 8]), ([8, 0], [4, 8]), ([12, 0], [4, 8])]
        assert chunks(6, key) == [([0, 0], [16, 8])]
        assert chunks(8, key) == [([0, 0], [8, 8]), ([8, 0], [8, 8])]  # each dp_shard rank its half of the rows
        assert chunks(12, key) == [([0, 0], [8, 8]), ([8, 0], [8, 8])]  # colwise: each tp rank its half of the rows
    # rowwise: each tp rank its half of the columns (and under fsdp2 × tp2 each of those halves its rows)
    assert chunks(12, "model/layers.2.weight") == [([0, 0], [16, 8]), ([0, 8], [16, 8])]
    assert len(chunks(2, "model/layers.2.weight")) == 4
    # pp4 × tp2: the stage of one Linear splits its rows
    assert chunks(4, "model/layers.2.weight") == [([0, 0], [8, 16]), ([8, 0], [8, 16])]


def test_the_3d_checkpoint_and_the_last_export_to_one_ckpt_equal_to_the_uninterrupted_run(
    chain: Path, tmp_path) -> None:
    from lightning_hpp.checkpoint.export import export_to_lightning_ckpt

    for step in (2, 12):
        model, _, _ = _reference(step)
        dst = tmp_path / f"step{step}.ckpt"
        export_to_lightning_ckpt(str(chain / "ckpt" / f"step-{step}"), str(dst))
        state = torch.load(dst, weights_only=False)["state_dict"]
        assert sorted(state) == sorted(model.state_dict())
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=name)
