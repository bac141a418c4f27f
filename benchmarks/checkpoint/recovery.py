"""Recovery after kill -9 under torchrun, and the training stall of a checkpoint, sync vs async.

**Recovery.** Exactly the job of ``tests/test_resume.py::test_kill_9_under_torchrun_restarts_resumes_and_matches``:
``torchrun --nproc-per-node 2 --max-restarts 1 --monitor-interval 0.5 --rdzv-backend c10d`` runs
``tests/workers/run_resume.py`` (the tests' small MLP, 2 pipeline stages, 1F1B, a sharded
checkpoint every 2 steps, ``resume="auto"``); rank 1 SIGKILLs itself after step 5 of the first
attempt. Recovery time is the wall time from the kill to the end of the first step of the
restarted job (both stamped by the worker). It is split, from the elastic agent's log (run with
``LOGLEVEL=INFO``, which changes nothing else) and the restarted job's ``stage_plan.json``, into:
failure detected and the survivors stopped; rendezvous; start of the new processes until
HPPStrategy's setup is done (interpreter, imports, process group, resolving ``resume="auto"``,
the plan and its forward check); checkpoint load and the first step. Each run is also checked:
the job exits 0 and its first step after the restart is step 5 (the step-4 checkpoint resumed).

**Stall.** Two pipeline ranks train an MLP of ``--mparams`` million parameters (SGD with momentum,
so a checkpoint holds twice that in float32) under HPPStrategy with ``CheckpointOptions(dir=...,
every_n_steps=--every)`` and ``async_save`` off, then on, in interleaved rounds. A step's time
runs from one batch start to the next, so it includes the checkpoint Lightning saves at the end
of a step. Reported: the median step without a save (synchronous runs), the median step that saves,
and for the asynchronous runs also the steps after it (the background write shares the 2 cores);
"lost per checkpoint" is the median over checkpoints of the extra time summed over the saving step
and the steps up to the next save.

Usage::

    python benchmarks/checkpoint/recovery.py                    # 3 recoveries + stall, ~8 minutes
    python benchmarks/checkpoint/recovery.py --skip-stall --runs 5
    python benchmarks/checkpoint/recovery.py --skip-recovery --mparams 100 --every 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
TWO = [["layers.0-3"], ["layers.4-6"]]
KILL_AT = 5
FIELD_REPORT_S = 11.3


# ============================================================================================ recovery
_AGENT_LINE = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*?\] (.*)$")


def _agent_events(stderr: str, day: datetime.date) -> dict[str, float]:
    """Times (epoch seconds) of the elastic agent's restart events, from its INFO log."""
    events: dict[str, float] = {}
    failed_seen = False
    for line in stderr.splitlines():
        m = _AGENT_LINE.match(line)
        if not m:
            continue
        t = datetime.datetime.combine(day, datetime.time.fromisoformat(m.group(2))).timestamp()
        text = m.group(3)
        if "Worker group FAILED" in text and "will restart" in text:
            events.setdefault("failed", t)
            failed_seen = True
        elif failed_seen and "Rendezvous complete" in text:
            events.setdefault("rendezvous", t)
        elif failed_seen and "Starting worker group" in text:
            events.setdefault("started", t)
    return events


