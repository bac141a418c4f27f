"""A rank that gets slow mid-run: how fast the straggler watch names it, and what re-planning gives back.

Two ranks start on two equal cores (rank r pinned to core r, one torch thread each) with
``HPPStrategy(plan="auto", placement=PlacementOptions(watch="replan"), checkpoint=CheckpointOptions(dir=...,
resume="auto"))``, the 12-block 1024-wide MLP of ``benchmarks/throughput`` (global batch 192). At global
step ``--slow-at`` rank 1 writes its pid into a cgroup-v1 CPU quota group at half of a core (the group of
``cgroup_bench.SlowCore``: ``cpu.cfs_quota_us=50000`` of ``cpu.cfs_period_us=100000``; core sharing with a
busy loop where no group can be made). Three jobs, one after another:

1. ``slowdown``: the run above. The watch finds the slow rank, every rank writes ``step-<N>`` with the
   measured speeds and exits with code 76. Reported: steps from the quota drop to the finding,
   samples/s before the drop and between the drop and the finding.
2. ``replanned``: the same command again (rank 1 in the quota group from its start): ``plan="auto"``
   plans with the recorded speeds and resumes from ``step-<N>``. Reported: samples/s after re-planning.
3. ``scratch``: ``plan="auto"`` from scratch on the slowed configuration (rank 1 in the quota group from
   its start, device kinds ``0:fast,1:slow``, so each kind profiles itself), for the same steps.

Samples/s is the global batch over the median step time (batch start to batch end on rank 0, the
timed steps after ``--warmup`` steps of each phase). The goals: the finding within 10 steps of the
drop, re-planned ÷ from-scratch ≥ 0.9, every step trained once (the resumed run starts at the
checkpoint's step).

Usage::

    python benchmarks/placement/straggler_bench.py                      # ~5 min here
    python benchmarks/placement/straggler_bench.py --slow-at 30 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from cgroup_bench import SlowCore, _throughput_helpers  # noqa: E402


def join_group(procs_file: str | None) -> None:
    """Move this whole process (every thread) into the quota group (core sharing: nothing to do)."""
    if procs_file:
        with open(procs_file, "w") as f:
            f.write(str(os.getpid()))


# ============================================================================================ worker
def worker(job: dict[str, Any]) -> None:
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank})
    if rank == 1 and job["throttled_from_start"]:
        join_group(job["procs_file"])
    import lightning as L
    import torch
    from lightning.pytorch import Callback

    torch.set_num_threads(1)
    tp = _throughput_helpers()
    from models import Size, build, dataset
    from torch.utils.data import DataLoader

    from lightning_hpp import HPPStrategy
    from lightning_hpp.options import CheckpointOptions, PlacementOptions
    from lightning_hpp.telemetry.watch import StragglerWatch

    class Steps(Callback):
        """Times every batch; rank 1 joins the quota group at the start of step ``slow_at``."""

        def __init__(self) -> None:
            self.times: dict[int, float] = {}
            self.slowed_at: int | None = None
            self._t = 0.0

        def on_train_batch_start(self, trainer, *args):
            step = trainer.global_step
            if job["slow_at"] is not None and step == job["slow_at"] and self.slowed_at is None:
                self.slowed_at = step
                if rank == 1:
                    join_group(job["procs_file"])
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            self.times[trainer.global_step - 1] = time.perf_counter() - self._t

    size = Size(width=job["width"], blocks=job["layers"], batch=job["batch"])
    steps = Steps()
    placement = PlacementOptions(watch=job["watch"], device_map=job["device_map"])
    strategy = HPPStrategy(plan="auto", placement=placement, timeout=300, **tp._hpp_options(),
                           checkpoint=CheckpointOptions(dir=job["ckpt"], resume="auto"))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=job["max_steps"], callbacks=[steps],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=job["out"])
    loader = DataLoader(dataset("mlp", size, job["max_steps"]), batch_size=size.batch, drop_last=True)
    code = 0
    try:
        trainer.fit(build("mlp", size), loader)
    except SystemExit as exc:
        code = int(exc.code or 0)
    watch = next((cb for cb in trainer.callbacks if isinstance(cb, StragglerWatch)), None)
    p = strategy.pipeline
    result = {
        "times": steps.times, "exit": code, "global_step": trainer.global_step, "slowed_at": steps.slowed_at,
        "alerts": watch.alerts if watch is not None else [],
        "findings": [vars(f) for f in watch.findings] if watch is not None else [],
        "units": [list(s.modules) for s in p.plan.stages], "grid": p.mesh.grid,
        "chosen": {"pp": p.mesh.pp, "dp": p.mesh.dp, "m": p.n_microbatches, "schedule": p.schedule},
        "rank_speeds": p.plan.meta.get("rank_speeds"), "resumed_from": strategy.resumed_from,
    }
    Path(job["out"], f"{job['phase']}_rank{rank}.json").write_text(json.dumps(result))
    if code:
        raise SystemExit(code)


# ============================================================================================ report
def samples_per_s(times: dict[str, float], lo: int, hi: int, batch: int) -> tuple[float, int]:
    """Global batch over the median step time of steps ``lo <= step < hi``, and how many steps."""
    picked = [t for s, t in times.items() if lo <= int(s) < hi]
    return (batch / statistics.median(picked) if picked else float("nan")), len(picked)


def _plan(r: dict[str, Any]) -> str:
    c = r["chosen"]
    cut = ":".join(str(sum(u.startswith("blocks.") for u in st)) for st in r["units"])
    return f"pp={c['pp']}×dp={c['dp']}, {c['schedule']} m={c['m']}" + (f", blocks {cut}" if c["pp"] > 1 else "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=192)
    p.add_argument("--slow-at", type=int, default=25, help="global step at which rank 1's quota drops")
    p.add_argument("--steps", type=int, default=25, help="steps of the re-planned and the from-scratch runs")
    p.add_argument("--warmup", type=int, default=5, help="steps of each phase left out of the throughput")
    p.add_argument("--quota", type=float, default=0.5)
    p.add_argument("--out", default=None, help="default runs/straggler_bench")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("This benchmark pins its two ranks to cores 0 and 1; it needs 2 or more cores.")
    out = Path(args.out or ROOT / "runs" / "straggler_bench").resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tp = _throughput_helpers()
    base = {"layers": args.layers, "width": args.width, "batch": args.batch, "out": str(out), "threads": 1}
    env = tp.environment(base)
    started = time.time()
    first_max = args.slow_at + 40  # the watch ends the run long before
    with SlowCore(core=1, quota=args.quota) as slow:
        print(f"slow rank: {slow.method}", flush=True)
        common = {**base, "procs_file": slow.procs_file, "ckpt": str(out / "ckpt"), "device_map": None}
        jobs = {
            "slowdown": {
                **common,
                "phase": "slowdown",
                "watch": "replan",
                "slow_at": args.slow_at,
                "throttled_from_start": False,
                "max_steps": first_max,
            },
            "replanned": {
                **common,
                "phase": "replanned",
                "watch": "warn",
                "slow_at": None,
                "throttled_from_start": True,
            },
            "scratch": {
                **common,
                "phase": "scratch",
                "watch": "warn",
                "slow_at": None,
                "throttled_from_start": True,
                "ckpt": str(out / "ckpt_scratch"),
                "device_map": "0:fast,1:slow",
                "max_steps": args.steps,
            },
        }
        runs: dict[str, list[dict[str, Any]]] = {}
        notes: list[str] = []
        for name, job in jobs.items():
            if name == "replanned":
                stopped = runs["slowdown"][0]["global_step"]
                job["max_steps"] = stopped + args.steps
            print(f"{name} ...", flush=True)
            try:
                runs[name] = tp.launch_ranks(__file__, job, 2, prefix=f"{name}_rank")
            except SystemExit as exc:  # the watch's exit code (76) of the first run; any other failure is said
                files = [out / f"{name}_rank{r}.json" for r in (0, 1)]
                if not all(f.exists() for f in files):
                    raise
                if "[76, 76]" not in str(exc):
                    notes.append(f"{name}: {str(exc).splitlines()[0]} (after writing its results)")
                runs[name] = [json.loads(f.read_text()) for f in files]
    b = args.batch
    s0 = runs["slowdown"][0]
    found = next((a[0] for a in s0["alerts"] if a[1] == "compute"), None)
    finding = next((f for r in runs["slowdown"] for f in r["findings"]), None)
    before, n_before = samples_per_s(s0["times"], args.warmup, args.slow_at, b)
    after, n_after = samples_per_s(s0["times"], args.slow_at, (found if found is not None else 10**9) + 1, b)
    r0 = runs["replanned"][0]
    start = int(s0["global_step"])
    if s0["exit"] != 76:
        notes.append(f"the watch found nothing in the slowdown run (exit {s0['exit']}): the re-planned run continued "
                     f"the same plan from the newest checkpoint")
    replanned, n_re = samples_per_s(r0["times"], start + args.warmup, 10**9, b) if r0["times"] else (float("nan"), 0)
    scratch, n_sc = samples_per_s(runs["scratch"][0]["times"], args.warmup, 10**9, b)
    resumed_steps = sorted(int(s) for s in r0["times"])
    lost = (resumed_steps[0] != start) if resumed_steps else True
    env.update(load_average_end=os.getloadavg(), wall_s=round(time.time() - started, 1), throttle=slow.method,
               cgroup_cpu_stat=slow.stat, command=" ".join(["python", *sys.argv]), notes=notes)
    lines = [
        f"quota drop at step {args.slow_at}: the watch's finding at step {found} "
        f"({'n/a' if found is None else found - args.slow_at} steps later; goal <= 10)",
        f"finding: {finding}",
        f"checkpoint: {r0['resumed_from']} (first resumed step {resumed_steps[0] if resumed_steps else None}; "
        f"{'steps lost or repeated' if lost else 'no step lost or repeated'})",
        "",
        "| phase | plan | samples/s (median step) | steps timed |",
        "|---|---|---:|---:|",
        f"| before the slowdown | {_plan(s0)} | {before:.1f} | {n_before} |",
        f"| after the slowdown, until the finding | {_plan(s0)} | {after:.1f} | {n_after} |",
        f"| after re-planning (recorded speeds {r0['rank_speeds']}) | {_plan(r0)} | {replanned:.1f} | {n_re} |",
        f"| plan='auto' from scratch on the slowed ranks (kinds fast/slow) | {_plan(runs['scratch'][0])} | "
        f"{scratch:.1f} | {n_sc} |",
        "",
        f"re-planned ÷ from scratch: {replanned / scratch:.2f} (goal >= 0.9); re-planned ÷ before: "
        f"{replanned / before:.2f}; "
        f"slowed ÷ before: {after / before:.2f}",
    ]
    text = "\n".join(lines)
    print(f"\nload average {env['load_average']} -> {env['load_average_end']}\n{text}")
    (out / "results.json").write_text(json.dumps({"environment": env, "runs": runs}, indent=1))
    (out / "results.md").write_text(f"Environment: {json.dumps(env)}\n\n{text}\n")
    print(f"\nwrote {out / 'results.md'} in {env['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
