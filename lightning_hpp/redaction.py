"""What a secret is, and secrets kept out of everything that leaves the process.

:func:`is_secret_name` and :func:`secret_values` decide what a secret is (a secret-looking name such
as ``api_key`` or ``db_password``, or the value of a secret environment variable such as
``AWS_SECRET_ACCESS_KEY``); :func:`redact` replaces them by :data:`REDACTED` in a string or a
JSON-like structure. It is applied to everything this package writes as JSON (a checkpoint's
``metadata.json`` and JSON parts, the sweep's snapshots), to every warning and error message, and
where values leave the process:

* :func:`redact_loggers` wraps every logger's ``log_hyperparams`` (Lightning's call after setup,
  and any call the user makes), so ``hparams.yaml``, TensorBoard's hparams, MLflow params and the
  like get the hyperparameters with secrets shown as ``***``;
* :func:`secret_overrides` finds command-line overrides that hold a secret, so the entry point can
  refuse them before Hydra prints its ``Error executing job with overrides: [...]`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

SECRET_ENV_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
)
"""Variables whose values are always treated as secrets."""

REDACTED = "***"
"""What a secret is replaced by."""

_SECRET_SUBSTRINGS = ("secret", "password", "passwd", "passphrase")
_SECRET_WORDS = {"credential", "credentials", "apikey"}
_KEY_QUALIFIERS = {"access", "api", "private", "account", "signing", "encryption", "auth"}
_VOCAB_TOKENS = {"pad", "bos", "eos", "unk", "sep", "cls", "mask", "start", "end", "special"}
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_MIN_SECRET_LEN = 6  # shorter values ("1", "true") would redact unrelated text


def is_secret_name(name: str) -> bool:
    """Whether a setting called ``name`` holds a secret (``aws_secret_access_key``, ``token``...).

    Tokenizer settings (``pad_token``, ``eos_token_id``) and the like are not secrets.
    """
    lowered = name.lower()
    if any(word in lowered for word in _SECRET_SUBSTRINGS):
        return True
    parts = [p for p in re.split(r"[^a-z0-9]+", lowered) if p]
    if not parts:
        return False
    if parts in (["key"], ["token"]) or any(p in _SECRET_WORDS for p in parts):
        return True
    prev = parts[-2] if len(parts) > 1 else ""
    if parts[-1] == "token":
        return prev not in _VOCAB_TOKENS
    return parts[-1] == "key" and prev in _KEY_QUALIFIERS


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The secret values currently in the environment, longest first.

    A variable counts when it is one of :data:`SECRET_ENV_VARS` or its name looks like a secret
    (``*SECRET*``, ``*_TOKEN``, ``*PASSWORD*``, ``*_API_KEY``...).
    """
    env = os.environ if env is None else env
    found = {
        value
        for name, value in env.items()
        if value and len(value) >= _MIN_SECRET_LEN and (name in SECRET_ENV_VARS or is_secret_name(name))
    }
    return sorted(found, key=len, reverse=True)


def redact(obj: Any, *, env: Mapping[str, str] | None = None) -> Any:
    """A copy of ``obj`` with secrets replaced by ``"***"``.

    String values under a key that names a secret (``secret``, ``token``, ``password``,
    ``access_key``, ``aws_secret_access_key``, ``key``...) are replaced; any string that contains the value
    of a secret environment variable has it cut out; ``scheme://user:pass@host`` loses its user
    part. Dicts, lists and tuples are walked; other values are returned unchanged.

    Args:
        obj: A string, a JSON-like structure, or anything else.
        env: The environment whose secret values are cut out; ``os.environ`` by default.

    Returns:
        The redacted copy (``obj`` itself is not modified).
    """
    return _redact(obj, secret_values(env))


def _redact(obj: Any, secrets: list[str]) -> Any:
    if isinstance(obj, str):
        for value in secrets:
            if value in obj:
                obj = obj.replace(value, REDACTED)
        return _URL_USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", obj)
    if isinstance(obj, dict):
        return {
            k: (
                REDACTED
                if isinstance(k, str) and isinstance(v, (str, bytes)) and is_secret_name(k)
                else _redact(v, secrets)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_redact(v, secrets) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_redact(v, secrets) for v in obj)
    return obj



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
