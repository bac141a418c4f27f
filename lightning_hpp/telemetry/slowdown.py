"""What the straggler watch looks for, and how a rank finds itself slow against its own recent past.

:class:`WatchOptions` (``PlacementOptions(watch=...)``) says what counts and what the job does;
:class:`SlowdownDetector` reads one rank's per-step times (its stage compute, or its longest wait on a
pipeline transfer) and finds a slowdown, a :class:`Finding` once the watch
(:class:`~lightning_hpp.telemetry.watch.StragglerWatch`) names the rank:

* the first ``warmup`` steps are ignored (allocation, first-touch, thread start-up);
* the baseline is the median (and MAD) of the last ``window`` steps that were not slow;
* a step is slow when its time exceeds ``ratio`` × the baseline median, the median plus
  ``min_ms``, and the median plus 6 scaled MADs;
* a slowdown is found when most of the last ``steps`` steps are slow (a CPU quota that pauses a
  process every 100 ms makes only some steps slow) and has been for ``min_s`` seconds (2 s: a burst
  of load on a shared host is not a straggler), from the first slow one of them on; the new level
  then becomes the baseline, so one slowdown is reported once;
* with more than one pipeline position, a position counts only if it is also ``ratio`` times slower
  than the least slowed position (against each one's own baseline): a load that slows every rank
  alike is not a straggler. (The flags are the maximum over a position's replicas, so with one
  position, plain data parallelism, there is nothing to compare with.)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

from lightning_hpp.errors import PlacementError
from lightning_hpp.validation import check_choice, check_int, check_number

ACTIONS = ("warn", "stop", "replan", "off")
STOP_EXIT_CODE = 75
"""Exit code of every rank after ``watch="stop"`` wrote its checkpoint (EX_TEMPFAIL)."""
REPLAN_EXIT_CODE = 76
"""Exit code of every rank after ``watch="replan"`` wrote its checkpoint: start the same command again."""
META_KEY = "watch"
"""The key of the watch's record in a checkpoint's ``metadata.json`` ``extra``."""


@dataclass(frozen=True)
class WatchOptions:
    """What the straggler watch looks for and what it does (``PlacementOptions(watch=...)``)."""

    action: str = "warn"
    """``"warn"`` (default), ``"stop"`` (checkpoint with the measured speeds, exit 75), ``"replan"``
    (the same, exit 76; ``plan="auto"`` re-plans from those speeds when started again) or ``"off"``."""
    ratio: float = 1.5
    """A step is slow when it takes more than this many times the rank's recent median."""
    steps: int = 8
    """A slowdown is found when most (more than half) of the last this many steps were slow."""
    warmup: int = 10
    """Steps ignored at the start of a fit."""
    window: int = 30
    """Steps of the baseline (median and MAD of the last this many steps that were not slow)."""
    min_ms: float = 5.0
    """The least increase of a step's compute that counts, in ms (timer and scheduler noise)."""
    min_s: float = 2.0
    """The least wall time a slowdown must last, in seconds (a burst of load on a shared host is not a straggler)."""
    wait_ms: float = 200.0
    """The least increase of a transfer wait that counts, in ms (a wait also holds the peer's compute)."""

    error: ClassVar[type[ValueError]] = PlacementError

    def __post_init__(self) -> None:
        name = "WatchOptions"
        check_choice(self.action, f"{name}(action=...)", ACTIONS, error=self.error)
        check_number(self.ratio, f"{name}(ratio=...)", minimum=1.0, error=self.error)
        check_int(self.steps, f"{name}(steps=...)", error=self.error)
        check_int(self.warmup, f"{name}(warmup=...)", minimum=0, error=self.error)
        check_int(self.window, f"{name}(window=...)", minimum=self.steps, error=self.error)
        check_number(self.min_ms, f"{name}(min_ms=...)", strict=False, error=self.error)
        check_number(self.wait_ms, f"{name}(wait_ms=...)", strict=False, error=self.error)
        check_number(self.min_s, f"{name}(min_s=...)", strict=False, error=self.error)

    @property
    def ends_the_job(self) -> bool:
        return self.action in ("stop", "replan")


