"""The search space of a study sweep: Hydra's sweep overrides as Optuna distributions.

``hydra.sweeper.params`` (and sweep overrides on the command line) use Hydra's override grammar:

* ``interval(0.1, 5.0)`` -> ``FloatDistribution(0.1, 5.0)``; ``tag(log, interval(1e-5, 1e-2))`` its
  log-uniform form; ``int(interval(1, 8))`` -> ``IntDistribution``;
* ``range(1, 9, 2)`` -> ``IntDistribution(1, 7, step=2)`` (floats: ``FloatDistribution`` with a step);
  ``shuffle(range(...))`` and ``choice(a, b, c)`` / ``a,b,c`` -> ``CategoricalDistribution``;
* anything else is a fixed value, passed to every trial as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer

from lightning_hpp.errors import SweepError


def _distribution(override: Override) -> Any:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if isinstance(value, ChoiceSweep) or (isinstance(value, RangeSweep) and value.shuffle):
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        if not step > 0 or not stop > start:
            raise SweepError(
                f"`{override.input_line}`: a study samples increasing ranges only (start < stop, step > 0)."
            )
        # Hydra's range excludes its stop: the last value on the grid is the high end
        last = math.ceil((stop - start) / step - 1e-9) - 1
        if any(isinstance(x, float) for x in (start, stop, step)):
            return FloatDistribution(float(start), float(start + last * step), step=float(step))
        return IntDistribution(int(start), int(start + last * step), step=int(step))
    if isinstance(value, IntervalSweep):
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise SweepError(
        f"`{override.input_line}` is not a sweep the study can sample; use interval(low, high), "
        f"tag(log, interval(low, high)), range(start, stop, step) or choice(a, b, ...)."
    )


def search_space(arguments: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Split overrides into Optuna distributions (the swept ones) and fixed values (the others).

    Raises:
        SweepError: a sweep override Optuna has no distribution for.
    """
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(list(arguments)):
        name = override.get_key_element()
        if override.is_sweep_override():
            space[name] = _distribution(override)
        else:
            fixed[name] = override.get_value_element_as_str()
    for name in fixed:  # a value given on the command line wins over the config's range
        space.pop(name, None)
    return space, fixed


def suggest(trial: Any, space: Mapping[str, Any]) -> dict[str, Any]:
    """Draw every parameter of ``space`` from ``trial`` (a retried trial gets its parameters back)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    values = {}
    for name, d in space.items():
        if isinstance(d, FloatDistribution):
            values[name] = trial.suggest_float(name, d.low, d.high, log=d.log, step=d.step)
        elif isinstance(d, IntDistribution):
            values[name] = trial.suggest_int(name, d.low, d.high, log=d.log, step=d.step)
        elif isinstance(d, CategoricalDistribution):
            values[name] = trial.suggest_categorical(name, d.choices)
        else:  # pragma: no cover - search_space builds only the three above
            raise SweepError(f"{name}: no suggestion for {d!r}")
    return values
