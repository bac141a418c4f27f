"""A 2-stage transformers model on one device: HPPStrategy against Lightning's own strategy, and the
device-placement harness on that device.

One process holds both stages (an interleaved schedule puts two stages on one rank), so a machine
with one GPU runs a real 2-stage pipeline on it: Llama (3 layers, hidden 64) cut before layer 2, 4
steps of SGD on batches of 8 in ``--precision``, against the same module trained by Lightning's own
strategy in one process, where the stages' casts are the whole model's (the same precision
everywhere). Then tests/device_harness.py places both frontends, the meta path, a Llama and a
BatchNorm stage on ``--device`` and lists any tensor that is elsewhere.

    python benchmarks/precision/two_stage.py --device cuda --precision bf16-true --out runs/gpu_check
    python benchmarks/precision/two_stage.py --device cpu --precision 32-true      # the same on the CPU

Writes ``two_stage.json`` and prints one table; exit status 1 when a loss is out of bounds or a
tensor is misplaced.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from lightning_hpp import HPPStrategy, StagePlan  # noqa: E402
from lightning_hpp.model.materialize import init_on_meta  # noqa: E402
from tests.device_harness import place_and_run  # noqa: E402
from tests.harness.zoo import MLP  # noqa: E402
from tests.harness.zoo.real import LMWrapper, dataset  # noqa: E402
from tests.workers.run_edges import BatchNormNet  # noqa: E402

CUT = ["model.model.layers.2"]
BOUNDS = {"32-true": 1e-5, "bf16-true": 3e-2, "bf16-mixed": 3e-2, "16-mixed": 3e-2, "16-true": 3e-2}


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def fit(device: str, precision: str, strategy=None) -> list[float]:
    L.seed_everything(0)
    model = LMWrapper("llama", lr=0.05)
    losses = Losses()
    kw = {"strategy": strategy} if strategy is not None else {}
    trainer = L.Trainer(accelerator=device, devices=1, precision=precision, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[losses], **kw)
    ds = dataset("llama", 64)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(model, DataLoader(ds, batch_size=8, sampler=sampler, drop_last=True))
    return losses.values


def harness(device: str) -> dict[str, list[str]]:
    x = ((torch.randn(4, 8),), {})
    ids, mask, _ = dataset("llama", 4).tensors
    lm = ((ids,), {"attention_mask": mask})
    with init_on_meta():
        meta_llama = LMWrapper("llama")
    cases = {
        "mlp sequential": (MLP(depth=4), ["layers.4"], x, "sequential", None),
        "mlp traced": (MLP(depth=4), ["layers.4"], x, "traced", None),
        "batchnorm traced bf16": (BatchNormNet(), ["b"], x, "traced", {1: torch.bfloat16}),
        "llama traced": (LMWrapper("llama"), CUT, lm, "traced", None),
        "llama meta-built traced": (meta_llama, CUT, lm, "traced", None),
    }
    return {name: place_and_run(m, StagePlan.split_at(c), ex, frontend=f, device=device, param_dtype=d)[1]
            for name, (m, c, ex, f, d) in cases.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--precision", default="bf16-true", choices=sorted(BOUNDS))
    p.add_argument("--out", default="runs/gpu_check")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pipeline = fit(args.device, args.precision, HPPStrategy(plan=StagePlan.split_at(CUT), schedule="interleaved1f1b",
                                                            n_microbatches=2, frontend="traced"))
    reference = fit(args.device, args.precision)
    gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(pipeline, reference))
    placed = harness("meta" if args.device == "cpu" else args.device)
    ok = len(pipeline) == len(reference) == 4 and gap <= BOUNDS[args.precision] and not any(placed.values())
    result = {"device": args.device, "precision": args.precision, "pipeline_losses": pipeline,
              "reference_losses": reference, "max_relative_gap": gap, "bound": BOUNDS[args.precision],
              "misplaced": placed, "ok": ok}
    pathlib.Path(args.out, "two_stage.json").write_text(json.dumps(result, indent=2))
    print(f"| check | result |\n|---|---|\n| 2-stage Llama, {args.precision} on {args.device}: losses vs one process "
          f"| max relative gap {gap:.2e} (bound {BOUNDS[args.precision]:.0e}) |")
    for name, problems in placed.items():
        print(f"| placement on {'meta' if args.device == 'cpu' else args.device}: {name} | "
              f"{'every tensor on the device' if not problems else '; '.join(problems[:3])} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
