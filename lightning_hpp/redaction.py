"""Secrets kept out of what loggers record and what the command line echoes.

:func:`~lightning_hpp.checkpoint.s3.redact` decides what a secret is (a secret-looking name such
as ``api_key`` or ``db_password``, or the value of a secret environment variable such as
``AWS_SECRET_ACCESS_KEY``); this module applies it where values leave the process:

* :func:`redact_loggers` wraps every logger's ``log_hyperparams`` (Lightning's call after setup,
  and any call the user makes), so ``hparams.yaml``, TensorBoard's hparams, MLflow params and the
  like get the hyperparameters with secrets shown as ``***``;
* :func:`secret_overrides` finds command-line overrides that hold a secret, so the entry point can
  refuse them before Hydra prints its ``Error executing job with overrides: [...]`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_hpp.checkpoint.s3 import REDACTED, is_secret_name, redact


class _RedactedLogHyperparams:
    """A logger's ``log_hyperparams`` that hands it the hyperparameters with secrets redacted."""

    def __init__(self, log_hyperparams: Any) -> None:
        self.wrapped = log_hyperparams

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(redacted_hparams(params), *args, **kwargs)


def redact_loggers(loggers: Iterable[Any]) -> None:
    """Make every logger in ``loggers`` redact the hyperparameters it is given (idempotent)."""
    for logger in loggers:
        current = getattr(logger, "log_hyperparams", None)
        if current is not None and not isinstance(current, _RedactedLogHyperparams):
            logger.log_hyperparams = _RedactedLogHyperparams(current)


def redacted_hparams(params: Any) -> Any:
    """``params`` (a dict, ``AttributeDict``, ``Namespace``, OmegaConf config, dataclass) as plain
    containers with every secret replaced by ``***``."""
    return redact(_plain(params))


def _plain(obj: Any) -> Any:
    if type(obj).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            return _plain(OmegaConf.to_container(obj, resolve=True))
        except OmegaConfBaseException:  # an interpolation that cannot resolve here: keep its text
            return _plain(OmegaConf.to_container(obj, resolve=False))
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj


def _secret_key_in(obj: Any) -> bool:
    if isinstance(obj, Mapping):
        return any((isinstance(k, str) and is_secret_name(k)) or _secret_key_in(v) for k, v in obj.items())
    return isinstance(obj, list) and any(_secret_key_in(v) for v in obj)


def secret_overrides(args: Iterable[str], env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """The command-line arguments that hold a secret, as ``(key, argument redacted)`` pairs.

    An override holds a secret when its key names one (``model.api_token=...``), when its value is a
    dict with such a key (``+storage={secret: ...}``), or when any argument contains the value of a
    secret environment variable.

    Args:
        args: The command line after the program name (``sys.argv[1:]``).
        env: The environment whose secret values count; ``os.environ`` by default.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    found = []
    for arg in args:
        shown = redact(arg, env=env)
        key = arg.split("=", 1)[0].lstrip("+~")
        if shown != arg:
            found.append((key, shown))
            continue
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:  # Hydra reports a malformed override itself
            continue
        value = override.value()
        leaf = override.key_or_group.split(".")[-1].split("@")[0]
        if is_secret_name(leaf) or _secret_key_in(value):
            found.append((override.key_or_group, f"{arg.split('=', 1)[0]}={REDACTED}"))
    return found