def recovery_run(out: Path, timeout: float, private_store: bool) -> dict[str, Any]:
    """One torchrun job killed with SIGKILL and restarted; the timeline of its recovery."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    ckpt = out / "ckpt"
    cfg = {"stages": TWO, "steps": 12, "tag": "elastic", "out": str(out), "ckpt_dir": str(ckpt), "every": 2,
           "resume": "auto", "kill_at": KILL_AT, "kill_rank": 1}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOGLEVEL": "INFO"}
    if private_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{find_free_network_port()}",
        "-m",
        "tests.workers.run_resume",
        json.dumps(cfg),
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    (out / "torchrun.stderr").write_text(proc.stderr)
    res: dict[str, Any] = {"returncode": proc.returncode, "wall_s": time.time() - t0}
    if proc.returncode != 0 or not (out / "first_step_after_restart").exists():
        cause = (
            "gloo connect refused after the restart"
            if "connectFullMesh failed" in proc.stderr
            else "see torchrun.stderr"
        )
        res.update(ok=False, cause=cause, stderr_tail=proc.stderr[-1500:])
        return res
    killed = float((out / "killed_at").read_text())
    first = json.loads((out / "first_step_after_restart").read_text())
    setup_done = (out / "stage_plan.json").stat().st_mtime  # rewritten by the restarted job's setup
    ev = _agent_events(proc.stderr, datetime.datetime.fromtimestamp(killed).date())
    res.update(
        ok=first["global_step"] == KILL_AT, resumed_step=first["global_step"] - 1, recovery_s=first["time"] - killed
    )
    if {"failed", "rendezvous"} <= ev.keys():
        res["phases"] = {
            "detect + stop survivors": ev["failed"] - killed,
            "rendezvous": ev["rendezvous"] - ev["failed"],
            "start-up to setup done": setup_done - ev["rendezvous"],
            "load + first step": first["time"] - setup_done,
        }
    return res


def bench_recovery(runs: int, max_tries: int, timeout: float, private_store: bool, keep: str | None) -> dict[str, Any]:
    done, failed = [], []
    for i in range(max_tries):
        if len(done) == runs:
            break
        out = Path(tempfile.mkdtemp(prefix="hpp-recovery-", dir=keep))
        res = recovery_run(out, timeout, private_store)
        text = f"{res['recovery_s']:.2f} s {res.get('phases', '')}" if res.get("ok") else f"FAILED ({res.get('cause')})"
        print(f"  recovery run {i + 1}: {text}", flush=True)
        (done if res.get("ok") else failed).append(res)
        if keep is None:
            shutil.rmtree(out, ignore_errors=True)
    return {"runs": done, "failed": failed}


# ============================================================================================ stall
def stall_worker(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    os.chdir(job["out"])  # stage_plan.json and fingerprints.json land next to the results
    dist.init_process_group("gloo")
    tp = _throughput()
    results = []
    for rnd in range(job["rounds"]):
        for mode in ("sync", "async"):
            results.append({"mode": mode, "round": rnd, "times": stall_run(tp, job, mode == "async", rnd)})
            dist.barrier()
    Path(job["out"], f"stall_rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def stall_run(tp: Any, job: dict[str, Any], async_save: bool, rnd: int) -> list[float]:
    """Step times (batch start to next batch start) of one fit that checkpoints every ``job['every']`` steps."""
    from lightning.pytorch import Callback
    from models import Size, build, split

    from lightning_hpp import HPPStrategy, StagePlan, StageSpec
    from lightning_hpp.checkpoint.resume import step_checkpoint_callback
    from lightning_hpp.options import CheckpointOptions

    class StepClock(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.end = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            self.end = time.perf_counter()

    size = Size(width=job["width"], blocks=job["blocks"], batch=job["batch"])
    clock = StepClock()
    # a real path, as ModelCheckpoint spells its dirpath (HPPStrategy finds its callback by that path)
    ckpt_dir = os.path.realpath(Path(job["ckpt_root"]) / f"{'async' if async_save else 'sync'}-{rnd}")
    plan = StagePlan([StageSpec(modules=u) for u in split("mlp", size, 2)])
    checkpoint = CheckpointOptions(dir=ckpt_dir, every_n_steps=job["every"], keep_last=1, async_save=async_save)
    strategy = HPPStrategy(plan=plan, schedule="1f1b", n_microbatches=job["m"], checkpoint=checkpoint, timeout=600,
                           **tp._hpp_options())
    job = {**job, "model": "mlp", "accelerator": "cpu", "devices": 2, "warmup": 0}
    # checkpointing on, with the step-<N> callback HPPStrategy would add at setup given here: Lightning
    # then adds no default ModelCheckpoint, whose end-of-epoch save the last timed step would include
    saver = step_checkpoint_callback(ckpt_dir, job["every"])
    trainer = tp._trainer(job, strategy, [clock, saver], enable_checkpointing=True)
    trainer.fit(build("mlp", size), tp._loader(job, size, size.batch))
    starts = clock.starts + [clock.end]  # the last step is no save step: on_train_end closes it
    return [b - a for a, b in zip(starts, starts[1:])]


def _throughput() -> Any:
    """benchmarks/throughput/main.py as a module (its models, timing and launch helpers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("throughput_main", ROOT / "benchmarks" / "throughput" / "main.py")
    tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp)  # also puts benchmarks/throughput (its models) on sys.path
    return tp