def watch_options(value: Any, where: str = "PlacementOptions(watch=...)") -> WatchOptions:
    """``value`` as :class:`WatchOptions`: one, an action name, a dict of its fields, ``None`` (the
    default, ``"warn"``) or ``False`` (``"off"``).

    Raises:
        PlacementError: anything else, or bad field values.
    """
    if value is None or value is True:
        return WatchOptions()
    if value is False:
        return WatchOptions(action="off")
    if isinstance(value, WatchOptions):
        return value
    if isinstance(value, str):
        if value not in ACTIONS:
            raise PlacementError(
                f"`{where}`: {value!r} is not an action; use one of {ACTIONS} or a `WatchOptions(...)`."
            )
        return WatchOptions(action=value)
    if isinstance(value, dict) or hasattr(value, "items"):
        data = dict(value)
        fields = {f.name for f in dataclasses.fields(WatchOptions)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise PlacementError(f"`{where}` has unknown keys {unknown}; `WatchOptions` takes {sorted(fields)}.")
        return WatchOptions(**data)
    raise PlacementError(
        f"`{where}`: got {value!r}; pass an action ({', '.join(map(repr, ACTIONS))}), a "
        f"`WatchOptions(...)` or a dict of its fields."
    )


@dataclass
class Slowdown:
    """What a :class:`SlowdownDetector` found: since which step, how slow, against what."""

    since_step: int
    step: int
    measured_ms: float
    baseline_ms: float

    @property
    def speed(self) -> float:
        """Baseline over measured: the share of its former speed the rank has left."""
        return self.baseline_ms / self.measured_ms if self.measured_ms > 0 else 1.0


class SlowdownDetector:
    """One signal (a rank's compute per step, or its longest transfer wait) against its own baseline.

    Args:
        ratio, steps, warmup, window: As in :class:`WatchOptions`.
        min_ms: The least increase over the baseline median that counts.
        min_s: The least wall time a slowdown must last (most of the last ``steps`` steps slow all along).
    """

    def __init__(self, ratio: float, steps: int, warmup: int, window: int, min_ms: float, min_s: float = 0.0) -> None:
        self.ratio, self.steps, self.warmup, self.min_ms, self.min_s = ratio, steps, warmup, min_ms, min_s
        self._seen = 0
        self._base: deque[float] = deque(maxlen=window)
        self._recent: deque[tuple[int, float, bool, float]] = deque(maxlen=steps)  # step, ms, slow, its start
        self._since: tuple[int, float] | None = None  # first slow step of the current slowdown, and when it began

    @property
    def baseline_ms(self) -> float | None:
        return statistics.median(self._base) if len(self._base) >= self.steps else None

    @property
    def current_ratio(self) -> float:
        """Median of the last ``steps`` steps over the baseline median (0 while the baseline fills)."""
        base = self.baseline_ms
        if base is None or not self._recent or base <= 0:
            return 0.0
        return statistics.median(r[1] for r in self._recent) / base

    def threshold(self) -> float | None:
        """Above this a step is slow (``None`` while the baseline fills)."""
        if len(self._base) < self.steps:
            return None
        med = statistics.median(self._base)
        mad = statistics.median(abs(x - med) for x in self._base)
        return max(self.ratio * med, med + self.min_ms, med + 6 * 1.4826 * mad)

    def observe(self, step: int, value_ms: float, now: float | None = None) -> Slowdown | None:
        """Take one step's value (``now``: its end, in seconds; default the monotonic clock); a
        :class:`Slowdown` when this step confirms one."""
        now = time.monotonic() if now is None else now
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        limit = self.threshold()
        if limit is None:
            self._base.append(value_ms)
            return None
        slow = value_ms > limit
        self._recent.append((step, value_ms, slow, now - value_ms / 1e3))
        if not slow:
            self._base.append(value_ms)
        flagged = [(s, v) for s, v, f, _ in self._recent if f]
        if 2 * len(flagged) <= len(self._recent):
            self._since = None
            return None
        if self._since is None:
            self._since = self._onset()
        if len(self._recent) < self.steps or not slow or now - self._since[1] < self.min_s:
            return None
        found = Slowdown(
            since_step=self._since[0],
            step=step,
            measured_ms=statistics.median(v for _, v in flagged),
            baseline_ms=statistics.median(self._base),
        )
        self._base.clear()  # the new level is the baseline from now on: one slowdown, one finding
        self._base.extend(v for _, v in flagged)
        self._recent.clear()
        self._since = None
        return found

    def _onset(self) -> tuple[int, float]:
        """The slowdown's first step and when it began: the earliest slow step of the window with no two fast
        steps in a row after it (a noisy step a few steps before the change is not where it began; one fast
        step inside a slowdown, as a quota's, does not cut it). ``min_s`` counts from its start."""
        onset, fast = None, 0
        for step, _, slow, start in reversed(self._recent):
            if slow:
                onset, fast = (step, start), 0
            elif (fast := fast + 1) == 2:
                break
        return onset if onset is not None else next((r[0], r[3]) for r in self._recent if r[2])


@dataclass
class Finding:
    """A rank found slow (or a slow link), as reported and recorded in a checkpoint.

    Attributes:
        signal: ``"compute"`` (the rank's stage compute) or ``"transfer"`` (its longest wait on a peer).
        rank, host, device_kind, stages: The rank that found it.
        since_step, step: The first slow step (global step) and the step that confirmed it.
        measured_ms, expected_ms: Median of the slow steps, and of the baseline before them, per step.
        planned_ms: The plan's prediction of the same per-step compute (``plan="auto"``), else ``None``.
        peer: For ``"transfer"``: the rank on the other end of the longest wait.
    """

    signal: str
    rank: int
    host: str
    device_kind: str
    stages: list[int]
    since_step: int
    step: int
    measured_ms: float
    expected_ms: float
    planned_ms: float | None = None
    peer: int | None = None

    @property
    def speed(self) -> float:
        return self.expected_ms / self.measured_ms if self.measured_ms > 0 else 1.0

    def describe(self) -> str:
        where = f"rank {self.rank} (host {self.host}, device kind {self.device_kind!r}, stage(s) {self.stages})"
        plan = f", plan predicted {self.planned_ms:.2f} ms" if self.planned_ms is not None else ""
        if self.signal == "transfer":
            return (
                f"slow transfers: {where} waits {self.measured_ms:.1f} ms per step on its longest transfer with rank "
                f"{self.peer}, against {self.expected_ms:.1f} ms before, since step {self.since_step}"
            )
        return (
            f"straggler: {where} computes its stages in {self.measured_ms:.2f} ms per step, expected "
            f"{self.expected_ms:.2f} ms (its own median before){plan}: {self.speed:.2f}x its speed, since step "
            f"{self.since_step}"
        )
