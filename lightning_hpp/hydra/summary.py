"""The end-of-sweep summary: a table of every trial, best first, and a plot of the metric.

:class:`SweepSummary` is a Hydra callback (``hydra.callbacks.sweep_summary`` in configs/train.yaml).
At the end of a multirun it reads the ``trial.json`` that :mod:`lightning_hpp.hydra.train` wrote into
every trial directory, and

* prints a table: rank, trial number, status, the swept values, the optimized metric and the
  other final metrics, best first (failed trials last);
* writes the same table as ``summary.md`` and the rows as ``summary.json`` in the sweep directory;
* draws ``summary.png``: the metric against every swept value (log axis for values spanning a
  decade or more; the other swept values as colours);
* for a study sweep (``hparams_search=asha``), adds each trial's state, the number of validations
  it reported and the rung at which it stopped to the table, draws ``curves.png`` (the metric
  against the step for every trial, pruned trials marked where they stopped) and names the study
  and its storage URL (password hidden) in ``summary.json``.

The same summary can be rebuilt from a finished sweep directory::

    python -m lightning_hpp.hydra.summary outputs/train/multiruns/2025-01-01_12-00-00 --metric val/loss
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from lightning_hpp.errors import SweepError
from lightning_hpp.validation import check_choice

log = logging.getLogger(__name__)

TRIAL_FILE = "trial.json"
STUDY_FILE = "study.json"
MODES = ("min", "max")


@dataclass
class Trial:
    """One trial as recorded in its ``trial.json``."""

    num: int
    params: dict[str, str]
    status: str
    value: float | None
    metrics: dict[str, float]
    seconds: float | None
    error: str | None
    curve: list[tuple[int, float]] = field(default_factory=list)
    """``(step, value)`` reported to the study at each validation (study sweeps only)."""
    rung: int | None = None
    """The highest pruning rung the trial reached (study sweeps with a successive-halving pruner)."""
    state: str | None = None
    """The study's state of the trial: COMPLETE, PRUNED, FAIL (study sweeps only)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.value is not None and math.isfinite(self.value)

    @property
    def pruned(self) -> bool:
        return self.status == "pruned"


def parse_override(text: str) -> tuple[str, str]:
    """``"model.optimizer.lr=0.001"`` -> ``("model.optimizer.lr", "0.001")``."""
    key, _, value = text.partition("=")
    return key.lstrip("+~"), value


def _params(record: dict[str, Any]) -> dict[str, str]:
    """The overrides of a trial; for a study trial, the sampled values stand in for their overrides."""
    params = dict(parse_override(o) for o in record.get("overrides", []))
    if record.get("params") is not None:  # the study's values, not the driver's own (ckpt_path=last of a retry)
        params = {k: v for k, v in params.items() if k != "ckpt_path" or record.get("retry_of") is None}
        params.update({k: repr(v) if isinstance(v, float) else str(v) for k, v in record["params"].items()})
    return params


def load_trials(sweep_dir: str | Path) -> list[Trial]:
    """Every ``<sweep_dir>/*/trial.json``, in trial order."""
    trials = []
    for path in sorted(Path(sweep_dir).glob(f"*/{TRIAL_FILE}")):
        data = json.loads(path.read_text())
        trials.append(
            Trial(
                num=int(data.get("num", len(trials))),
                params=_params(data),
                status=str(data.get("status", "unknown")),
                value=None if data.get("value") is None else float(data["value"]),
                metrics={k: float(v) for k, v in (data.get("metrics") or {}).items()},
                seconds=data.get("seconds"),
                error=data.get("error"),
                curve=[
                    (int(s), float(v)) for s, v in data.get("curve") or (data.get("study") or {}).get("curve") or []
                ],
                rung=data.get("rung"),
                state=data.get("state"),
            )
        )
    return sorted(trials, key=lambda t: t.num)


def swept_parameters(trials: Sequence[Trial]) -> list[str]:
    """The override keys whose values differ between trials, in first-seen order."""
    keys: list[str] = []
    for t in trials:
        keys.extend(k for k in t.params if k not in keys)
    return [k for k in keys if len({t.params.get(k) for t in trials}) > 1]


