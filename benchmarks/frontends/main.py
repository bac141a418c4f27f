"""The traced frontend's cost: HPPStrategy vs raw torch pipelining on a traced model, and the two
frontends on one chain model.

* **traced model** (a transformers GPT-2, cut inside the model at ``h.<L/2>``): every HPPStrategy
  step (``frontend="traced"``) is followed, in the same processes, by one step of torch's own traced
  pipeline on the same batch (``pipeline()`` + ``build_stage`` + the same schedule and SGD): the
  median of the per-step ratios is "HPP ÷ raw (paired)".
* **chain model** (benchmarks/throughput's MLP, cut after block 3): HPPStrategy with
  ``frontend="sequential"`` and with ``frontend="traced"``, in alternating rounds in the same
  processes (a Trainer cannot interleave with another's steps); the ratio of the medians.

Throughput = global batch / step time; a ratio above 1 means HPPStrategy (or the traced frontend)
is faster. Usage::

    python benchmarks/frontends/main.py --out /tmp/frontends
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "throughput"), str(ROOT)]


def _gpt2(job: dict[str, Any]) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(vocab_size=job["vocab"], n_positions=job["seq"], n_embd=job["d"],
                                                    n_layer=job["layers"], n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                                    attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

        def forward(self, ids, attention_mask=None):
            return self.model(input_ids=ids, attention_mask=attention_mask).logits

        def training_step(self, batch, batch_idx):
            ids, mask, labels = batch
            logits = self(ids, attention_mask=mask)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return LM()


def _tokens(job: dict[str, Any], steps: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    n = steps * job["batch"]
    ids = torch.randint(0, job["vocab"], (n, job["seq"]), generator=g)
    return TensorDataset(ids, torch.ones_like(ids), torch.randint(0, job["vocab"], (n, job["seq"]), generator=g))


class RawTraced:
    """torch's own traced pipeline of the same model: ``pipeline()``, ``build_stage``, the schedule."""

    def __init__(self, job: dict[str, Any], data: Any) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.pipelining import SplitPoint, pipeline

        from lightning_hpp.pipeline.schedules import SCHEDULES

        model = _gpt2(job)
        self.ids, self.mask, self.labels = data.tensors
        b, m = job["batch"], job["m"]
        pipe = pipeline(model, (self.ids[: b // m],), {"attention_mask": self.mask[: b // m]},
                        split_spec={f"model.transformer.h.{job['layers'] // 2}": SplitPoint.BEGINNING})
        self.rank = dist.get_rank()
        stage = pipe.build_stage(self.rank, torch.device("cpu"))

        def loss_fn(out, target):
            return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))

        self.sched = SCHEDULES[job["schedule"]].cls(stage, m, loss_fn=loss_fn, scale_grads=True)
        self.opt = torch.optim.SGD(stage.submod.parameters(), lr=0.01, momentum=0.9)
        self.batch = b

    def step(self, i: int) -> float:
        sl = slice(i * self.batch, (i + 1) * self.batch)
        t0 = time.perf_counter()
        if self.rank == 0:
            self.sched.step(self.ids[sl], attention_mask=self.mask[sl])
        else:
            self.sched.step(target=self.labels[sl])
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0


def _timer() -> Any:
    from lightning.pytorch import Callback

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self._t)

    return Timer()


def _trainer(strategy: Any, callbacks: list[Any], steps: int) -> Any:
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def traced_paired(job: dict[str, Any]) -> dict[str, Any]:
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader

    from lightning_hpp import HPPStrategy, StagePlan

    steps = job["warmup"] + job["steps"]
    data = _tokens(job, steps)
    raw = RawTraced(job, data)
    timer = _timer()

    class RawAfterEach(Callback):
        times: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(raw.step(batch_idx))

    paired = RawAfterEach()
    plan = StagePlan.split_at([f"model.transformer.h.{job['layers'] // 2}"])
    strategy = HPPStrategy(plan=plan, schedule=job["schedule"], n_microbatches=job["m"], frontend="traced", timeout=300)
    _trainer(strategy, [timer, paired], steps).fit(
        _gpt2(job), DataLoader(data, batch_size=job["batch"], drop_last=True)
    )
    w = job["warmup"]
    return {"hpp_s": timer.times[w:], "raw_s": paired.times[w:],
            "hpp_over_raw": [r / h for h, r in zip(timer.times[w:], paired.times[w:])]}


def frontends(job: dict[str, Any]) -> dict[str, Any]:
    from models import SIZES, build, dataset, split
    from torch.utils.data import DataLoader

    from lightning_hpp import HPPStrategy, StagePlan, StageSpec

    size = SIZES["mlp"]["cpu"]
    steps = job["warmup"] + job["chain_steps"]
    plan = StagePlan([StageSpec(modules=u) for u in split("mlp", size, 2)])
    times: dict[str, list[float]] = {"sequential": [], "traced": []}
    for _ in range(job["rounds"]):
        for frontend in ("sequential", "traced"):
            timer = _timer()
            strategy = HPPStrategy(
                plan=plan, schedule=job["schedule"], n_microbatches=job["m"], frontend=frontend, timeout=300
            )
            _trainer(strategy, [timer], steps).fit(
                build("mlp", size), DataLoader(dataset("mlp", size, steps), batch_size=size.batch, drop_last=True)
            )
            assert strategy.plan.meta["frontend"] == frontend
            times[frontend] += timer.times[job["warmup"]:]
    return times


def worker(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")  # before the raw pipeline; Lightning then uses this group
    out = {"traced_model": traced_paired(job), "chain_model": frontends(job)}
    Path(job["out"], f"frontends{rank}.json").write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps of the paired traced-model run")
    p.add_argument("--chain-steps", type=int, default=8, help="timed steps per round of the chain model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    from main import launch_ranks  # benchmarks/throughput/main.py

    os.makedirs(args.out, exist_ok=True)
    job = dict(schedule=args.schedule, m=args.m, steps=args.steps, chain_steps=args.chain_steps, rounds=args.rounds,
               warmup=args.warmup, out=args.out, vocab=256, seq=64, d=128, layers=4, batch=16)
    t0 = time.perf_counter()
    ranks = launch_ranks(__file__, job, 2, prefix="frontends")
    # per step, the slower rank decides; then medians
    hpp = [max(a, b) for a, b in zip(ranks[0]["traced_model"]["hpp_s"], ranks[1]["traced_model"]["hpp_s"])]
    raw = [max(a, b) for a, b in zip(ranks[0]["traced_model"]["raw_s"], ranks[1]["traced_model"]["raw_s"])]
    ratio = statistics.median(r / h for h, r in zip(hpp, raw))
    seq = [max(a, b) for a, b in zip(ranks[0]["chain_model"]["sequential"], ranks[1]["chain_model"]["sequential"])]
    tr = [max(a, b) for a, b in zip(ranks[0]["chain_model"]["traced"], ranks[1]["chain_model"]["traced"])]
    summary = {
        "traced GPT-2: HPPStrategy ÷ raw torch traced pipeline (paired, throughput)": round(ratio, 3),
        "traced GPT-2: HPPStrategy step ms (median)": round(1e3 * statistics.median(hpp), 1),
        "traced GPT-2: raw step ms (median)": round(1e3 * statistics.median(raw), 1),
        "chain MLP: traced ÷ sequential frontend (throughput, ratio of medians)": round(
            statistics.median(seq) / statistics.median(tr), 3
        ),
        "chain MLP: sequential step ms (median)": round(1e3 * statistics.median(seq), 1),
        "chain MLP: traced step ms (median)": round(1e3 * statistics.median(tr), 1),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2))
    for k, v in summary.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
