"""Per-rank peak memory of the 8-rank layouts of a two-stage pipeline under a per-rank cap: the model that fits
only at pp2 × fsdp2 × tp2.

The model: ``--blocks`` (default 4) ``Linear(W, W) + ReLU`` blocks and a ``Linear(W, 10)`` head, built in
``configure_model()`` (the meta device: each rank materializes only its shards), cut into two stages of equal
blocks, Adam (16 bytes a parameter with its gradient), one micro-batch a step (GPipe) and FSDP2's
``reshard_after_forward=True``: the layouts where sharding saves the most (with several micro-batches a sharded
stage holds its whole parameters and gradients while its last backward starts, :mod:`lightning_hpp.planning.memory`).
Tensor parallel splits each stage's blocks in pairs, Megatron's MLP (the first colwise, the second rowwise) through
the LightningModule's ``parallelize_stage`` hook. On 8 ranks:

* ``pp2_dp4``       — ``ShardingOptions()``: 4 whole replicas of each stage;
* ``pp2_fsdp4``     — ``data_parallel="fsdp"``: each stage sharded over its 4 replicas;
* ``pp2_dp2_tp2``   — ``tp_degree=2``: 2 replicas of each stage, split over 2 ranks;
* ``pp2_fsdp2_tp2`` — ``data_parallel="fsdp", tp_degree=2``: split over 2 ranks, each half sharded over 2.

With ``S`` the bytes of one stage's parameters and ``L`` of its largest block, the memory model's training state
per rank (parameters, gradients, Adam's moments, and what FSDP2 gathers while a step runs) is ``4 S`` (dp4),
``S + 2 L`` (fsdp4), ``2 S`` (dp2 × tp2) and ``S + L`` (fsdp2 × tp2): with two blocks a stage, ``4 S``, ``2 S``,
``2 S`` and ``1.5 S``. The cap per rank is ``B + (1.5 + headroom) · S`` (``B``: an idle rank's charge, measured as in
main.py): only pp2 × fsdp2 × tp2 fits. Each rank's peak is compared with ``B + share + activations``, the share
the memory model's (:func:`lightning_hpp.planning.memory.stage_memory_bytes` on the rank's ``1 / tp`` of the split
weights) and the activations counted per tensor as main.py's ``predict`` does.

Usage (root, a cgroup-v1 memory hierarchy; the groups, ranks and their logs as main.py's)::

    python benchmarks/memory/three_d.py --malloc-mmap-threshold 1048576 --out benchmarks/memory/results/three_d
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import main as base  # stdlib only at import: a rank joins its group before torch is imported

RANKS = 8
CONFIGS = {
    "pp2_dp4": {"data_parallel": "ddp"},
    "pp2_fsdp4": {"data_parallel": "fsdp", "reshard_after_forward": True},
    "pp2_dp2_tp2": {"data_parallel": "ddp", "tp_degree": 2},
    "pp2_fsdp2_tp2": {"data_parallel": "fsdp", "reshard_after_forward": True, "tp_degree": 2},
}
LABELS = {
    "pp2_dp4": "pp2 × dp4",
    "pp2_fsdp4": "pp2 × fsdp4, reshard_after_forward",
    "pp2_dp2_tp2": "pp2 × dp2 × tp2",
    "pp2_fsdp2_tp2": "pp2 × fsdp2 × tp2, reshard_after_forward",
}


def predict(cfg: str, rank: int, job: dict[str, Any]) -> dict[str, int]:
    """This rank's predicted peak above its idle charge: the memory model's share of its stage, and activations."""
    from lightning_hpp.planning.memory import gathered_bytes, stage_memory_bytes

    sharding = CONFIGS[cfg]
    w, blocks, batch = job["width"], job["blocks"], job["batch"]
    tp = sharding.get("tp_degree", 1)
    dp = RANKS // 2 // tp
    shard = dp if sharding["data_parallel"] == "fsdp" else 1
    position = rank // (RANKS // 2)
    k = blocks // 2
    block = 4 * (w * w + w)
    head = 4 * (w * base.CLASSES + base.CLASSES) if position == 1 else 0
    held = k * block // tp + head  # every block of a stage split in two by tensor parallel (colwise / rowwise pairs)
    largest = block // tp
    share = stage_memory_bytes(held, 3.0, 0, 0, dp_shard=shard, n_microbatches=1,
                               reshard_after_forward=bool(sharding.get("reshard_after_forward")),
                               largest_unit_bytes=largest)
    a = (batch // dp) * w * 4  # one micro-batch (the replica's batch) of a block's activation
    act = k * a + a + (a if position == 0 else 0) + 2 * a  # as main.predict's count with m = 1
    gathered = gathered_bytes(
        held,
        shard,
        n_microbatches=1,
        reshard_after_forward=bool(sharding.get("reshard_after_forward")),
        largest_unit_bytes=largest,
    )
    return {"share": int(share), "gathered": int(gathered), "activations": act, "total": int(share) + act}


def worker(job: dict[str, Any]) -> None:
    group = base.join_group()  # before torch is imported: everything the rank allocates is charged to it
    rank = int(os.environ["LOCAL_RANK"])
    progress = base.Progress(Path(job["out"]) / f"rank{rank}.json", group)
    import warnings

    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpp import HPPPrecision, HPPStrategy, StagePlan

    torch.set_num_threads(1)
    os.chdir(job["out"])
    progress.mark("imported")
    w, blocks = job["width"], job["blocks"]

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:  # on the meta device: each rank materializes only its shards
            if self.model is None:
                self.model = base.build_mlp(w, blocks)

        def parallelize_stage(self, module, mesh):  # Megatron's MLP: pairs of blocks, colwise then rowwise
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            pairs = [u for u in module.units if isinstance(u, nn.Sequential)]
            for a, b in zip(pairs[0::2], pairs[1::2]):
                parallelize_module(a[0], mesh, ColwiseParallel())
                parallelize_module(b[0], mesh, RowwiseParallel())

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=job["lr"])

    sharding = CONFIGS[job["cfg"]]
    tp = sharding.get("tp_degree", 1)
    warnings.filterwarnings("ignore", message="NaN/Inf in the", category=RuntimeWarning)
    strategy = HPPStrategy(plan=StagePlan.split_at([f"model.{blocks // 2}"]), pp_degree=2, schedule="gpipe",
                           n_microbatches=1, sharding=sharding, timeout=job["timeout"],
                           precision_plugin=HPPPrecision(nonfinite="warn"))

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.step_s: list[float] = []
            self._t = 0.0

        def on_fit_start(self, trainer, pl_module):
            progress.mark("setup done (cut, materialized, optimizer built)")

        def on_train_batch_start(self, *args):
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step_s.append(time.perf_counter() - self._t)
            self.losses.append(float(outputs["loss"]))
            progress.mark(f"step {batch_idx + 1}")

    record = Record()
    g = torch.Generator().manual_seed(0)
    n = job["steps"] * job["batch"]
    data = TensorDataset(torch.randn(n, w, generator=g), torch.randint(0, base.CLASSES, (n,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=RANKS, strategy=strategy, max_steps=job["steps"], callbacks=[record],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=job["out"])
    model = MLP()
    trainer.fit(model, DataLoader(data, batch_size=job["batch"] // (RANKS // 2 // tp), drop_last=True))

    def local(t):  # a DTensor's bytes on this rank
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    params = [p for p in model.parameters() if not p.is_meta]
    opt = trainer.optimizers[0]
    progress.mark("done", losses=record.losses, step_s=record.step_s, param_bytes=sum(local(p) for p in params),
                  optimizer_state_bytes=sum(local(t) for s in opt.state.values() for t in s.values()
                                            if torch.is_tensor(t) and t.dim()),
                  mesh=list(trainer.strategy.mesh.dims.shape))


def run_all(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)} if args.malloc_mmap_threshold else {}
    baseline = base.measure_baseline(out, env)
    B = baseline["baseline_mb"] * base.MB
    S = args.blocks // 2 * 4 * (args.width**2 + args.width)
    limit = int(B + (1.5 + args.headroom) * S)
    print(f"baseline B = {B / base.MB:.0f} MB per process; stage S = {S / base.MB:.0f} MB of parameters; "
          f"memory.limit_in_bytes = B + {1.5 + args.headroom:g}·S = {limit / base.MB:.0f} MB per rank", flush=True)
    rows = []
    for cfg in args.configs:
        job = {"cfg": cfg, "width": args.width, "blocks": args.blocks, "batch": args.batch, "steps": args.steps,
               "lr": args.lr, "timeout": args.timeout, "grace": args.grace, "run_timeout": args.run_timeout,
               "ranks": RANKS, "out": str(out / "logs" / cfg), "env": env}
        t0 = time.time()
        res = base.launch(job, f"3d_{cfg}", limit, script=Path(__file__).resolve())
        wall = time.time() - t0
        ranks = []
        for r, (e, s, outcome) in enumerate(
            zip(res["exits"], res["groups"], base.classify(res["exits"], res["groups"]))
        ):
            rec_path = Path(job["out"]) / f"rank{r}.json"
            rec = json.loads(rec_path.read_text()) if rec_path.exists() else {"phases": []}
            pred = predict(cfg, r, job)
            ranks.append(
                {
                    "rank": r,
                    "outcome": outcome,
                    **e,
                    **s,
                    "peak_mb": s["max_usage"] / base.MB,
                    "predicted": pred,
                    "predicted_mb": (B + pred["total"]) / base.MB,
                    "ratio": s["max_usage"] / (B + pred["total"]),
                    "above_baseline_ratio": (s["max_usage"] - B) / pred["total"],
                    "last_phase": rec["phases"][-1]["phase"] if rec["phases"] else "(before joining its group)",
                    "record": rec,
                }
            )
        rows.append({"cfg": cfg, "label": LABELS[cfg], "wall_s": round(wall, 1), "ranks": ranks})
        print(f"{LABELS[cfg]}: " + ", ".join(f"r{x['rank']} {x['outcome']} {x['peak_mb']:.0f} MB ({x['ratio']:.2f})"
                                              for x in ranks) + f"  [{wall:.0f} s]", flush=True)
    return {"baseline": baseline, "B_mb": B / base.MB, "S_mb": S / base.MB, "limit_mb": limit / base.MB, "runs": rows}


def table(res: dict[str, Any]) -> str:
    short = {"finished": "ok", "OOM-killed": "**OOM**", "failed (peer OOM-killed)": "peer†",
             "stopped (peer OOM-killed)": "stop†", "stopped (timeout)": "timeout"}
    head = ("| layout (8 ranks) | outcome per rank | peak MB per rank | B + predicted MB | peak ÷ (B + predicted) | "
            "(peak − B) ÷ predicted | killed during | s |")
    lines = [head, "|---|---|---|---|---|---|---|---:|"]
    for row in res["runs"]:
        rk = row["ranks"]
        killed = sorted({x["last_phase"] for x in rk if x["outcome"] == "OOM-killed"})

        def each(key: str, fmt: str, ranks: list = rk) -> str:
            return " / ".join(format(x[key], fmt) for x in ranks)

        lines.append(f"| {row['label']} | {' / '.join(short.get(x['outcome'], x['outcome']) for x in rk)} | "
                     f"{each('peak_mb', '.0f')} | {each('predicted_mb', '.0f')} | {each('ratio', '.2f')} | "
                     f"{each('above_baseline_ratio', '.2f')} | {', '.join(killed) or '—'} | {row['wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=4096, help="W of the Linear(W, W) blocks")
    p.add_argument(
        "--blocks", type=int, default=4, help="blocks (an even number per stage: tensor parallel pairs them)"
    )
    p.add_argument("--headroom", type=float, default=0.25, help="the cap above the baseline is (1.5 + headroom)·S")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=180)
    p.add_argument("--grace", type=float, default=30)
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES")
    p.add_argument("--out", default=str(HERE / "results" / "three_d"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.blocks % 4:
        raise SystemExit(f"--blocks {args.blocks}: two stages of pairs of blocks need a multiple of 4.")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = base.environment()
    started = time.time()
    res = run_all(args, out)
    env.update(load_average_end=os.getloadavg(), wall_s=round(time.time() - started, 1),
               command=" ".join(["python", "benchmarks/memory/three_d.py", *sys.argv[1:]]))
    res["environment"], res["args"] = env, {k: v for k, v in vars(args).items() if k != "worker"}
    text = table(res)
    print(f"\n{text}")
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(
        f"Environment: {json.dumps(env)}\n\nB = {res['B_mb']:.0f} MB, S = {res['S_mb']:.0f} MB, "
        f"cap {res['limit_mb']:.0f} MB per rank\n\n{text}\n"
    )
    print(f"\nwrote {out / 'results.json'} and results.md in {env['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
