"""A transformers causal LM, unchanged, trained in 2 pipeline stages on CPU.

    PYTHONHASHSEED=0 python examples/hf_causal_lm/train.py            # 2 processes, 1F1B, 4 micro-batches
    PYTHONHASHSEED=0 python examples/hf_causal_lm/train.py --steps 20 --out /tmp/run

The model is transformers' ``LlamaForCausalLM`` built from a tiny config (nothing is downloaded),
held by an ordinary LightningModule as ``self.model``. The data are synthetic: every sequence counts
up modulo the vocabulary with its own stride (``x[t + 1] = (x[t] + d) % V``), a pattern the model
learns from the context, so the loss falls within a few hundred steps.

The plan cuts the model before decoder layer ``--cut`` with ``StagePlan.split_at``: stage 0 (the
embedding and the first layers) in bf16-mixed, stage 1 (the other layers, the final norm and the LM
head) in fp32. The cut lies inside ``self.model``, so ``HPPStrategy`` uses its traced frontend
(``torch.export``). Lightning launches the second process itself (gloo on CPU); rank 0 prints a
report at the end and writes it as JSON to ``<out>/report.json``.

PYTHONHASHSEED: every rank must hash strings alike (unset, the coded-bias checks warn that the ranks
differ). Lightning starts rank 1 from rank 0's environment, so setting it in the shell covers every
rank; when it is unset the script restarts itself once with ``PYTHONHASHSEED=0``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpp import HPPStrategy, StagePlan
from lightning_hpp.examples_data.progress import progress_bar

VOCAB = 64


class CausalLM(L.LightningModule):
    """How a user wraps a transformers model: ``self.model``, ``forward`` returns the logits."""

    def __init__(self, layers: int = 4, hidden: int = 64, seq_len: int = 32, lr: float = 3e-3) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq_len,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        self.model = LlamaForCausalLM(config)
        self.lr = lr

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits

    def training_step(self, batch, batch_idx):
        ids, mask = batch
        logits = self(ids, mask)
        # next-token prediction, the user's own loss
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def counting_sequences(n: int, seq_len: int, seed: int) -> TensorDataset:
    """``x[t + 1] = (x[t] + d) % VOCAB``: a random start and a random stride ``d`` in 1..7 per sequence."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + stride * torch.arange(seq_len)) % VOCAB
    return TensorDataset(ids, torch.ones_like(ids))


class LossHistory(L.Callback):
    """The loss as logged at every step (averaged over the micro-batches; every rank sees it)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--cut", type=int, default=2, help="stage 1 begins at decoder layer CUT")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default="runs/hf_causal_lm", help="run directory (logs, stage_plan.json, report.json)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    L.seed_everything(args.seed, verbose=False)
    plan = StagePlan.split_at([f"model.model.layers.{args.cut}"], precision=["bf16-mixed", "32-true"])
    strategy = HPPStrategy(plan=plan, schedule="1f1b", n_microbatches=args.n_microbatches)
    history = LossHistory()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,  # one pass over steps x batch-size fresh sequences
        max_steps=args.steps,
        default_root_dir=args.out,
        log_every_n_steps=min(10, args.steps),
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[history, progress_bar()],
    )
    data = DataLoader(
        counting_sequences(args.batch_size * args.steps, args.seq_len, args.seed),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
    )
    model = CausalLM(layers=args.layers, seq_len=args.seq_len, lr=args.lr)
    trainer.fit(model, data)
    log_dir = trainer.log_dir or args.out  # a collective: every rank asks
    losses = history.losses
    tail = losses[-min(10, len(losses)):]
    report = {
        "steps": trainer.global_step,
        "loss_start": losses[0],
        "loss_end": sum(tail) / len(tail),
        "frontend": strategy.plan.meta["frontend"],
        "cut_points": strategy.plan.meta.get("cut_points"),
        "precisions": [s.precision for s in strategy.plan.stages],
        "wall_time_s": time.monotonic() - start,
        "stage_plan": os.path.join(log_dir, "stage_plan.json"),
    }
    if trainer.is_global_zero:
        print(
            "\n=== lightning_hpp example: transformers LlamaForCausalLM, 2 pipeline stages on CPU ===\n"
            f"train loss          : {report['loss_start']:.3f} at step 1 -> {report['loss_end']:.3f} "
            f"(mean of the last {len(tail)} steps; log({VOCAB}) = {torch.log(torch.tensor(float(VOCAB))):.3f} is "
            "chance)\n"
            f"optimizer steps     : {report['steps']}  (batch {args.batch_size}, {args.n_microbatches} micro-batches, "
            "schedule 1f1b)\n"
            f"wall time           : {report['wall_time_s']:.1f} s (process start-up included)\n"
            f"frontend            : {report['frontend']} (cut at {', '.join(report['cut_points'] or [])})\n"
            f"stage plan          : {report['stage_plan']}\n"
            f"{strategy.plan.table()}\n"
        )
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    if "PYTHONHASHSEED" not in os.environ and "LOCAL_RANK" not in os.environ:
        # as scripts/demo.sh does: one str-hash seed for every rank. It must be set before the
        # interpreter starts, so rank 0 restarts itself with it; Lightning's rank 1 inherits it.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    torch.set_num_threads(1)
    main()
