"""A mixed cluster emulated on 2 CPU cores: plan="auto" vs a uniform cut vs a hand-balanced cut vs DDP.

Rank 0 is pinned to core 0 and runs at full speed (kind ``fast``). Rank 1 is pinned to core 1 and
held to half of it by a cgroup-v1 CPU quota (kind ``slow``): a child group of
``/sys/fs/cgroup/cpu`` with ``cpu.cfs_period_us=100000`` and ``cpu.cfs_quota_us=50000``. Each rank
pins itself and (rank 1) writes its own pid into the group's ``cgroup.procs`` at the top of its
worker, before torch is imported, so every thread it starts (torch, gloo) inherits both. Where the
cgroup cannot be created (not root, cgroup v2 only, read-only mount), rank 1 shares core 1 with a
busy-loop process instead, which the kernel's fair scheduler also halves it with; the output says
which one ran. The group (or the busy loop) is removed afterwards, also when something fails.

The kinds reach HPPStrategy through the override, ``PlacementOptions(device_map="0:fast,1:slow")`` (or, with
``--kind-source env``, ``HPP_DEVICE_KIND`` set per rank). One invocation runs, on the same model
(a 12-layer 1024-wide MLP plus a 10-class head), the same data and the same global batch, in
``--rounds`` interleaved rounds:

* ``auto``     — ``HPPStrategy(plan="auto")``: each kind profiles the units itself (the slow rank
  on its throttled core), the exact partitioner picks the cut; 1F1B, 12 micro-batches;
* ``auto_mean`` — the same partitioner fed through ``PlacementOptions(profile=)`` with a profile the benchmark
  measured on both ranks beforehand, timing each unit as the mean over a 0.4 s window instead of
  the median of 5 short repetitions (see :func:`mean_profile` for why that matters under a quota);
* ``uniform``  — a 6:6 cut (the head joins the last stage), same schedule;
* ``hand 8:4`` — the hand-balanced 8:4 cut, same schedule;
* ``ddp``      — Lightning's DDPStrategy over the same two ranks (half the batch each).

Samples/s is the global batch over the median step time after warm-up (the slowest rank's).
Pipeline runs record telemetry (``HPPStrategy(telemetry=...)``) on every other timed step;
throughput comes from the other steps, the auto plan's measured per-stage forward+backward time
from the recorded ones, next to the partitioner's prediction (``plan.meta["predicted"]``).

Usage::

    python benchmarks/placement/cgroup_bench.py            # ~2 minutes on 2 cores
    python benchmarks/placement/cgroup_bench.py --rounds 3 --steps 20 --out runs/cgroup_bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
KINDS = ("fast", "slow")
CONFIGS = ("auto", "auto_mean", "uniform", "hand", "ddp")
LABELS = {"auto": 'plan="auto"', "auto_mean": 'plan="auto", PlacementOptions(profile=<mean-timed profile>)', "uniform": "uniform cut 6:6",
          "hand": "hand-balanced 8:4", "ddp": "DDP"}
MEAN_WINDOW_S = 0.4
"""Each unit's forward+backward is repeated for at least this long (4 CFS periods) in the mean-timed profile."""


