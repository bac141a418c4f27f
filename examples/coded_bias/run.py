"""Coded bias, reproduced: the field report's weighted-sampler bug on a 4-rank pipeline (pp=2 × dp=2).

    python examples/coded_bias/run.py                  # about 1-2 minutes on 2 CPU cores
    python examples/coded_bias/run.py --epochs 8 --out runs/coded_bias

One job of 4 processes (Lightning launches them; gloo on CPU) trains the same two-stage digits
classifier three times, from the same initial weights, for the same number of steps, with three
ways of sampling a class-imbalanced training set through class-balancing weights:

* ``bug`` — the field report: ``WeightedRandomSampler`` without a generator and
  ``use_distributed_sampler=False``. Every replica draws the identical sequence.
* ``report_fix`` — the field report's fix: a generator seeded ``seed + rank``, with Lightning's
  default ``use_distributed_sampler=True``. Lightning wraps the sampler in
  ``DistributedSamplerWrapper``, which needs the same sequence on every rank; under pipeline
  parallelism the two stages of one replica now draw *different* samples.
* ``fix`` — ``DistributedWeightedSampler(weights, seed=seed)``.

Every fit runs :class:`~lightning_hpp.bias.guard.BiasGuard` with ``audit="warn"`` (the audit reports
before the first step, training continues) and :class:`~lightning_hpp.bias.monitor.BiasMonitor`.
Rank 0 prints what the audit said, a comparison table (markdown), and saves
``coded_bias_metrics.png`` and ``results.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from data import LABELS, RARE_CLASSES, SAMPLINGS, class_balancing_weights, imbalanced_digits, make_sampler  # noqa: E402
from model import DigitsClassifier, accuracy  # noqa: E402

from lightning_hpp import HPPStrategy  # noqa: E402
from lightning_hpp.bias.fingerprint import CodedBiasWarning  # noqa: E402
from lightning_hpp.bias.guard import BiasGuard  # noqa: E402
from lightning_hpp.bias.monitor import BiasMonitor  # noqa: E402

DEVICES = 4
PP = 2
DP = DEVICES // PP


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="batch of one pipeline replica")
    p.add_argument("--n-microbatches", type=int, default=2)
    p.add_argument("--samplings", default=",".join(SAMPLINGS), help=f"comma-separated subset of {SAMPLINGS}")
    p.add_argument(
        "--seeds", default="0,1,2", help="training seeds (initial weights and sampling); one fit per seed and sampling"
    )
    p.add_argument("--out", default="runs/coded_bias")
    args = p.parse_args(argv)
    args.samplings = [s for s in args.samplings.split(",") if s]
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds {args.seeds!r} must be comma-separated integers, e.g. 0,1,2")
    if not args.seeds:
        p.error("--seeds needs at least one seed")
    unknown = [s for s in args.samplings if s not in SAMPLINGS]
    if unknown:
        p.error(f"unknown sampling(s) {unknown!r}; choose from {SAMPLINGS}")
    return args


class PipelineEval(L.Callback):
    """At each epoch end, gather the full model on rank 0 and measure validation accuracy there."""

    def __init__(self, val) -> None:
        self.x, self.y = val.tensors
        self.curve: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Every rank holds its own stage only (units of other stages are parameterless stand-ins):
        # rank 0 gathers the parts. The replicas hold equal parameters, so any rank's copy will do.
        own = {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}
        parts: list[Any] = [None] * trainer.world_size if trainer.is_global_zero else []
        torch.distributed.gather_object(own, parts if trainer.is_global_zero else None, dst=0)
        if trainer.is_global_zero:
            state = {k: v for part in parts for k, v in part.items()}
            acc, rare = accuracy(state, self.x, self.y, RARE_CLASSES)
            self.curve.append(
                {"epoch": trainer.current_epoch, "step": trainer.global_step, "acc": acc, "rare_acc": rare}
            )


def fit(kind: str, seed: int, args: argparse.Namespace, train, val) -> dict[str, Any]:
    L.seed_everything(seed, verbose=False)
    model = DigitsClassifier()  # same initial weights for every sampling
    guard = BiasGuard(audit="warn", fingerprint="warn")
    monitor = BiasMonitor()
    evaluator = PipelineEval(val)
    weights = class_balancing_weights(train.tensors[1])
    trainer = L.Trainer(
        accelerator="cpu", devices=DEVICES,
        strategy=HPPStrategy(schedule="gpipe", n_microbatches=args.n_microbatches, timeout=120),
        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=os.path.join(args.out, kind),
        callbacks=[guard, monitor, evaluator], use_distributed_sampler=kind != "bug",
    )
    sampler, _ = make_sampler(kind, weights, seed, DP, trainer.global_rank)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CodedBiasWarning)
        trainer.fit(model, loader)
    return {
        "kind": kind,
        "seed": seed,
        "seconds": time.monotonic() - start,
        "steps": trainer.global_step,
        "audit": [{"code": h.code, "severity": h.severity, "text": str(h)} for h in guard.hazards],
        "audited_at_step": guard.audited_at_step,
        "fingerprint_differences": [str(d) for d in guard.differences],
        "alarms": monitor.alarms,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, CodedBiasWarning)],
        "history": monitor.history,
        "curve": evaluator.curve,
    }


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One fit's numbers: step metrics averaged over steps, epoch metrics over epochs, final accuracy."""
    steps = [h for h in run["history"] if "bias/loss_std" in h]
    epochs = [h for h in run["history"] if "bias/coverage" in h]
    last = run["curve"][-1] if run["curve"] else {"acc": float("nan"), "rare_acc": float("nan")}
    out = {key: _mean([r[metric] for r in rows if metric in r]) for key, rows, metric in (
        ("loss_std", steps, "bias/loss_std"),
        ("grad_std_0", steps, "bias/grad_norm_std/stage_0"),
        ("grad_std_1", steps, "bias/grad_norm_std/stage_1"),
        ("agreement", epochs, "bias/sequence_agreement"),
        ("jaccard", epochs, "bias/overlap_jaccard"),
        ("expected", epochs, "bias/overlap_expected"),
        ("coverage", epochs, "bias/coverage"),
    )}
    out.update(
        hazards={f"{a['code']} ({a['severity']})" for a in run["audit"]},
        alarms={a.split(" ", 1)[0] for a in run["alarms"]},
        acc=last["acc"],
        rare_acc=last["rare_acc"],
    )
    return out