def launch_stall(job: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return _throughput().launch_ranks(__file__, job, 2, flag="--stall-worker", prefix="stall_rank")


def summarize_stall(per_rank: list[list[dict[str, Any]]], every: int, warmup: int) -> dict[str, Any]:
    """Per mode: normal / saving / following step medians and the time lost per checkpoint (slowest rank)."""
    runs = [[max(ts) for ts in zip(*(rank[i]["times"] for rank in per_rank))] for i in range(len(per_rank[0]))]
    modes = [r["mode"] for r in per_rank[0]]

    def is_save(step: int) -> bool:  # step is 1-based: the step that ends with global_step == step
        return step % every == 0

    normal = statistics.median(t for times, mode in zip(runs, modes) if mode == "sync"
                               for i, t in enumerate(times) if i >= warmup and not is_save(i + 1))
    out: dict[str, Any] = {"normal_step_s": normal}
    for mode in ("sync", "async"):
        save_steps, after, lost = [], [], []
        for times, m in zip(runs, modes):
            if m != mode:
                continue
            for i, t in enumerate(times):
                if is_save(i + 1) and i + every <= len(times):
                    save_steps.append(t)
                    after.append(times[i + 1])
                    lost.append(sum(x - normal for x in times[i:i + every]))
        out[mode] = {"save_step_s": statistics.median(save_steps), "next_step_s": statistics.median(after),
                     "lost_per_ckpt_s": statistics.median(lost), "checkpoints": len(save_steps)}
    return out


# ============================================================================================ report
def report(rec: dict[str, Any] | None, stall: dict[str, Any] | None, job: dict[str, Any]) -> str:
    lines: list[str] = []
    if rec is not None:
        ok = rec["runs"]
        lines += ["| recovery after kill -9 (torchrun --max-restarts 1) | median (s) | runs (s) |", "|---|---:|---|"]
        if ok:
            total = [r["recovery_s"] for r in ok]
            lines.append(
                f"| **kill → first resumed step** | **{statistics.median(total):.2f}** | "
                f"{', '.join(f'{t:.2f}' for t in total)} |"
            )
            phases = [r["phases"] for r in ok if "phases" in r]
            for name in (phases[0] if phases else {}):
                vals = [p[name] for p in phases]
                lines.append(f"| {name} | {statistics.median(vals):.2f} | {', '.join(f'{v:.2f}' for v in vals)} |")
        lines.append(f"\nsuccessful runs: {len(ok)}; failed restarts: {len(rec['failed'])}"
                     + "".join(f"\n- failed: {f.get('cause')}" for f in rec["failed"]))
        if ok:
            from tests.harness.zoo import MLP

            n = sum(p.numel() for p in MLP().parameters())
            lines.append(
                f"field report: {FIELD_REPORT_S} s average on 256 GPUs (not like for like: 2 CPU processes on one "
                f"host, the tests' {n}-parameter MLP, no node replacement, no scheduler, no NCCL start-up)"
            )
    if stall is not None:
        ckpt_mb = job["params"] * 4 * 2 / 1e6
        lines += ["", f"| stall per checkpoint ({job['params'] / 1e6:.0f}M parameters, {ckpt_mb:.0f} MB per checkpoint "
                      f"with momentum, 2 ranks, every {job['every']} steps) | sync | async |", "|---|---:|---:|"]
        s, a = stall["sync"], stall["async"]
        lines += [
            f"| step without a save (median, s) | {stall['normal_step_s']:.2f} | {stall['normal_step_s']:.2f} |",
            f"| step that saves (median, s) | {s['save_step_s']:.2f} | {a['save_step_s']:.2f} |",
            f"| stall of the saving step (s) | {s['save_step_s'] - stall['normal_step_s']:.2f} | "
            f"{a['save_step_s'] - stall['normal_step_s']:.2f} |",
            f"| step after the save (median, s) | {s['next_step_s']:.2f} | {a['next_step_s']:.2f} |",
            f"| training time lost per checkpoint (median, s) | {s['lost_per_ckpt_s']:.2f} | "
            f"{a['lost_per_ckpt_s']:.2f} |",
            f"| checkpoints measured | {s['checkpoints']} | {a['checkpoints']} |",
        ]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import lightning
    import torch

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
        platform.processor(),
    )
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=3, help="successful recoveries to take the median of")
    p.add_argument(
        "--max-tries", type=int, default=6, help="recovery jobs to start at most (failed restarts are reported)"
    )
    p.add_argument(
        "--private-store",
        action="store_true",
        help="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh TCPStore per restart instead of the agent's shared one",
    )
    p.add_argument(
        "--mparams", type=int, default=100, help="model size for the stall benchmark, millions of parameters"
    )
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps (stall benchmark)")
    p.add_argument("--saves", type=int, default=3, help="checkpoints per fit (stall benchmark)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved sync/async rounds (stall benchmark)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--skip-recovery", action="store_true")
    p.add_argument("--skip-stall", action="store_true")
    p.add_argument(
        "--dir", default=None, help="where checkpoints go (default: a temporary directory; removed afterwards)"
    )
    p.add_argument("--keep", default=None, help="keep each recovery job's files under this directory")
    p.add_argument("--out", default=str(ROOT / "runs" / "recovery_bench"))
    p.add_argument("--stall-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stall_worker:
        stall_worker(json.loads(args.stall_worker))
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    started = time.time()
    rec = stall = None
    width, blocks = 2048, max(2, 2 * round(args.mparams * 1e6 / 2048**2 / 2))
    job = {
        "width": width,
        "blocks": blocks,
        "batch": args.batch,
        "m": 4,
        "every": args.every,
        "rounds": args.rounds,
        "steps": args.every * args.saves + args.every - 1,
        "params": blocks * (width * width + width) + width * 10 + 10,
        "out": str(out),
    }
    if not args.skip_recovery:
        print("recovery after kill -9:", flush=True)
        rec = bench_recovery(args.runs, args.max_tries, 400, args.private_store, args.keep)
    if not args.skip_stall:
        root = tempfile.mkdtemp(prefix="hpp-stall-", dir=args.dir)
        try:
            print(
                f"stall: {job['params'] / 1e6:.1f}M parameters, {job['steps']} steps per fit, checkpoint every "
                f"{args.every}",
                flush=True,
            )
            stall = summarize_stall(launch_stall({**job, "ckpt_root": root}), args.every, warmup=1)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    env.update(
        load_average_end=os.getloadavg(),
        wall_s=round(time.time() - started, 1),
        command=" ".join(["python", *sys.argv]),
        private_store=args.private_store,
    )
    text = report(rec, stall, job)
    print("\n" + text)
    (out / "results.json").write_text(
        json.dumps({"environment": env, "recovery": rec, "stall": stall, "job": job}, indent=1, default=str)
    )
    (out / "results.md").write_text(f"Environment: {json.dumps(env)}\n\n{text}\n")
    print(f"\nwrote {out / 'results.md'} and {out / 'results.json'} in {env['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
