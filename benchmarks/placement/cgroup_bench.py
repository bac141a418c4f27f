"""A mixed cluster emulated on 2 CPU cores: plan="auto" vs uniform and hand-balanced cuts vs DDP.

Rank 0 is pinned to core 0 and runs at full speed (kind ``fast``). Rank 1 is pinned to core 1 and
held to half of it by a cgroup-v1 CPU quota (kind ``slow``): a child group of
``/sys/fs/cgroup/cpu`` with ``cpu.cfs_period_us=10000`` and ``cpu.cfs_quota_us=5000``: it runs 5 ms of
every 10, a steady half-speed device at the scale of a stage's actions (tens of ms). With Linux's default
100 ms period it ran 50 ms and stopped for 50, stalls as long as a stage that the pipeline's replay cannot
see (``--period-ms 100`` measures that). Each rank pins itself and (rank 1) writes its own pid into the
group's ``cgroup.procs`` at the top of its worker, before torch is imported, so every thread it starts
(torch, gloo) inherits both. Where the cgroup cannot be created (not root, cgroup v2 only, read-only
mount), rank 1 shares core 1 with a busy-loop process instead, which the kernel's fair scheduler also
halves it with; the output says which one ran. The group (or the busy loop) is removed afterwards, also when something
fails.
With ``--equal`` nothing is throttled: two equal cores, one kind (``cpu``).

``--ranks 4`` runs four ranks, two per core (ranks 0 and 1 on core 0, 2 and 3 on core 1), each held by
a cgroup quota of its own so that each is a device of fixed speed: half a core each with ``--equal``;
otherwise half a core for the ``fast`` ranks 0 and 1 and ``--quota`` of that for the ``slow`` ranks 2
and 3 (a quarter of core 1 each at the default 0.5). The hand plans then have 4 pipeline positions
(``pp_degree=4``), their blocks in proportion to the positions' speeds.

The kinds reach HPPStrategy through the override, ``PlacementOptions(device_map="0:fast,1:slow")`` (or, with
``--kind-source env``, ``HPP_DEVICE_KIND`` set per rank). One invocation runs, on the same model
(``--model mlp``: a 12-layer 1024-wide MLP plus a 10-class head; ``--model lm``: the small
transformer of ``benchmarks/throughput``), the same data and the same global batch, in
``--rounds`` interleaved rounds:

* ``auto``     — ``HPPStrategy(plan="auto")`` with nothing else fixed: each kind profiles the units and
  the step's overheads itself (the slow rank on its throttled core) and the search picks pp x dp
  (pp=1, plain data parallelism, included), the micro-batches, the schedule and the cut;
* ``uniform@M`` — the equal cut (the head joins the last stage), 1F1B with M micro-batches, for every
  M of ``--hand-m``;
* ``hand@M``   — the hand-balanced cut (2/3 of the blocks on the fast rank), same schedules;
* ``ddp``      — Lightning's DDPStrategy over the same two ranks (half the batch each).

Samples/s is the global batch over the median step time after warm-up (the slowest rank's), pooled
over rounds. Pipeline runs record telemetry (``HPPStrategy(telemetry=...)``) on every other timed
step; throughput comes from the other steps, the auto plan's measured per-stage time and bubble from
the recorded ones, next to the partitioner's prediction (``plan.meta["predicted"]``) and the bubble of
the schedule replayed with everything measured (telemetry's ``bubble_replayed``; ``bubble_expected``: with the
stage times alone). The ratios
the placement work is judged by are printed at the end.

Usage::

    python benchmarks/placement/cgroup_bench.py --rounds 3                  # the cgroup pair, MLP
    python benchmarks/placement/cgroup_bench.py --rounds 3 --equal          # two equal cores, MLP
    python benchmarks/placement/cgroup_bench.py --rounds 3 --equal --model lm
"""

from __future__ import annotations

import argparse
import contextlib
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
PERIOD_US = 10_000
KINDS = ("fast", "slow")
EQUAL_KINDS = ("cpu", "cpu")
KINDS4 = ("fast", "fast", "slow", "slow")

