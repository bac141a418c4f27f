"""Step time and peak memory per stage: the hybrid vision model in fp32 vs its mixed plan, on CPU.

The main example (``examples/hybrid_vision``) in 3 pipeline stages on 3 CPU processes (gloo, 1F1B,
8 micro-batches, the digits data), twice, in interleaved rounds within one invocation:

* ``fp32``  — ``model.fp32_plan()``: every stage ``"32-true"``;
* ``mixed`` — ``model.mixed_plan()``: encoder ``"16-mixed"`` (CPU autocast fp16), Transformer
  ``"fp8"`` with ``HPPPrecision(fp8_backend="emulate")`` (a quantize-dequantize emulation: fp8 numerics, no fp8
  speed; there is no fp8 hardware on a CPU), classifier ``"bf16-mixed"`` (CPU autocast bf16).

Per configuration: the step time (median of the timed steps that telemetry does not record, the
slowest rank), per stage the forward and backward time of one step (``PipelineTelemetry``, median
of the recorded steps: every other timed step) and per rank — one rank per stage — the peak
resident memory (the kernel's RSS high-water mark, reset when the configuration starts, minus the
RSS then; also the absolute high-water mark).

Usage::

    python benchmarks/precision/bench.py                       # the example's size (8x8 digits)
    python benchmarks/precision/bench.py --image-size 32 --channels 64 --dim 128
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
CONFIGS = ("fp32", "mixed")
STAGE_NAMES = ("encoder", "transformer", "classifier")


def _throughput_helpers() -> Any:
    """benchmarks/throughput/main.py as a module (peak memory, timing, trainer and launch helpers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("throughput_main", ROOT / "benchmarks" / "throughput" / "main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ============================================================================================ worker
def worker(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    os.chdir(job["out"])  # stage_plan.json and fingerprints.json land next to the results
    dist.init_process_group("gloo")
    tp = _throughput_helpers()
    sys.path.insert(0, str(ROOT / "examples" / "hybrid_vision"))
    import lightning  # noqa: F401  (imported before any baseline is taken)

    # one short untimed fit first: the first configuration a process runs also pays one-time
    # allocations (Lightning, gloo buffers, autocast caches) that would inflate its peak memory
    for name in job["configs"]:
        run(tp, {**job, "warmup": 1, "steps": 1}, name)
        dist.barrier()
    results = []
    for rnd in range(job["rounds"]):
        for name in job["configs"]:
            t0 = time.perf_counter()
            res = run(tp, job, name)
            res.update(config=name, round=rnd, rank=rank, wall_s=time.perf_counter() - t0)
            results.append(res)
            dist.barrier()
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run(tp: Any, job: dict[str, Any], name: str) -> dict[str, Any]:
    import lightning as L
    import torch
    from model import HybridVisionModel, fp32_plan, mixed_plan

    from lightning_hpp import HPPStrategy
    from lightning_hpp.examples_data import DigitsDataModule
    from lightning_hpp.telemetry.callback import PipelineTelemetry

    L.seed_everything(0, verbose=False)
    memory = tp.PeakMemory(torch.device("cpu"))
    memory.reset()
    telemetry = PipelineTelemetry(every_n_steps=10**9)
    timer = tp._lightning_timer(job, memory, telemetry)
    precision = {"fp8_backend": "emulate"} if name == "mixed" else {}
    strategy = HPPStrategy(
        plan=mixed_plan() if name == "mixed" else fp32_plan(),
        schedule="1f1b",
        n_microbatches=job["m"],
        timeout=300,
        **tp._hpp_options(**precision),
    )
    trainer = tp._trainer(job, strategy, [telemetry, timer])
    model = HybridVisionModel(image_size=job["image_size"], channels=job["channels"], dim=job["dim"])
    n_params = sum(p.numel() for p in model.parameters())
    data = DigitsDataModule(batch_size=job["batch"], n_microbatches=job["m"], image_size=job["image_size"])
    trainer.fit(model, data)
    return {
        **tp._timing(timer.times, job["warmup"], True),
        **tp._history(telemetry.history),
        "peak_mb": memory.peak_mb(),
        "hwm_mb": tp._vm("VmHWM") / 2**20,
        "stage_ids": strategy.stage_ids,
        "precision": strategy.plan.meta.get("precision") or [s.precision for s in strategy.plan.stages],
        "params": n_params,
    }


# ============================================================================================ launch
def launch(job: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return _throughput_helpers().launch_ranks(__file__, job, job["devices"])


# ============================================================================================ report
def summarize(per_rank: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for name in CONFIGS:
        runs = [[r for r in rank if r["config"] == name] for rank in per_rank]
        if not runs[0]:
            continue
        step = max(statistics.median([t for run in rank_runs for t in run["plain"]]) for rank_runs in runs)
        steps = [st for run in runs[0] for st in run["steps"]]
        stages = {}
        for k in range(len(per_rank)):
            med = lambda key: statistics.median(st["stages"][str(k)][key] for st in steps)  # noqa: E731
            holder = next(r for r, rank_runs in enumerate(runs) if k in rank_runs[0]["stage_ids"])
            stages[k] = {
                "fwd_ms": med("fwd_ms"),
                "bwd_ms": med("bwd_ms"),
                "comm_ms": med("comm_ms"),
                "idle_ms": med("idle_ms"),
                "peak_mb": max(run["peak_mb"] for run in runs[holder]),
                "hwm_mb": max(run["hwm_mb"] for run in runs[holder]),
                "precision": runs[0][0]["precision"][k],
            }
        rows[name] = {"step_ms": 1e3 * step, "sched_ms": statistics.median(st["step_ms"] for st in steps),
                      "bubble": statistics.median(st["bubble"] for st in steps), "stages": stages,
                      "rounds": len(runs[0]), "params": runs[0][0]["params"]}
    return rows


def _short(label: str) -> str:
    return label.split(" (")[0]


def report(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| stage | unit | fp32: precision | fwd ms | bwd ms | peak +MB (RSS MB) | mixed: precision | fwd ms | bwd ms | "
        "peak +MB (RSS MB) | "
        "fwd+bwd mixed ÷ fp32 |",
        "|---:|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    a, b = rows.get("fp32"), rows.get("mixed")
    if a and b:
        for k in sorted(a["stages"]):
            x, y = a["stages"][k], b["stages"][k]
            ratio = (y["fwd_ms"] + y["bwd_ms"]) / (x["fwd_ms"] + x["bwd_ms"])
            lines.append(
                f"| {k} | {STAGE_NAMES[k] if k < len(STAGE_NAMES) else ''} | {_short(x['precision'])} | "
                f"{x['fwd_ms']:.1f} | "
                f"{x['bwd_ms']:.1f} | {x['peak_mb']:.0f} ({x['hwm_mb']:.0f}) | {_short(y['precision'])} | "
                f"{y['fwd_ms']:.1f} | "
                f"{y['bwd_ms']:.1f} | {y['peak_mb']:.0f} ({y['hwm_mb']:.0f}) | {ratio:.2f} |"
            )
        lines += [
            "",
            "| plan | step ms (median) | in-schedule ms | measured bubble | samples/s |",
            "|---|---:|---:|---:|---:|",
        ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['step_ms']:.0f} | {r['sched_ms']:.0f} | {r['bubble']:.3f} | "
            f"{r['batch'] / (r['step_ms'] / 1e3):.0f} |"
        )
    if a and b:
        lines.append(f"\nmixed ÷ fp32 step time: {b['step_ms'] / a['step_ms']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--image-size", type=int, default=8, help="side of the (upsampled) digits images; the example uses 8"
    )
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--m", type=int, default=8, help="micro-batches (1F1B)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="timed steps per configuration and round (half recorded)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--out", default=str(ROOT / "runs" / "precision_bench"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    job = {"image_size": args.image_size, "channels": args.channels, "dim": args.dim, "batch": args.batch, "m": args.m,
           "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "configs": args.configs, "out": str(out),
           "accelerator": "cpu", "devices": 3, "threads": 1}
    tp = _throughput_helpers()
    env = tp.environment(job)
    started = time.time()
    rows = summarize(launch(job))
    for r in rows.values():
        r["batch"] = args.batch
    env.update(
        load_average_end=os.getloadavg(),
        wall_s=round(time.time() - started, 1),
        command=" ".join(["python", *sys.argv]),
        model={
            "image_size": args.image_size,
            "channels": args.channels,
            "dim": args.dim,
            "params": next(iter(rows.values()))["params"],
        },
    )
    text = report(rows)
    print(text)
    (out / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / "results.md").write_text(f"Environment: {json.dumps(env)}\n\n{text}\n")
    print(f"\nwrote {out / 'results.md'} and {out / 'results.json'} in {env['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