def _pm(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown table: one row per sampling, numbers averaged over the seeds (accuracy: mean ± std)."""
    head = ("| sampling | audit before step 1 | loss std | grad-norm std s0 / s1 | seq. agreement | "
            "overlap (expected) | coverage | monitor alarms | val acc | rare-digit acc |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for kind in dict.fromkeys(r["kind"] for r in runs):
        sums = [summarize(r) for r in runs if r["kind"] == kind]
        m = {k: _mean([x[k] for x in sums]) for k in ("loss_std", "grad_std_0", "grad_std_1", "agreement",
                                                     "jaccard", "expected", "coverage")}
        hazards = sorted(set().union(*(x["hazards"] for x in sums)))
        alarms = sorted(set().union(*(x["alarms"] for x in sums)))
        rows.append(
            f"| {LABELS[kind]} | {', '.join(hazards) or 'none'} | {m['loss_std']:.4f} | "
            f"{m['grad_std_0']:.4f} / {m['grad_std_1']:.4f} | {m['agreement']:.3f} | "
            f"{m['jaccard']:.3f} ({m['expected']:.3f}) | {m['coverage']:.3f} | {', '.join(alarms) or 'none'} | "
            f"{_pm([x['acc'] for x in sums])} | {_pm([x['rare_acc'] for x in sums])} |"
        )
    return "\n".join(rows)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Step metrics of the first seed's fits, and validation accuracy per epoch averaged over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first_seed = runs[0]["seed"]
    kinds = list(dict.fromkeys(r["kind"] for r in runs))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    panels = [("bias/loss_std", "loss std across dp ranks"),
              ("bias/grad_norm_std/stage_0", "stage 0: std of local grad norms"),
              ("bias/grad_norm_std/stage_1", "stage 1: std of local grad norms"),
              ("bias/sequence_agreement", "sequence agreement (per epoch)"),
              ("bias/coverage", "coverage of the dataset (per epoch)")]
    for ax, (key, title) in zip(axes.flat, panels):
        for run in (r for r in runs if r["seed"] == first_seed):
            pts = [(h["step"], h[key]) for h in run["history"] if key in h]
            style = {"marker": "o"} if "per epoch" in title else {}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=LABELS[run["kind"]], lw=1.2, **style)
        ax.set_title(f"{title}, seed {first_seed}", fontsize=10)
        ax.set_xlabel("step")
    ax = axes.flat[5]
    for kind in kinds:
        curves = [r["curve"] for r in runs if r["kind"] == kind]
        steps = [c["step"] for c in curves[0]]
        acc = [_mean([c[i]["acc"] for c in curves]) for i in range(len(steps))]
        rare = [_mean([c[i]["rare_acc"] for c in curves]) for i in range(len(steps))]
        line, = ax.plot(steps, acc, marker="o", label=f"{kind}: all digits")
        ax.plot(steps, rare, marker="x", ls="--", color=line.get_color(), label=f"{kind}: rare digits")
    ax.set_title(f"validation accuracy, mean of {len({r['seed'] for r in runs})} seeds", fontsize=10)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Coded bias: the field report's sampler bug vs fixes (HPPStrategy, pp=2 × dp=2, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(run: dict[str, Any]) -> None:
    """What the audit said before the first step, and the monitor's alarms (first one per metric)."""
    print(f"\n=== {LABELS[run['kind']]} (seed {run['seed']}): audit at step {run['audited_at_step']}, "
          f"{len(run['audit'])} hazard(s); {run['steps']} steps in {run['seconds']:.1f} s")
    for a in run["audit"]:
        print(f"  audit: {a['text']}")
    by_metric: dict[str, list[str]] = {}
    for alarm in run["alarms"]:
        by_metric.setdefault(alarm.split(" ", 1)[0], []).append(alarm)
    for alarms in by_metric.values():
        more = f" [and {len(alarms) - 1} more alarm(s) of this metric]" if len(alarms) > 1 else ""
        print(f"  monitor: {alarms[0]}{more}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    train, val = imbalanced_digits(0)
    runs = [fit(kind, seed, args, train, val) for seed in args.seeds for kind in args.samplings]
    if int(os.environ.get("LOCAL_RANK", "0")) != 0 or int(os.environ.get("NODE_RANK", "0")) != 0:
        return runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nTraining set: {len(train)} images ({sum(int(c) in RARE_CLASSES for c in train.tensors[1])} of the rare "
          f"digits {RARE_CLASSES}); validation: {len(val)} images, balanced. Seeds: {args.seeds}.")
    for run in runs:
        if run["seed"] == args.seeds[0]:
            report(run)
    print("\n" + table(runs))
    plot(runs, out / "coded_bias_metrics.png")
    (out / "results.json").write_text(json.dumps(runs, indent=1, default=str))
    print(f"\nSaved {out / 'coded_bias_metrics.png'} and {out / 'results.json'}")
    return runs


if __name__ == "__main__":
    main()
