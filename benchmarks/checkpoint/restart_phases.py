"""Where the seconds of a restart go: kill -9 under torchrun --max-restarts to the first resumed step, by phase.

The job of ``tests/test_resume.py::test_kill_9_under_torchrun_restarts_resumes_and_matches`` (the tests' MLP,
2 pipeline stages, 1F1B, a sharded checkpoint every 2 steps, ``resume="auto"``; rank 1 SIGKILLs itself after
step 5 of the first attempt), run through this script's worker, which stamps, in each restarted rank:

* ``process created``: the kernel's start time of the process (``/proc/self/stat``), from the kill;
* ``interpreter``: process creation to the first line of the worker (Python start, ``site``);
* ``imports``: torch, Lightning, lightning_hpp and the test model;
* ``Trainer and launch``: up to the process group's creation;
* ``rendezvous``: ``init_process_group`` (waits for the other rank);
* ``pipeline setup``: ``build_pipeline`` (device kinds, the plan and its checks, the cut, the groups; the
  traced frontend's export would be here);
* ``resume: checksums``: ``verify`` of the chosen checkpoint (every rank reads and hashes its share);
* ``resume: load``: the rest of choosing and loading the checkpoint;
* ``fit start``: the rest of setup and the fit-start hooks (optimizers, the coded-bias audit and
  fingerprints, callbacks) up to the first batch;
* ``first step``: the first resumed step.

Rank 0's stamps are reported (the first step ends on both ranks together). Each run is made under both
launchers, one after the other (paired): ``torchrun`` (``python -m torch.distributed.run``: every worker a
fresh ``python``) and ``lightning_hpp.torchrun`` (the same agent; workers forked from a forkserver that has
imported torch, Lightning and lightning_hpp). Usage::

    python benchmarks/checkpoint/restart_phases.py --runs 3
"""

from __future__ import annotations

import time

T_FIRST_LINE = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PHASES = ["process created", "interpreter", "imports", "Trainer and launch", "rendezvous", "pipeline setup",
          "resume: checksums", "resume: load", "fit start", "first step"]


def _process_created() -> float:
    """This process's start time (wall clock), from ``/proc``: its start in clock ticks after boot, placed on the
    wall clock by the uptime read now (``/proc/stat``'s ``btime`` is whole seconds: up to 1 s off)."""
    now = time.time()
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def worker(cfg: dict[str, Any]) -> None:
    stamps: dict[str, float] = {"created": _process_created(), "first_line": T_FIRST_LINE}
    sums = {"verify": 0.0}
    import lightning as L
    import torch  # noqa: F401

    import lightning_hpp.checkpoint.resume as resume
    import lightning_hpp.checkpoint.session as session
    import lightning_hpp.strategy as strategy
    from tests.workers import run_resume

    stamps["imported"] = time.time()

    def timed(
        owner: Any, name: str, before: str | None = None, after: str | None = None, total: str | None = None
    ) -> None:
        fn = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.time()
            if before:
                stamps.setdefault(before, t0)
            try:
                return fn(*args, **kwargs)
            finally:
                if after:
                    stamps.setdefault(after, time.time())
                if total:
                    sums[total] += time.time() - t0

        setattr(owner, name, wrapper)

    timed(strategy, "init_process_group", before="pg_start", after="pg_end")
    timed(strategy, "build_pipeline", before="build_start", after="build_end")
    timed(session.CheckpointSession, "begin_fit", before="resume_start", after="resume_end")
    timed(resume, "verify", total="verify")

    class Stamps(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            stamps.setdefault("batch_start", time.time())

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if "batch_end" not in stamps:
                stamps["batch_end"] = time.time()
                rank = trainer.global_rank
                Path(
                    cfg["out"], f"phases_attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}_rank{rank}.json"
                ).write_text(json.dumps({"stamps": stamps, "sums": sums, "global_step": trainer.global_step}))

    init = L.Trainer.__init__

    def trainer_init(self: Any, *args: Any, callbacks: Any = None, **kwargs: Any) -> None:
        init(self, *args, callbacks=[*(callbacks or []), Stamps()], **kwargs)

    L.Trainer.__init__ = trainer_init
    run_resume.main(cfg)


def phases(stamps: dict[str, float], sums: dict[str, float], killed_at: float) -> dict[str, float]:
    s = stamps
    resume_s = s["resume_end"] - s["resume_start"]
    return {
        "process created": s["created"] - killed_at,
        "interpreter": s["first_line"] - s["created"],
        "imports": s["imported"] - s["first_line"],
        "Trainer and launch": s["pg_start"] - s["imported"],
        "rendezvous": s["pg_end"] - s["pg_start"],
        "pipeline setup": s["build_end"] - s["build_start"],
        "resume: checksums": sums["verify"],
        "resume: load": resume_s - sums["verify"],
        "fit start": s["batch_start"] - s["pg_end"] - (s["build_end"] - s["build_start"]) - resume_s,
        "first step": s["batch_end"] - s["batch_start"],
    }


LAUNCHERS = {"torchrun": "torch.distributed.run", "lightning_hpp.torchrun": "lightning_hpp.torchrun"}


def one_run(out: Path, launcher: str) -> dict[str, Any]:
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    cfg = {
        "stages": [["layers.0-3"], ["layers.4-6"]],
        "steps": 8,
        "tag": "phases",
        "out": str(out),
        "ckpt_dir": str(out / "ckpt"),
        "every": 2,
        "resume": "auto",
        "kill_at": 5,
        "kill_rank": 1,
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            LAUNCHERS[launcher],
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
            str(Path(__file__).resolve()),
            "--worker",
            json.dumps(cfg),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    killed_at = float((out / "killed_at").read_text())
    got = json.loads((out / "phases_attempt1_rank0.json").read_text())
    first = json.loads((out / "first_step_after_restart").read_text())
    row = phases(got["stamps"], got["sums"], killed_at)
    row["total"] = first["time"] - killed_at
    row["resumed_at_step"] = got["global_step"]
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=list(LAUNCHERS))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(ROOT))
        worker(json.loads(args.worker))
        return
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in args.launchers}
    load = [os.getloadavg()]
    for i in range(args.runs):
        for name in args.launchers:
            with tempfile.TemporaryDirectory(prefix="hpp-restart-") as d:
                rows[name].append(one_run(Path(d), name))
            print(f"run {i}, {name}: {rows[name][-1]['total']:.2f} s", flush=True)
    load.append(os.getloadavg())
    head = " | ".join(f"{name}: median (s) | runs (s)" for name in args.launchers)
    lines = [f"| phase of the restarted rank 0 | {head} |", "|---|" + "---:|---|" * len(args.launchers)]
    for phase in [*PHASES, "total"]:
        label = "**kill → end of the first resumed step**" if phase == "total" else phase
        cells = []
        for name in args.launchers:
            values = [r[phase] for r in rows[name]]
            cells.append(f"{statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)}")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    resumed = {name: [r["resumed_at_step"] for r in rows[name]] for name in args.launchers}
    print(f"load average {load[0]} -> {load[1]}; every run resumed at step {resumed}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
