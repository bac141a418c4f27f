"""The main demo job: the hybrid vision model trained in 3 pipeline stages on CPU.

    python examples/hybrid_vision/train.py            # 3 processes, 1F1B, 8 micro-batches

Lightning launches the 3 processes itself (gloo on CPU). Rank 0 shows the progress bar and prints
a final report: validation accuracy, steps, time and the stage plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from model import HybridVisionModel, fp32_plan, mixed_plan  # noqa: E402

from lightning_hpp import HPPPrecision, HPPStrategy  # noqa: E402
from lightning_hpp.examples_data import DigitsDataModule  # noqa: E402
from lightning_hpp.examples_data.progress import progress_bar

TARGET_ACCURACY = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--plan",
        choices=["mixed", "fp32"],
        default="mixed",
        help="per-stage precisions (mixed: fp16 -> fp8 (emulated on CPU) -> bf16) or fp32 everywhere",
    )
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--n-microbatches", type=int, default=8)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--out", default="runs/hybrid_vision")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    start = time.monotonic()
    L.seed_everything(args.seed, verbose=False)
    plan = mixed_plan() if args.plan == "mixed" else fp32_plan()
    strategy = HPPStrategy(
        plan=plan, schedule=args.schedule, n_microbatches=args.n_microbatches, **_precision_options(args.plan)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        default_root_dir=args.out,
        log_every_n_steps=5,
        enable_model_summary=False,
        callbacks=[progress_bar()],
    )
    data = DigitsDataModule(batch_size=args.batch_size, n_microbatches=args.n_microbatches, seed=args.seed)
    model = HybridVisionModel()
    trainer.fit(model, data)
    accuracy = float(trainer.callback_metrics["val/acc"])
    log_dir = trainer.log_dir or args.out  # a collective: every rank asks
    if trainer.is_global_zero:
        elapsed = time.monotonic() - start
        status = "reached" if accuracy >= TARGET_ACCURACY else "MISSED"
        print(
            "\n=== lightning_hpp demo: hybrid vision model, 3 pipeline stages on CPU ===\n"
            f"validation accuracy : {accuracy:.4f}  ({status} the {TARGET_ACCURACY:.0%} target)\n"
            f"optimizer steps     : {trainer.global_step}  ({args.epochs} epochs, batch {args.batch_size}, "
            f"{args.n_microbatches} micro-batches, schedule {args.schedule})\n"
            f"wall time           : {elapsed:.1f} s (process start-up included)\n"
            f"stage plan          : {os.path.join(log_dir, 'stage_plan.json')}\n"
            f"{strategy.plan.table()}\n"
        )
    return accuracy


def _precision_options(plan: str) -> dict:
    # fp8 has no hardware on CPU: the emulation is used, and labelled as such in the logs and the plan.
    if plan == "mixed":
        return {"precision_plugin": HPPPrecision(fp8_backend="emulate")}
    return {}


if __name__ == "__main__":
    # Lightning 2.6.6 calls a torch pytree API that torch 2.13 deprecates (once per rank and loader)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    torch.set_num_threads(1)
    main()
