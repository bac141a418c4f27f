"""One training run carried through four layouts by its checkpoints, under ``Trainer(strategy=HPPStrategy(...))``.

One 4-rank job trains ``tests.models.MLP`` (SGD with momentum, a StepLR schedule) with the same global batch
under each layout in turn, each resuming (``resume="auto"``) from the checkpoint the previous one wrote into
the same directory:

    pp2 × fsdp2 (steps 1-2) → pp2 × ddp2 (steps 3-4) → pp4 (steps 5-6) → pp2 × tp2 (steps 7-8)

The losses of every step (under dp=2: each replica's, of its half of the global batch) and the final
parameters and momentum equal one uninterrupted single-process run (Lightning's own strategy, the same data
order) at 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from tests.launch import run_script
from tests.models import MLP, loaders

pytestmark = pytest.mark.slow

TWO = [["layers.0-3"], ["layers.4-6"]]
FOUR = [["layers.0-1"], ["layers.2-3"], ["layers.4-5"], ["layers.6"]]
GLOBAL_BATCH = 16
CHAIN = [  # (tag, stages, pp, dp, per-replica batch, strategy options, steps at the end)
    ("fsdp", TWO, 2, 2, GLOBAL_BATCH // 2, {"sharding": {"data_parallel": "fsdp"}}, 2),
    ("ddp", TWO, 2, 2, GLOBAL_BATCH // 2, {}, 4),
    ("pp4", FOUR, 4, 1, GLOBAL_BATCH, {}, 6),
    ("tp", TWO, 2, 1, GLOBAL_BATCH, {"sharding": {"tp_degree": 2}}, 8),  # tests.workers.run_resume's MLP split by its hook
]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reshard_chain")
    ckpt = str(out / "ckpt")
    runs = [{"stages": stages, "pp": pp, "devices": 4, "batch": batch, "steps": steps, "strategy": options,
             "tag": tag, "out": str(out), "ckpt_dir": ckpt, "every": 2, "resume": "auto", "timeout": 300,
             "tp_hook": tag == "tp"}
            for tag, stages, pp, _, batch, options, steps in CHAIN]
    run_script("tests.workers.run_resume", {"runs": runs}, timeout=1200)
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
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[losses])
    train, val = loaders(GLOBAL_BATCH)
    # Lightning shuffles distributed loaders with DistributedSampler(seed=0); over dp replicas the union of
    # one step's replica batches is this sampler's next batch
    sampler = DistributedSampler(train.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(model, DataLoader(train.dataset, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True), val)
    return model, trainer, losses.losses


def _ranks(out: Path, tag: str) -> list[dict]:
    return [torch.load(out / f"{tag}_rank{r}.pt", weights_only=False) for r in range(4)]


def test_losses_after_each_reshard_equal_the_uninterrupted_run(chain: Path) -> None:
    _, _, ref = _reference(CHAIN[-1][-1])
    start = 0
    for tag, _, _, dp, *_, steps in CHAIN:
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
        assert sorted(seen) == (["all"] * 4 if dp == 1 else ["0", "0", "1", "1"]), (tag, seen)  # each replica's pipeline
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
    from lightning_hpp.checkpoint.sharded import _read_index

    def chunks(step: int, key: str) -> list:
        meta = _read_index(str(chain / "ckpt" / f"step-{step}")).state_dict_metadata[key]
        return sorted((list(c.offsets), list(c.sizes)) for c in meta.chunks)

    for key in ("model/layers.0.weight", "optim/0/layers.0.weight/momentum_buffer"):
        assert chunks(2, key) == [([0, 0], [8, 8]), ([8, 0], [8, 8])]  # each dp_shard rank its half of the rows
        assert chunks(4, key) == [([0, 0], [16, 8])]
        assert chunks(8, key) == [([0, 0], [8, 8]), ([8, 0], [8, 8])]  # colwise: each tp rank its half of the rows
    # rowwise: each tp rank its half of the columns
    assert chunks(8, "model/layers.2.weight") == [([0, 0], [16, 8]), ([0, 8], [16, 8])]
