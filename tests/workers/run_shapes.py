"""A 2-rank fit on token batches padded to each batch's longest, with a model that cannot take every batch's shapes.

Usage: python -m tests.workers.run_shapes '<json: {"case": NAME, "out": DIR}>'

Cases (each ends every rank at the first batch it cannot take):

* ``sequential_bounded``: the sequential frontend; stage 1 adds a position table of 11 positions (the model bounds
  the length there, as a transformer's position embeddings do). The training batches are 11, 15, ... long: the
  second step fails in stage 1.
* ``traced_bounded``: the same model on the traced frontend: torch.export bounds the length while capturing, and
  the first stage's rank refuses the second batch before it runs.
* ``microbatches_differ``: stage 0 drops the padding its micro-batch does not need, so two micro-batches of one
  batch pass on different lengths.

Every rank writes ``DIR/rank{r}.json`` with the global step it reached before the run ended.

``{"case": "schedules", "out": DIR}`` instead trains SeqNet on the same batches under every schedule in turn (the
multi-stage ones on 4 stages, 2 a rank), 6 steps and a validation each, and saves each rank's parameters to
``DIR/<schedule>_rank{r}.pt``: every schedule hands the shapes over in its own order of sends and receives.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_hpp import HPPStrategy, StagePlan, StageSpec
from tests.conformance.shape_scenarios import VOCAB, SeqNet, TokenSeqs, pad_batch
from tests.harness.trainer import quiet_trainer

POSITIONS = 11  # the first training batch is 11 long, the second 15 (Lightning's shuffled order)


class PositionTable(nn.Module):
    """Adds a learned vector per position, from a table of ``POSITIONS`` positions: longer sequences fail."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(POSITIONS, 16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.table[: h.size(1)]


class DropPadding(nn.Module):
    """Drops the trailing positions that are padding in every sequence of the (micro-)batch."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids[:, : int((ids != 0).sum(1).max())]


class Bounded(SeqNet):
    def __init__(self) -> None:
        super().__init__()
        self.layers[2] = nn.Sequential(PositionTable(), nn.Linear(16, 16))


class Trimmed(SeqNet):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(DropPadding(), nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Tanh(),
                                    nn.Linear(16, VOCAB))

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        return logits.float().mean()


class Progress(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"global_step": trainer.global_step}, f)


SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b", "zbv", "dualpipev")
"""One of each way torch drives a schedule: one stage a rank (1F1B, GPipe), the runtime's lowered orders (interleaved),
the V with its tip passed on the rank (ZBV), and overlapped forward-backward pairs (DualPipeV)."""


def schedules(out: str) -> None:
    from lightning_hpp.pipeline.schedules import SCHEDULES as KINDS

    for name in SCHEDULES:
        L.seed_everything(0)
        model = SeqNet()
        cut = (["layers.0"], ["layers.1"], ["layers.2-3"], ["layers.4"]) if KINDS[name].multi else (
            ["layers.0-1"], ["layers.2-4"])
        strategy = HPPStrategy(plan=StagePlan([StageSpec(modules=m) for m in cut]), schedule=name, n_microbatches=4,
                               timeout=120)
        trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=6, val_check_interval=6, num_sanity_val_steps=0)
        loader = DataLoader(TokenSeqs(96, (3, 15), 0), batch_size=8, drop_last=True, collate_fn=pad_batch)
        val = DataLoader(TokenSeqs(24, (5, 16), 1), batch_size=12, collate_fn=pad_batch)
        trainer.fit(model, loader, val)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"state": state, "val_loss": float(trainer.callback_metrics["val_loss"])},
                   os.path.join(out, f"{name}_rank{trainer.global_rank}.pt"))


def main(cfg: dict) -> None:
    case = cfg["case"]
    if case == "schedules":
        schedules(cfg["out"])
        return
    L.seed_everything(0)
    model = Trimmed() if case == "microbatches_differ" else Bounded()
    cut = ["layers.0-1"], ["layers.2-4"]
    strategy = HPPStrategy(plan=StagePlan([StageSpec(modules=m) for m in cut]), n_microbatches=2, timeout=120,
                           frontend="traced" if case == "traced_bounded" else "sequential")
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=6, limit_val_batches=0,
                            callbacks=[Progress(cfg["out"])])
    # Lightning shuffles the training loader: its batches are 11, 15, 10, ... long
    # (tests.conformance.test_shapes.reference_lengths)
    loader = DataLoader(TokenSeqs(96, (3, 15), 0), batch_size=8, drop_last=True, collate_fn=pad_batch)
    trainer.fit(model, loader)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