def _throughput_helpers() -> Any:
    """benchmarks/throughput/main.py as a module (its timing, loader, trainer and launch helpers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("throughput_main", ROOT / "benchmarks" / "throughput" / "main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # puts benchmarks/throughput on sys.path (its models module)
    return mod


# ============================================================================================ throttling
class SlowCore:
    """Halves one core for the slow rank: a cgroup-v1 CPU quota, or core sharing as a fallback.

    Args:
        core: The slow rank's core.
        quota: Share of the core the slow rank gets (0.5 = half).
    """

    def __init__(self, core: int, quota: float) -> None:
        self.core = core
        self.quota = quota
        self.group: Path | None = None
        self.spinner: subprocess.Popen | None = None
        self.method = ""
        self.stat: dict[str, int] = {}

    def __enter__(self) -> SlowCore:
        group = CGROUP_ROOT / f"hpp_bench_{os.getpid()}"
        try:
            group.mkdir()
            self.group = group
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * self.quota)))
            self.method = f"cgroup-v1 cpu quota {group} (cfs_quota_us={int(PERIOD_US * self.quota)}, cfs_period_us={PERIOD_US})"
        except OSError as err:
            self._remove_group()
            # The fair scheduler splits a core between two busy processes: a busy loop on the slow
            # rank's core leaves it about half of the core.
            code = f"import os\nos.sched_setaffinity(0, {{{self.core}}})\nwhile True:\n    pass\n"
            self.spinner = subprocess.Popen([sys.executable, "-c", code])
            self.method = f"core sharing with a busy loop on core {self.core} (cgroup not writable: {err})"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.spinner is not None:
            self.spinner.kill()
            self.spinner.wait()
            self.spinner = None
        self._remove_group()

    @property
    def procs_file(self) -> str | None:
        """The ``cgroup.procs`` the slow rank writes its pid into (``None`` for core sharing)."""
        return str(self.group / "cgroup.procs") if self.group is not None else None

    def _remove_group(self) -> None:
        if self.group is None:
            return
        try:
            self.stat = {k: int(v) for k, v in (ln.split() for ln in (self.group / "cpu.stat").read_text().splitlines())}
        except (OSError, ValueError):
            pass
        try:
            # a group can only be removed once empty: move anything left behind back to the root
            for pid in (self.group / "cgroup.procs").read_text().split():
                try:
                    (CGROUP_ROOT / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            self.group.rmdir()
        except OSError as err:
            print(f"warning: could not remove {self.group}: {err}", file=sys.stderr)
        self.group = None


def pin_and_throttle(rank: int, procs_file: str | None) -> dict[str, Any]:
    """Pin this process to core ``rank``; rank 1 joins the quota group. Run before torch is imported."""
    os.sched_setaffinity(0, {rank})
    if rank == 1 and procs_file:
        with open(procs_file, "w") as f:
            f.write(str(os.getpid()))
    cgroup = next((ln.strip() for ln in open("/proc/self/cgroup") if ln.split(":")[1] in ("cpu", "cpu,cpuacct")), "")
    return {"affinity": sorted(os.sched_getaffinity(0)), "cgroup": cgroup}


def calibrate(seconds: float = 1.5) -> float:
    """Matmul GFLOP/s of this process (1 thread), measured while the other rank does the same."""
    import torch

    a = torch.randn(512, 512)
    b = torch.randn(512, 512)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return n * 2 * 512**3 / (time.perf_counter() - t0) / 1e9


# ============================================================================================ worker
def worker(job: dict[str, Any]) -> None:
    rank = int(os.environ["RANK"])
    placed = pin_and_throttle(rank, job["procs_file"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gflops = calibrate()
    os.chdir(job["out"])  # stage_plan.json and fingerprints.json land next to the results
    tp = _throughput_helpers()
    from models import Size

    dist.init_process_group("gloo")
    import lightning  # noqa: F401

    size = Size(width=job["width"], blocks=job["layers"], batch=job["batch"])
    if "auto_mean" in job["configs"]:
        job = {**job, "profile_path": mean_profile(job, size, rank)}
    results = []
    for rnd in range(job["rounds"]):
        for name in job["configs"]:
            t0 = time.perf_counter()
            res = run_ddp(tp, job, size) if name == "ddp" else run_pipeline(tp, job, size, name)
            res.update(config=name, round=rnd, rank=rank, wall_s=time.perf_counter() - t0)
            results.append(res)
            dist.barrier()
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps({"placed": placed, "gflops": gflops, "results": results}))
    dist.destroy_process_group()


def mean_profile(job: dict[str, Any], size: Any, rank: int) -> str:
    """A cost profile of every unit on this rank's kind, timed as the mean over a window (collective).

    ``plan="auto"`` measures with :func:`lightning_hpp.planning.profile.profile_units`, which keeps the median
    of 5 short repetitions. Under a CFS quota a process runs at full speed for 50 ms and then waits
    50 ms, so most short repetitions never meet a wait and the median misses the throttling. Here
    each unit's forward and backward are repeated back to back for at least ``MEAN_WINDOW_S`` and
    the total is divided by the count. Memory figures come from ``profile_units`` unchanged.
    Every rank measures its own kind at the same time; rank 0 writes the merged profile.
    """
    import torch
    import torch.distributed as dist
    from models import build, dataset

    from lightning_hpp.model.units import find_units
    from lightning_hpp.planning.profile import CostProfile, profile_units

    units = find_units(build("mlp", size))
    x = dataset("mlp", size, 1).tensors[0][: size.batch // job["m"]]
    prof = profile_units(units, x, KINDS[rank])
    args = x
    for cost, (_, unit) in zip(prof.entries[0].units, units):
        inp = args.detach().requires_grad_(True)
        params = [p for p in unit.parameters() if p.requires_grad]
        n, fwd, bwd = 0, 0.0, 0.0
        while fwd + bwd < MEAN_WINDOW_S:
            t0 = time.perf_counter()
            out = unit(inp)
            t1 = time.perf_counter()
            torch.autograd.grad(out, [inp, *params], torch.ones_like(out))
            fwd, bwd, n = fwd + t1 - t0, bwd + time.perf_counter() - t1, n + 1
        cost.fwd_ms, cost.bwd_ms = 1e3 * fwd / n, 1e3 * bwd / n
        args = out.detach()
    parts: list[Any] = [None, None]
    dist.all_gather_object(parts, prof.to_dict())
    path = str(Path(job["out"]) / "profile_mean.json")
    if rank == 0:
        CostProfile.from_dict(parts[0]).merge(CostProfile.from_dict(parts[1])).save(path)
    dist.barrier()
    return path


def _timer(warmup: int) -> Any:
    """A callback timing each step (batch start to batch end).

    It finds the ``PipelineTelemetry`` that ``HPPStrategy(telemetry=...)`` installed and lets it
    record every other timed step only.
    """
    from lightning.pytorch import Callback

    from lightning_hpp.telemetry.callback import PipelineTelemetry

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.telemetry: PipelineTelemetry | None = None
            self._t = 0.0

        def on_train_start(self, trainer, pl_module):
            self.telemetry = next((cb for cb in trainer.callbacks if isinstance(cb, PipelineTelemetry)), None)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.telemetry is not None and self.telemetry.recorder is not None:
                self.telemetry.recorder.enabled = batch_idx >= warmup and (batch_idx - warmup) % 2 == 1
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._t)

    return Timer()


def cuts(name: str, layers: int) -> list[list[str]]:
    """The unit lists of the fixed cuts: ``uniform`` (half the blocks each) or ``hand`` (2/3 : 1/3)."""
    first = layers // 2 if name == "uniform" else round(layers * 2 / 3)
    return [[f"blocks.{i}" for i in range(first)], [f"blocks.{i}" for i in range(first, layers)] + ["head"]]


def run_pipeline(tp: Any, job: dict[str, Any], size: Any, name: str) -> dict[str, Any]:
    from models import build

    from lightning_hpp import HPPStrategy, StagePlan, StageSpec
    from lightning_hpp.options import PlacementOptions, TelemetryOptions

    plan = "auto" if name.startswith("auto") else StagePlan([StageSpec(modules=u) for u in cuts(name, job["layers"])])
    placement = {} if job["kind_source"] == "env" else {"device_map": ",".join(f"{r}:{k}" for r, k in enumerate(KINDS))}
    if name == "auto_mean":
        placement["profile"] = job["profile_path"]
    timer = _timer(job["warmup"])
    strategy = HPPStrategy(plan=plan, schedule="1f1b", n_microbatches=job["m"], telemetry=TelemetryOptions(every_n_steps=10**9),
                           placement=PlacementOptions(**placement), timeout=300, **tp._hpp_options())
    trainer = tp._trainer(job, strategy, [timer])
    trainer.fit(build("mlp", size), tp._loader(job, size, size.batch))
    telemetry = timer.telemetry
    out = {**tp._timing(timer.times, job["warmup"], True), **tp._history(telemetry.history if telemetry else [])}
    out["cuts"] = [len(s.modules) for s in strategy.plan.stages]
    out["units"] = [list(s.modules) for s in strategy.plan.stages]
    out["devices"] = [s.device for s in strategy.plan.stages]
    out["predicted"] = strategy.plan.meta.get("predicted")
    return out


def run_ddp(tp: Any, job: dict[str, Any], size: Any) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy
    from models import build

    timer = _timer(job["warmup"])
    trainer = tp._trainer(job, DDPStrategy(process_group_backend="gloo"), [timer])
    trainer.fit(build("mlp", size), tp._loader(job, size, size.batch // job["devices"]))
    return tp._timing(timer.times, job["warmup"], False)


# ============================================================================================ launch
def launch(job: dict[str, Any], procs_file: str | None) -> list[dict[str, Any]]:
    tp = _throughput_helpers()
    os.environ.pop("HPP_DEVICE_KIND", None)  # the kinds come from device_map or, per rank, from here
    job = {**job, "procs_file": procs_file}
    rank_env = (lambda r: {"HPP_DEVICE_KIND": KINDS[r]}) if job["kind_source"] == "env" else None
    return tp.launch_ranks(__file__, job, 2, rank_env=rank_env)


# ============================================================================================ report
def summarize(per_rank: list[dict[str, Any]], batch: int, m: int) -> dict[str, Any]:
    """Rows per configuration (rounds pooled) and the auto plan's predicted vs measured stage times."""
    rows: dict[str, dict[str, Any]] = {}
    for name in CONFIGS:
        runs = [[r for r in rank["results"] if r["config"] == name] for rank in per_rank]
        if not runs[0]:
            continue
        step = max(statistics.median([t for run in rank_runs for t in run["plain"]]) for rank_runs in runs)
        row: dict[str, Any] = {"label": LABELS[name], "step_ms": 1e3 * step, "samples_s": batch / step,
                               "rounds": len(runs[0])}
        first = runs[0][0]
        if "cuts" in first:
            row["cuts"] = [[sum(u.startswith("blocks.") for u in stage) for stage in run["units"]] for run in runs[0]]
            row["units"] = first["units"]
            steps = [st for run in runs[0] for st in run.get("steps", [])]
            if steps:
                row["bubble"] = statistics.median(st["bubble"] for st in steps)
                row["bubble_theory"] = steps[0]["bubble_theory"]
                steps = runs[0][-1].get("steps") or steps  # stage times: the last round, whose prediction is shown
                stages = sorted({int(k) for st in steps for k in st["stages"]})
                row["measured_stage_ms"] = [
                    statistics.median((st["stages"][str(k)]["fwd_ms"] + st["stages"][str(k)]["bwd_ms"]) / m for st in steps)
                    for k in stages
                ]
                row["measured_comm_ms"] = [statistics.median(st["stages"][str(k)]["comm_ms"] / m for st in steps) for k in stages]
                row["measured_sched_ms"] = statistics.median(st["step_ms"] for st in steps)
            row["predicted"] = [run["predicted"] for run in runs[0]]
        rows[name] = row
    return rows