FAMILIES = ("gpipe", "interleaved1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
"""Schedule families besides 1F1B with a hand plan of their own (``hand-<family>``; two stages per rank where multi)."""
BASES = ("auto", "uniform", "hand", *(f"hand-{f}" for f in FAMILIES), "ddp", "fsdp")
LABELS = {"auto": 'plan="auto"', "uniform": "uniform cut", "hand": "hand-balanced cut", "ddp": "DDP",
          "fsdp": "FSDP2 (fully_shard per block, plain loop)",
          **{f"hand-{f}": f"hand-balanced {f}" for f in FAMILIES}}


def rank_kinds(job: dict[str, Any]) -> tuple[str, ...]:
    """The device kind of every rank of the job."""
    if job["devices"] == 4:
        return ("cpu",) * 4 if job["equal"] else KINDS4
    return EQUAL_KINDS if job["equal"] else KINDS


def speeds(job: dict[str, Any]) -> list[float]:
    """Every rank's speed relative to a fast one (the hand plans' block shares)."""
    return [1.0 if k in ("fast", "cpu") else job["quota"] for k in rank_kinds(job)]


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
        name: The group's name under ``/sys/fs/cgroup/cpu`` (default ``hpp_bench_<pid>``).
        fallback: Share the core with a busy loop where the group cannot be created (else raise ``OSError``).
        period_us: ``cpu.cfs_period_us``: the group runs ``quota`` of each period, then waits for the next.
    """

    def __init__(self, core: int, quota: float, name: str | None = None, fallback: bool = True,
                 period_us: int = PERIOD_US) -> None:
        self.core = core
        self.quota = quota
        self.period_us = period_us
        self.name = name or f"hpp_bench_{os.getpid()}"
        self.fallback = fallback
        self.group: Path | None = None
        self.spinner: subprocess.Popen | None = None
        self.method = ""
        self.stat: dict[str, int] = {}

    def __enter__(self) -> SlowCore:
        group = CGROUP_ROOT / self.name
        try:
            group.mkdir()
            self.group = group
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(int(self.period_us * self.quota)))
            self.method = (f"cgroup-v1 cpu quota {group} (cfs_quota_us={int(self.period_us * self.quota)}, "
                           f"cfs_period_us={self.period_us})")
        except OSError as err:
            self._remove_group()
            if not self.fallback:
                raise
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
            self.stat = {
                k: int(v) for k, v in (ln.split() for ln in (self.group / "cpu.stat").read_text().splitlines())
            }
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


class RankQuotas:
    """A cgroup-v1 CPU quota group per rank (``--ranks 4``): ``{rank: share of a core}``. No fallback: two
    ranks sharing a core without quotas would not be devices of fixed speed."""

    def __init__(self, quotas: dict[int, float], period_us: int = PERIOD_US) -> None:
        self.quotas = quotas
        self.period_us = period_us
        self.groups: dict[int, SlowCore] = {}
        self.method = ""
        self.stat: dict[str, dict[str, int]] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RankQuotas:
        try:
            for rank, quota in self.quotas.items():
                name = f"hpp_bench_{os.getpid()}_r{rank}"
                group = SlowCore(-1, quota, name=name, fallback=False, period_us=self.period_us)
                self.groups[rank] = self._stack.enter_context(group)
        except OSError as err:
            self.__exit__()
            raise SystemExit(f"--ranks 4 needs a writable cgroup-v1 cpu controller at {CGROUP_ROOT} (one quota group "
                             f"per rank): {err}. Run as root on a host with cgroup v1, or use --ranks 2.") from err
        self.method = "cgroup-v1 cpu quota per rank " + ", ".join(
            f"{r}: {int(self.period_us * q)}/{self.period_us}" for r, q in self.quotas.items())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()  # each group's exit reads its cpu.stat and removes it
        self.stat = {str(rank): group.stat for rank, group in self.groups.items()}
        self.groups = {}

    @property
    def procs_files(self) -> dict[str, str]:
        return {str(r): str(g.group / "cgroup.procs") for r, g in self.groups.items() if g.group is not None}


def pin_and_throttle(rank: int, procs_files: dict[str, str], ranks: int = 2) -> dict[str, Any]:
    """Pin this process to its core (``rank``; with 4 ranks ``rank // 2``) and join its quota group, if it has
    one. Run before torch is imported."""
    os.sched_setaffinity(0, {rank if ranks == 2 else rank // 2})
    if str(rank) in procs_files:
        with open(procs_files[str(rank)], "w") as f:
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
def expand(bases: list[str], hand_m: list[int], ranks: int = 2) -> list[str]:
    """The configurations of one round: ``uniform`` and ``hand`` once per micro-batch count, without the hand
    plans their schedule cannot run (DualPipeV needs as many micro-batches as stages: 8 at 4 ranks)."""
    from lightning_hpp.errors import ScheduleError
    from lightning_hpp.pipeline.schedules import SCHEDULES, check_schedule

    def runs(base: str, m: int) -> bool:
        schedule = base.removeprefix("hand-") if base.startswith("hand-") else "1f1b"
        try:
            check_schedule(schedule, ranks * (2 if SCHEDULES[schedule].multi else 1), ranks, m)
        except ScheduleError:
            return False
        return True

    fixed = [b for b in bases if b.startswith(("uniform", "hand"))]
    return [f"{b}@{m}" if b in fixed else b for b in bases for m in (hand_m if b in fixed else [0])
            if b not in fixed or runs(b, m)]


def label(name: str) -> str:
    base, _, m = name.partition("@")
    return LABELS[base] + (f", {'1F1B' if base in ('uniform', 'hand') else ''} m={m}".replace(",  ", ", ") if m else "")


def _size(job: dict[str, Any]) -> Any:
    from models import Size

    if job["model"] == "mlp":
        return Size(width=job["width"], blocks=job["layers"], batch=job["batch"])
    return Size(width=128, blocks=job["layers"], batch=job["batch"], seq=64, vocab=256)


def worker(job: dict[str, Any]) -> None:
    rank = int(os.environ["RANK"])
    placed = pin_and_throttle(rank, job["procs_files"], job["devices"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gflops = calibrate()
    os.chdir(job["out"])  # stage_plan.json and fingerprints.json land next to the results
    tp = _throughput_helpers()

    dist.init_process_group("gloo")
    import lightning  # noqa: F401

    size = _size(job)
    results = []
    for rnd in range(job["rounds"]):
        for name in expand(job["configs"], job["hand_m"], job["devices"]):
            t0 = time.perf_counter()
            if name in ("ddp", "fsdp"):
                res = (run_ddp if name == "ddp" else run_fsdp)(tp, job, size)
            else:
                res = run_pipeline(tp, job, size, name)
            res.update(config=name, round=rnd, rank=rank, wall_s=time.perf_counter() - t0)
            results.append(res)
            dist.barrier()
    Path(job["out"], f"rank{rank}.json").write_text(
        json.dumps({"placed": placed, "gflops": gflops, "results": results})
    )
    dist.destroy_process_group()


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


def _block_counts(n: int, weights: list[float], minimum: int = 1) -> list[int]:
    """``n`` blocks in proportion to ``weights`` (largest remainders), at least ``minimum`` each."""
    if n < minimum * len(weights):
        raise SystemExit(
            f"{n} blocks cannot give {len(weights)} ranks {minimum} each; use --layers {minimum * len(weights)} or more"
        )
    exact = [n * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    for i in range(len(counts)):
        while counts[i] < minimum:
            counts[max(range(len(counts)), key=lambda j: counts[j])] -= 1
            counts[i] += 1
    return counts


def _cut_at(units: list[str], sizes: list[int]) -> list[list[str]]:
    """Stages of ``sizes`` blocks each; units before the blocks join the first stage, the head the last."""
    blocks = [u for u in units if u.startswith("blocks.")]
    edges = [0, *(units.index(blocks[sum(sizes[:s])]) for s in range(1, len(sizes))), len(units)]
    return [units[a:b] for a, b in zip(edges, edges[1:])]


def cuts(kind: str, units: list[str], weights: list[float] | None = None) -> list[list[str]]:
    """One stage per rank: ``uniform`` (equal blocks) or ``hand`` (blocks in proportion to ``weights``, the
    ranks' speeds; 2/3 : 1/3 for the cgroup pair)."""
    weights = weights or [1.0, 0.5]
    n = sum(u.startswith("blocks.") for u in units)
    return _cut_at(units, _block_counts(n, [1.0] * len(weights) if kind == "uniform" else weights))


def family_cuts(schedule: str, units: list[str], weights: list[float]) -> list[list[str]]:
    """Two stages per rank for a multi-stage ``schedule`` (one for ``gpipe``): each rank holds blocks in proportion
    to its weight (speed), split evenly over its stages, placed as the schedule places stages (loop or V)."""
    from lightning_hpp.pipeline.schedules import SCHEDULES
    from lightning_hpp.planning.replay import rank_of_stages

    if not SCHEDULES[schedule].multi:
        return cuts("hand", units, weights)
    pp = len(weights)
    rank_of = rank_of_stages(schedule, pp, 2 * pp)
    mine = _block_counts(sum(u.startswith("blocks.") for u in units), weights, minimum=2)
    sizes, seen = [], [0] * pp
    for s in range(2 * pp):
        r = rank_of[s]
        sizes.append(mine[r] // 2 + (mine[r] % 2 if seen[r] == 0 else 0))
        seen[r] += 1
    return _cut_at(units, sizes)


def run_pipeline(tp: Any, job: dict[str, Any], size: Any, name: str) -> dict[str, Any]:
    from models import build

    from lightning_hpp import HPPStrategy, StagePlan, StageSpec
    from lightning_hpp.model.units import find_units
    from lightning_hpp.options import PlacementOptions, TelemetryOptions

    base, _, m = name.partition("@")
    model = build(job["model"], size)
    kinds = rank_kinds(job)
    placement = {} if job["kind_source"] == "env" else {"device_map": ",".join(f"{r}:{k}" for r, k in enumerate(kinds))}
    timer = _timer(job["warmup"])
    fixed: dict[str, Any] = {}
    if base == "auto":
        plan: Any = "auto"
    elif base.startswith("hand-"):
        schedule = base.removeprefix("hand-")
        units = family_cuts(schedule, [n for n, _ in find_units(model)], speeds(job))
        plan = StagePlan([StageSpec(modules=u) for u in units])
        fixed = {"schedule": schedule, "n_microbatches": int(m), "pp_degree": job["devices"]}
    else:
        plan = StagePlan([StageSpec(modules=u) for u in cuts(base, [n for n, _ in find_units(model)], speeds(job))])
        fixed = {"schedule": "1f1b", "n_microbatches": int(m), "pp_degree": job["devices"]}
    strategy = HPPStrategy(
        plan=plan,
        telemetry=TelemetryOptions(every_n_steps=10**9),
        placement=PlacementOptions(**placement),
        timeout=300,
        **fixed,
        **tp._hpp_options(),
    )
    trainer = tp._trainer(job, strategy, [timer])
    trainer.fit(model, tp._loader(job, size, size.batch))
    telemetry = timer.telemetry
    out = {**tp._timing(timer.times, job["warmup"], True), **tp._history(telemetry.history if telemetry else [])}
    out["units"] = [list(s.modules) for s in strategy.plan.stages]
    out["chosen"] = {
        "pp": strategy.mesh.pp,
        "dp": strategy.mesh.dp,
        "m": strategy.n_microbatches,
        "schedule": strategy.schedule,
        "stages": strategy.plan.num_stages,
    }
    out["predicted"] = strategy.plan.meta.get("predicted")
    return out


def run_ddp(tp: Any, job: dict[str, Any], size: Any) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy
    from models import build

    timer = _timer(job["warmup"])
    trainer = tp._trainer(job, DDPStrategy(process_group_backend="gloo"), [timer])
    trainer.fit(build(job["model"], size), tp._loader(job, size, size.batch // job["devices"]))
    return tp._timing(timer.times, job["warmup"], False)


def run_fsdp(tp: Any, job: dict[str, Any], size: Any) -> dict[str, Any]:
    """benchmarks/throughput's FSDP2 on CPU: ``fully_shard`` per block over gloo in a plain loop (Lightning's
    FSDPStrategy refuses CPU), each rank on its half of the global batch."""
    import torch

    res = tp.run_fsdp(job, {}, size, torch.device("cpu"))
    res.pop("peak_mb", None)
    return res


# ============================================================================================ launch
def launch(job: dict[str, Any], procs_files: dict[str, str]) -> list[dict[str, Any]]:
    tp = _throughput_helpers()
    os.environ.pop("HPP_DEVICE_KIND", None)  # the kinds come from device_map or, per rank, from here
    job = {**job, "procs_files": procs_files}
    kinds = rank_kinds(job)
    rank_env = (lambda r: {"HPP_DEVICE_KIND": kinds[r]}) if job["kind_source"] == "env" else None
    return tp.launch_ranks(__file__, job, job["devices"], rank_env=rank_env)


# ============================================================================================ report
def summarize(per_rank: list[dict[str, Any]], batch: int, names: list[str]) -> dict[str, Any]:
    """Rows per configuration (rounds pooled: medians) and the auto plan's predicted vs measured numbers."""
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [[r for r in rank["results"] if r["config"] == name] for rank in per_rank]
        if not runs[0]:
            continue
        step = max(statistics.median([t for run in rank_runs for t in run["plain"]]) for rank_runs in runs)
        row: dict[str, Any] = {
            "label": label(name),
            "step_ms": 1e3 * step,
            "samples_s": batch / step,
            "rounds": len(runs[0]),
        }
        first = runs[0][0]
        if "units" in first:
            row["units"] = runs[0][-1]["units"]  # the last round's plan (the stage table's)
            row["units_per_round"] = [run["units"] for run in runs[0]]
            row["chosen"] = [run["chosen"] for run in runs[0]]
            # plan="auto" may choose differently in each round (near ties): stage figures are the last round's
            last = runs[0][-1]
            steps = list(last.get("steps", []))
            if steps:
                row["bubble"] = statistics.median(st["bubble"] for st in steps)
                row["bubble_expected"] = statistics.median(st["bubble_expected"] for st in steps)
                row["bubble_replayed"] = statistics.median(st["bubble_replayed"] for st in steps)
                row["bubble_theory"] = steps[0]["bubble_theory"]
                m = last["chosen"]["m"]
                stages = sorted({int(k) for st in steps for k in st["stages"]})
                row["measured_stage_ms"] = [
                    statistics.median(
                        (st["stages"][str(k)]["fwd_ms"] + st["stages"][str(k)]["bwd_ms"]) / m for st in steps
                    )
                    for k in stages
                ]
                row["measured_comm_ms"] = [
                    statistics.median(st["stages"][str(k)]["comm_ms"] / m for st in steps) for k in stages
                ]
                row["measured_sched_ms"] = statistics.median(st["step_ms"] for st in steps)
            row["predicted"] = [run["predicted"] for run in runs[0]]
        rows[name] = row
    return rows


def _plan_text(row: dict[str, Any]) -> str:
    if "chosen" not in row:
        return ""
    seen = []
    for c, units in zip(row["chosen"], row.get("units_per_round", [row["units"]] * len(row["chosen"]))):
        cut = ":".join(str(sum(u.startswith("blocks.") for u in st)) for st in units)
        v = c.get("stages", c["pp"]) // c["pp"]
        text = (f"pp={c['pp']}×dp={c['dp']}, {c['schedule']} m={c['m']}" + (f", v={v}" if v > 1 else "")
                + (f", blocks {cut}" if c["pp"] > 1 else ""))
        if text not in seen:
            seen.append(text)
    return " / ".join(seen)


def ratios(rows: dict[str, dict[str, Any]], equal: bool, m: int) -> list[str]:
    """The ratios the placement is judged by, with their targets."""
    auto = rows.get("auto")
    if auto is None:
        return []
    out = []
    if "ddp" in rows:
        r = auto["samples_s"] / rows["ddp"]["samples_s"]
        out.append(
            f"auto ÷ DDP: {r:.2f}" + ("" if equal else f"  (target >= 1.15: {'met' if r >= 1.15 else 'NOT met'})")
        )
    if f"uniform@{m}" in rows:
        r = auto["samples_s"] / rows[f"uniform@{m}"]["samples_s"]
        out.append(
            f"auto ÷ uniform cut (1F1B m={m}): {r:.2f}"
            + ("" if equal else f"  (target >= 1.30: {'met' if r >= 1.30 else 'NOT met'})")
        )
    others = {k: v for k, v in rows.items() if k != "auto"}
    if others:
        best = max(others, key=lambda k: others[k]["samples_s"])
        r = auto["samples_s"] / others[best]["samples_s"]
        out.append(f"auto ÷ best of the others ({others[best]['label']}): {r:.2f}"
                   + (f"  (target >= 0.97: {'met' if r >= 0.97 else 'NOT met'})" if equal else ""))
    families: dict[str, str] = {}
    for k in rows:
        base = k.partition("@")[0]
        fam = (
            "1f1b" if base in ("uniform", "hand") else base.removeprefix("hand-") if base.startswith("hand-") else None
        )
        if fam and (fam not in families or rows[k]["samples_s"] > rows[families[fam]]["samples_s"]):
            families[fam] = k
    for fam, k in families.items():
        out.append(f"auto ÷ best {fam} hand plan ({rows[k]['label']}): {auto['samples_s'] / rows[k]['samples_s']:.2f}")
    if "bubble" in auto and auto["chosen"][-1]["pp"] > 1:
        d = 100 * abs(auto["bubble"] - auto["bubble_replayed"])
        out.append(f"auto measured bubble {auto['bubble']:.3f} vs the schedule replayed with everything measured "
                   f"{auto['bubble_replayed']:.3f}: {d:.1f} points  (target <= 3: {'met' if d <= 3 else 'NOT met'})")
    return out


def bubbles(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Every pipeline row's measured bubble next to its schedule's order replayed (target: within 3 points)."""
    out = []
    for r in rows.values():
        if "bubble" in r and r["chosen"][-1]["pp"] > 1:
            d = 100 * abs(r["bubble"] - r["bubble_replayed"])
            out.append(
                f"bubble of {r['label']}: measured {r['bubble']:.3f}, replayed {r['bubble_replayed']:.3f}, {d:.1f} "
                f"points (with the stage costs alone {r['bubble_expected']:.3f})"
            )
    return out


def report(rows: dict[str, dict[str, Any]], kinds: tuple[str, str]) -> str:
    ddp = rows["ddp"]["samples_s"] if "ddp" in rows else None
    lines = ["| configuration | plan | step ms (median) | samples/s | × DDP |", "|---|---|---:|---:|---:|"]
    for r in rows.values():
        vs_ddp = f"{r['samples_s'] / ddp:.2f}" if ddp else ""
        lines.append(f"| {r['label']} | {_plan_text(r)} | {r['step_ms']:.0f} | {r['samples_s']:.1f} | {vs_ddp} |")
    auto = rows.get("auto")
    if auto and auto.get("predicted") and auto.get("measured_stage_ms"):
        pred = auto["predicted"][-1]
        title = (f"{auto['label']}, last round: predicted (profile) vs measured (telemetry, median of recorded steps), "
                 "per micro-batch")
        head = ("| stage | device kind | units | predicted compute ms | measured fwd+bwd ms | measured ÷ predicted | "
                "predicted comm ms | measured comm ms |")
        lines += ["", title, "", head, "|---:|---|---|---:|---:|---:|---:|---:|"]
        measured = zip(pred["compute_ms"], pred["comm_ms"], auto["measured_stage_ms"], auto["measured_comm_ms"])
        for k, (p, c, meas, mc) in enumerate(measured):
            units = auto["units"][k]
            text = f"{units[0]} .. {units[-1]} ({len(units)})"
            pos = (pred.get("positions") or list(range(len(pred["stage_ms"]))))[k]
            kind = kinds[pos] if len(units) < sum(map(len, auto["units"])) else "+".join(sorted(set(kinds)))
            lines.append(f"| {k} | {kind} | {text} | {p:.2f} | {meas:.2f} | {meas / p:.2f} | {c:.3f} | {mc:.3f} |")
        sched_ms = pred.get("pipeline_ms") or (pred["n_microbatches"] + pred["pp_degree"] - 1) * max(pred["stage_ms"])
        lines += [
            "",
            (
                f"predicted step {pred['step_ms']:.0f} ms, of it the schedule {sched_ms:.0f} ms (bubble "
                f"{pred['bubble_fraction']:.3f}); measured in-schedule step {auto['measured_sched_ms']:.0f} ms (bubble "
                f"{auto['bubble']:.3f}, replayed with everything measured {auto['bubble_replayed']:.3f}, with the "
                f"stage costs alone {auto['bubble_expected']:.3f}, theory "
                f"{auto['bubble_theory']:.3f})"
            ),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=["mlp", "lm"], default="mlp")
    p.add_argument(
        "--layers", type=int, default=None, help="blocks (default: 12 for mlp, 6 for lm; 8 for lm at --ranks 4)"
    )
    p.add_argument("--width", type=int, default=1024, help="mlp width")
    p.add_argument("--batch", type=int, default=None, help="global batch (DDP: half per rank; default 192 mlp, 48 lm)")
    p.add_argument("--m", type=int, default=12,
                   help="micro-batches of the reference uniform cut (the × uniform ratio)")
    p.add_argument(
        "--hand-m", type=int, nargs="+", default=None, help="micro-batch counts of the fixed cuts (default: 4 and --m)"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="timed steps per configuration and round (half recorded)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all configurations (medians pool them)")
    p.add_argument("--quota", type=float, default=0.5, help="share of core 1 the slow rank gets")
    p.add_argument("--period-ms", type=float, default=PERIOD_US / 1000,
                   help="the quota groups' cpu.cfs_period_us in ms: a throttled rank runs its share of each period, "
                        "then stops until the next (shorter: a steadier slow device)")
    p.add_argument("--equal", action="store_true", help="two equal cores: no throttling, one device kind")
    p.add_argument("--ranks", type=int, choices=[2, 4], default=2, help="4: two ranks per core, a quota group each")
    p.add_argument("--kind-source", choices=["device_map", "env"], default="device_map")
    p.add_argument("--configs", nargs="+", default=list(BASES), choices=BASES)
    p.add_argument("--out", default=None, help="default runs/cgroup_bench[_equal]_<model>")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("This benchmark pins its two ranks to cores 0 and 1; it needs a machine with 2 or more cores.")
    # the LM at 4 ranks: 8 blocks, so that the two-stages-per-rank plans have a block per stage
    layers = args.layers or (12 if args.model == "mlp" else 8 if args.ranks == 4 else 6)
    batch = args.batch or (192 if args.model == "mlp" else 48)
    hand_m = args.hand_m or sorted({4, args.m})
    if any(batch % m for m in hand_m) or batch % args.ranks:
        raise SystemExit(
            f"--batch {batch} must be divisible by every --hand-m {hand_m} and by {args.ranks} (DDP's ranks)."
        )
    four = "_4ranks" if args.ranks == 4 else ""
    out = Path(args.out or ROOT / "runs" / f"cgroup_bench{'_equal' if args.equal else ''}{four}_{args.model}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    job = {"layers": layers, "width": args.width, "batch": batch, "m": args.m, "hand_m": hand_m, "warmup": args.warmup,
           "steps": args.steps, "rounds": args.rounds, "kind_source": args.kind_source, "configs": args.configs,
           "equal": args.equal, "out": str(out), "model": args.model, "accelerator": "cpu", "devices": args.ranks,
           "threads": 1, "quota": args.quota}
    period_us = int(args.period_ms * 1000)
    if not 1000 <= period_us <= 1_000_000:
        raise SystemExit(f"--period-ms {args.period_ms}: cgroup v1 takes a period from 1 ms to 1000 ms.")
    tp = _throughput_helpers()
    env = tp.environment(job)
    started = time.time()
    kinds = rank_kinds(job)
    if args.ranks == 4:
        shares = {r: 0.5 * speed for r, speed in enumerate(speeds(job))}
        with RankQuotas(shares, period_us=period_us) as quotas:
            print(f"4 ranks, two per core: {quotas.method}", flush=True)
            per_rank = launch(job, quotas.procs_files)
        method, stat = quotas.method, quotas.stat
    elif args.equal:
        print("two equal cores: no throttling", flush=True)
        per_rank, method, stat = launch(job, {}), "none (--equal)", {}
    else:
        with SlowCore(core=1, quota=args.quota, period_us=period_us) as slow:
            print(f"slow rank: {slow.method}", flush=True)
            per_rank = launch(job, {"1": slow.procs_file} if slow.procs_file else {})
        method, stat = slow.method, slow.stat
    env.update(
        load_average_end=os.getloadavg(),
        wall_s=round(time.time() - started, 1),
        throttle=method,
        cgroup_cpu_stat=stat,
        placed=[r["placed"] for r in per_rank],
        calibration_gflops=[round(r["gflops"], 2) for r in per_rank],
        command=" ".join(["python", *sys.argv]),
    )
    rows = summarize(per_rank, batch, expand(args.configs, hand_m, args.ranks))
    text = report(rows, kinds)
    summary = ratios(rows, args.equal, args.m) + bubbles(rows)
    g = env["calibration_gflops"]
    print(f"\nranks: {env['placed']}\nmatmul GFLOP/s per rank (1 thread, all at once): {g} -> ÷ rank 0 "
          f"{[round(x / g[0], 2) for x in g]}")
    if stat:
        print(f"quota group cpu.stat: {stat}")
    print(text)
    print("\n" + "\n".join(summary))
    (out / "results.json").write_text(json.dumps({"environment": env, "rows": rows, "ratios": summary}, indent=1))
    (out / "results.md").write_text(f"Environment: {json.dumps(env)}\n\n{text}\n\n" + "\n".join(summary) + "\n")
    print(f"\nwrote {out / 'results.md'} and {out / 'results.json'} in {env['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