def ranked(trials: Sequence[Trial], mode: str) -> list[Trial]:
    """Completed trials best first by their value, then pruned ones (by their last value), then failed ones."""
    if mode not in MODES:
        raise SweepError(f"Summary mode {mode!r} is not valid; use 'min' or 'max'.")

    def by_value(group: list[Trial]) -> list[Trial]:
        sign = 1 if mode == "min" else -1
        return sorted(group, key=lambda t: (t.value is None or not math.isfinite(t.value), sign * (t.value or 0.0)))

    good = by_value([t for t in trials if t.ok])
    pruned = by_value([t for t in trials if t.pruned])
    return good + pruned + [t for t in trials if not t.ok and not t.pruned]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _fmt_value(text: str) -> str:
    """A swept value as written, or with 6 significant digits when it is a long number."""
    number = _number(text)
    return f"{number:.6g}" if number is not None and len(text) > 10 else text


def table_rows(trials: Sequence[Trial], metric: str, mode: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the summary table, best first."""
    params = swept_parameters(trials)
    others = sorted({k for t in trials for k in t.metrics} - {metric})
    study = any(t.state is not None for t in trials)
    extra = ["validations", "last step", "rung"] if study else []
    header = ["rank", "trial", "status", *params, metric, *others, *extra, "seconds"]
    rows = []
    for i, t in enumerate(ranked(trials, mode), start=1):
        curve = [_fmt(len(t.curve)), _fmt(t.curve[-1][0] if t.curve else None), _fmt(t.rung)] if study else []
        rows.append(
            [
                str(i) if t.ok else "-",
                str(t.num),
                t.status,
                *[_fmt_value(t.params.get(p, "-")) for p in params],
                _fmt(t.value),
                *[_fmt(t.metrics.get(k)) for k in others],
                *curve,
                _fmt(t.seconds),
            ]
        )
    return header, rows


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An aligned plain-text table for the console."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table."""

    def esc(c: Any) -> str:
        return str(c).replace("|", "\\|")

    lines = ["| " + " | ".join(esc(c) for c in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def plot(trials: Sequence[Trial], metric: str, path: str | Path) -> Path:
    """Draw the metric against every swept value into a PNG.

    Numeric values are placed on a linear axis, or a log axis when they are positive and span a
    factor of 10 or more; other values are categories. With several swept parameters, the points
    of each panel are coloured by the values of the others.

    Raises:
        SweepError: no completed trial to draw.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [t for t in trials if t.ok]
    if not done:
        raise SweepError(f"No completed trial to plot; the {len(trials)} trial(s) all failed.")
    params = swept_parameters(trials) or ["trial"]
    fig, axes = plt.subplots(1, len(params), figsize=(4.5 * len(params), 3.6), squeeze=False)
    for ax, param in zip(axes[0], params):
        values = [str(t.num) if param == "trial" else t.params.get(param, "-") for t in done]
        numbers = [_number(v) for v in values]
        numeric = all(n is not None for n in numbers)
        if numeric:
            xs = numbers
            if min(xs) > 0 and max(xs) / min(xs) >= 10:
                ax.set_xscale("log")
        else:
            cats = sorted(set(values))
            xs = [cats.index(v) for v in values]
            ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
        rest = [p for p in params if p != param]
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(done):
            label = ", ".join(f"{p.rsplit('.', 1)[-1]}={t.params.get(p, '-')}" for p in rest) or "trials"
            groups.setdefault(label, []).append(i)
        for label, idx in groups.items():
            pts = sorted((xs[i], done[i].value) for i in idx)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xlabel(param)
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        if rest:
            ax.legend(fontsize="small")
    fig.suptitle(f"{metric}: {len(done)} of {len(trials)} trial(s) completed")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(trials: Sequence[Trial], metric: str, path: str | Path) -> Path:
    """Draw every trial's reported curve (metric against step) into a PNG.

    Completed trials are solid lines, pruned ones dashed with an ``x`` where they stopped (labelled
    with their rung), failed ones dotted.

    Raises:
        SweepError: no trial reported a value.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [t for t in trials if t.curve]
    if not drawn:
        raise SweepError(f"No learning curve to plot; none of the {len(trials)} trial(s) reported {metric!r}.")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for t in drawn:
        steps, values = zip(*t.curve)
        style = "-" if t.ok else "--" if t.pruned else ":"
        (line,) = ax.plot(steps, values, style, marker=".", label=f"trial {t.num} ({t.status})")
        if t.pruned:
            ax.plot(steps[-1], values[-1], "x", color=line.get_color(), markersize=10, markeredgewidth=2)
            if t.rung is not None:
                ax.annotate(
                    f"rung {t.rung}",
                    (steps[-1], values[-1]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize="x-small",
                    color=line.get_color(),
                )
    ax.set_xlabel("step (optimizer steps)")
    ax.set_ylabel(metric)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    n_pruned = sum(t.pruned for t in trials)
    ax.set_title(f"{metric} per validation: {len(trials)} trial(s), {n_pruned} pruned (x: where they stopped)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summarize(sweep_dir: str | Path, metric: str, mode: str = "min", *, draw: bool = True) -> str:
    """Write ``summary.md``, ``summary.json`` and (``draw``) ``summary.png``; return the console table.

    Raises:
        SweepError: no ``trial.json`` under ``sweep_dir``.
    """
    sweep_dir = Path(sweep_dir)
    trials = load_trials(sweep_dir)
    if not trials:
        raise SweepError(
            f"No trial records ({TRIAL_FILE}) under {str(sweep_dir)!r}; is it the directory of a "
            f"lightning-hpp-train multirun?"
        )
    header, rows = table_rows(trials, metric, mode)
    best = next((t for t in ranked(trials, mode) if t.ok), None)
    pruned = sum(t.pruned for t in trials)
    title = f"Sweep {sweep_dir.name}: {sum(t.ok for t in trials)}/{len(trials)} trial(s) completed"
    title += f", {pruned} pruned, {metric} ({mode})" if pruned else f", {metric} ({mode})"
    md = f"# {title}\n\n{markdown_table(header, rows)}\n"
    if best is not None:
        shown = swept_parameters(trials) or list(best.params)
        md += (
            f"\nBest: trial {best.num}, {metric}={best.value:.6g}, "
            + ", ".join(f"{k}={best.params[k]}" for k in shown if k in best.params)
            + "\n"
        )
    study = _read_study(sweep_dir)
    if study:
        md = f"Study {study.get('study_name')!r} in {study.get('storage')}\n\n" + md
    (sweep_dir / "summary.md").write_text(md)
    record = {
        "study_name": study.get("study_name"),
        "storage": study.get("storage"),
        "metric": metric,
        "mode": mode,
        "trials": [dict(zip(header, r)) for r in rows],
    }
    (sweep_dir / "summary.json").write_text(json.dumps(record, indent=2))
    try:
        if draw and best is not None:
            plot(trials, metric, sweep_dir / "summary.png")
        if draw and any(t.curve for t in trials):
            plot_curves(trials, metric, sweep_dir / "curves.png")
    except ImportError:
        log.warning("summary.png not drawn: matplotlib is not installed (pip install 'lightning-hpp[hydra]').")
    return f"{title}\n{text_table(header, rows)}"


def _read_study(sweep_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((sweep_dir / STUDY_FILE).read_text())
    except (OSError, ValueError):
        return {}


class SweepSummary(Callback):
    """Hydra callback: the summary of a finished multirun.

    Args:
        metric: The metric the trials optimise (``optimized_metric``).
        mode: ``"min"`` or ``"max"``: which end of the metric is best.

    Raises:
        SystemExit: at the end of a multirun in which no trial completed, so that the command fails.
    """

    def __init__(self, metric: str, mode: str = "min") -> None:
        check_choice(mode, "SweepSummary(mode=...)", MODES, error=SweepError)
        self.metric = metric
        self.mode = mode

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from lightning_hpp.hydra.snapshot import scrub_hydra_files

        sweep_dir = Path(config.hydra.sweep.dir)
        scrub_hydra_files(sweep_dir)
        text = summarize(sweep_dir, self.metric, self.mode)
        print(text, flush=True)
        log.info("Sweep summary written to %s", sweep_dir / "summary.md")
        trials = load_trials(sweep_dir)
        if not any(t.ok or t.pruned for t in trials):
            first = next((t for t in trials if t.error), None)
            # Hydra turns exceptions raised by callbacks into warnings; SystemExit ends the command.
            raise SystemExit(
                f"None of the {len(trials)} trial(s) completed; see the trial.log files under "
                f"{str(sweep_dir)!r}." + (f" Trial {first.num}: {first.error}" if first else "")
            )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_hpp.hydra.summary SWEEP_DIR --metric M [--mode min|max]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir")
    parser.add_argument("--metric", required=True)
    parser.add_argument("--mode", default="min", choices=MODES)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    print(summarize(args.sweep_dir, args.metric, args.mode, draw=not args.no_plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