def report(rows: dict[str, dict[str, Any]], env: dict[str, Any]) -> str:
    ddp = rows["ddp"]["samples_s"] if "ddp" in rows else None
    uni = rows["uniform"]["samples_s"] if "uniform" in rows else None
    lines = ["| configuration | cut (blocks per stage) | step ms (median) | samples/s | × DDP | × uniform cut |",
             "|---|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        cut = ""
        if "cuts" in r:
            seen = sorted({":".join(map(str, cs)) for cs in r["cuts"]})
            cut = " / ".join(seen) + (" (chosen)" if name == "auto" else "")
        vs_ddp = f"{r['samples_s'] / ddp:.2f}" if ddp else ""
        vs_uni = f"{r['samples_s'] / uni:.2f}" if uni else ""
        lines.append(f"| {r['label']} | {cut} | {r['step_ms']:.0f} | {r['samples_s']:.1f} | {vs_ddp} | {vs_uni} |")
    for name in ("auto", "auto_mean"):
        auto = rows.get(name)
        if not (auto and auto.get("predicted") and auto.get("measured_stage_ms")):
            continue
        pred = auto["predicted"][-1]
        lines += ["", f"{auto['label']}, last round: predicted (profile) vs measured (telemetry, median of recorded "
                      f"steps), per micro-batch", "",
                  "| stage | device kind | units | predicted compute ms | measured fwd+bwd ms | measured ÷ predicted | "
                  "predicted comm ms | measured comm ms |",
                  "|---:|---|---|---:|---:|---:|---:|---:|"]
        measured = zip(pred["compute_ms"], pred["comm_ms"], auto["measured_stage_ms"], auto["measured_comm_ms"])
        for k, (p, c, meas, mc) in enumerate(measured):
            units = auto["units"][k]
            text = f"{units[0]} .. {units[-1]} ({len(units)})"
            lines.append(f"| {k} | {KINDS[k]} | {text} | {p:.2f} | {meas:.2f} | {meas / p:.2f} | {c:.3f} | {mc:.3f} |")
        lines += ["", f"predicted schedule step {pred['step_ms']:.0f} ms (bubble {pred['bubble_fraction']:.3f}); measured in-schedule step "
                      f"{auto['measured_sched_ms']:.0f} ms (bubble {auto['bubble']:.3f}, theory {auto['bubble_theory']:.3f})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=192, help="global batch (DDP: half per rank)")
    p.add_argument("--m", type=int, default=12, help="micro-batches (1F1B)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="timed steps per configuration and round (half recorded)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all configurations")
    p.add_argument("--quota", type=float, default=0.5, help="share of core 1 the slow rank gets")
    p.add_argument("--kind-source", choices=["device_map", "env"], default="device_map")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--out", default=str(ROOT / "runs" / "cgroup_bench"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("This benchmark pins its two ranks to cores 0 and 1; it needs a machine with 2 or more cores.")
    if args.batch % args.m or args.batch % 2:
        raise SystemExit(f"--batch {args.batch} must be divisible by --m {args.m} and by 2 (DDP's two ranks).")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    job = {"layers": args.layers, "width": args.width, "batch": args.batch, "m": args.m, "warmup": args.warmup,
           "steps": args.steps, "rounds": args.rounds, "kind_source": args.kind_source, "configs": args.configs,
           "out": str(out), "model": "mlp", "accelerator": "cpu", "devices": 2, "threads": 1}
    tp = _throughput_helpers()
    env = tp.environment(job)
    started = time.time()
    with SlowCore(core=1, quota=args.quota) as slow:
        print(f"slow rank: {slow.method}", flush=True)
        per_rank = launch(job, slow.procs_file)
    env.update(load_average_end=os.getloadavg(), wall_s=round(time.time() - started, 1), throttle=slow.method,
               cgroup_cpu_stat=slow.stat,
               placed=[r["placed"] for r in per_rank], calibration_gflops=[round(r["gflops"], 2) for r in per_rank],
               command=" ".join(["python", *sys.argv]))
    rows = summarize(per_rank, args.batch, args.m)
    text = report(rows, env)
    g = env["calibration_gflops"]
    print(f"\nranks: {env['placed']}\nmatmul GFLOP/s per rank (1 thread, both at once): {g} -> slow/fast {g[1] / g[0]:.2f}")
    if slow.stat:
        print(f"quota group cpu.stat: {slow.stat}")
    print(text)
    for name in ("auto", "auto_mean"):
        if name in rows:
            print(f"\n{rows[name]['label']} chose blocks per stage (per round): {rows[name]['cuts']}")
    (out / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / "results.md").write_text(f"Environment: {json.dumps(env)}\n\n{text}\n")
    print(f"\nwrote {out / 'results.md'} and {out / 'results.json'} in {env['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
