"""The README's sweep table: ASHA vs no pruning on the same 8 configurations, and two drivers vs one.

    python benchmarks/sweeps/measure.py --out /tmp/measure [--trials 8]

Runs, one after the other, ``lightning-hpp-train -m hparams_search=asha experiment=mlp_sweep`` with

* one driver (ASHA, SuccessiveHalvingPruner, divisor 4);
* one driver, ``hydra.sweeper.pruner=null`` (no pruning);
* two drivers started together on one study (the same command twice, one SQLite study);

and prints a Markdown table: wall time, completed / pruned trials, optimizer steps trained, best value.
Every trial draws from ``seed + trial number`` and the 8 trials are all TPE start-up (random) trials,
so the three sweeps try the same 8 configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _sweep(out: Path, name: str, trials: int, drivers: int, *extra: str) -> dict:
    sweep = out / name
    cmd = [sys.executable, "-m", "lightning_hpp.hydra.train", "-m", "hparams_search=asha", "experiment=mlp_sweep",
           f"hydra.sweeper.n_trials={trials}", f"hydra.sweep.dir={sweep}", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    start = time.monotonic()
    procs = []
    for i in range(drivers):
        with open(out / f"{name}.driver{i}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    wall = time.monotonic() - start
    records = [json.loads(p.read_text()) for p in sweep.glob("*/trial.json")]
    done = [r for r in records if r["status"] == "ok"]
    best = min(done, key=lambda r: r["value"]) if done else None
    return {
        "name": name, "codes": codes, "wall_s": round(wall, 1), "load": round(load, 1),
        "completed": len(done), "pruned": sum(r["status"] == "pruned" for r in records),
        "steps": sum(int(r["global_step"] or 0) for r in records),
        "best": None if best is None else (round(best["value"], 5), best["trial_number"]),
        "configurations": sorted(tuple(sorted(r["params"].items())) for r in records),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [
        _sweep(args.out, "asha", args.trials, 1),
        _sweep(args.out, "none", args.trials, 1, "hydra.sweeper.pruner=null",
               "hydra.sweeper.study_name=mlp_sweep_nopruning"),
        _sweep(args.out, "asha2", args.trials, 2),
    ]  # fmt: skip
    (args.out / "measure.json").write_text(json.dumps(rows, indent=2))
    same = all(r["configurations"] == rows[0]["configurations"] for r in rows)
    print(f"same {args.trials} configurations in every sweep: {same}")
    print(
        "| sweep | drivers | wall time | completed / pruned | optimizer steps trained | best val_loss (trial) | load "
        "average at start |"
    )
    print("|---|---|---|---|---|---|---|")
    labels = {"asha": ("ASHA", 1), "none": ("no pruning", 1), "asha2": ("ASHA", 2)}
    for r in rows:
        label, drivers = labels[r["name"]]
        best = "-" if r["best"] is None else f"{r['best'][0]} (trial {r['best'][1]})"
        print(
            f"| {label} | {drivers} | {r['wall_s']} s | {r['completed']} / {r['pruned']} | {r['steps']} | {best} | "
            f"{r['load']} |"
        )
    if any(c != 0 for r in rows for c in r["codes"]):
        sys.exit(f"a driver failed: {[(r['name'], r['codes']) for r in rows]}")


if __name__ == "__main__":
    main()
