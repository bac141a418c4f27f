"""S3 access options from the environment, and redaction of secrets.

Credentials are never taken from a config, a checkpoint or a function argument: s3fs (through
botocore) reads ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, the
shared credentials file or an instance role by itself, so no secret ever passes through this
package's objects. What this module adds is the endpoint (``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``, for MinIO, Ceph, moto or any S3-protocol server), the region, and
botocore's own retry configuration: every S3 request (PUT, GET, HEAD, LIST, each part of a
multipart upload) is retried by botocore on connection errors, timeouts, 5xx answers and
throttling, in its ``standard`` or ``adaptive`` mode, up to ``max_attempts`` tries in total. The
configuration is explicit, so ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` in the environment do not
change checkpoint I/O (the count comes from :class:`~lightning_hpp.checkpoint.store.RetryPolicy`).

:func:`redact` is applied to everything this package writes as JSON (``metadata.json``, the JSON
parts of a checkpoint) and to every warning and error message it emits.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from lightning_hpp.errors import S3ConfigError
from lightning_hpp.validation import check_choice, check_int

ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Endpoint variables, most specific first (the names botocore itself understands)."""

SECRET_ENV_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
)
"""Variables whose values are always treated as secrets."""

REDACTED = "***"

RETRY_MODES = ("standard", "adaptive")
"""botocore retry modes that may be asked for (``legacy`` is not: it retries fewer errors)."""

DEFAULT_MAX_ATTEMPTS = 4
"""Tries in total of one S3 request, the first included (``RetryPolicy().attempts``)."""

_SECRET_SUBSTRINGS = ("secret", "password", "passwd", "passphrase")
_SECRET_WORDS = {"credential", "credentials", "apikey"}
_KEY_QUALIFIERS = {"access", "api", "private", "account", "signing", "encryption", "auth"}
_VOCAB_TOKENS = {"pad", "bos", "eos", "unk", "sep", "cls", "mask", "start", "end", "special"}
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_MIN_SECRET_LEN = 6  # shorter values ("1", "true") would redact unrelated text


def s3_storage_options(
    env: Mapping[str, str] | None = None,
    *,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    retry_mode: str = "standard",
) -> dict[str, Any]:
    """fsspec/s3fs options for ``s3://`` URLs: endpoint and region from the environment, retries.

    Args:
        env: The environment to read; ``os.environ`` by default.
        max_attempts: Tries in total of each S3 request, the first included (1 = no retry);
            botocore's ``total_max_attempts``.
        retry_mode: botocore's retry mode, ``"standard"`` or ``"adaptive"`` (standard, plus
            client-side rate limiting when the server throttles).

    Returns:
        Keyword arguments for ``fsspec.url_to_fs(url, **options)``: ``config_kwargs`` (botocore's
        retry configuration, handed by s3fs to ``botocore.config.Config``) and, when set,
        ``client_kwargs`` with the endpoint and region. Never credentials: s3fs finds those itself.

    Raises:
        S3ConfigError: an endpoint variable that is not an ``http(s)://host[:port]`` URL, or a
            retry setting botocore does not accept.
    """
    env = os.environ if env is None else env
    check_int(max_attempts, "s3_storage_options(max_attempts=...)", error=S3ConfigError, hint="1 means no retry.")
    check_choice(retry_mode, "s3_storage_options(retry_mode=...)", RETRY_MODES, error=S3ConfigError)
    # total_max_attempts counts the first try (botocore's own `max_attempts` key counts retries)
    options: dict[str, Any] = {"config_kwargs": {"retries": {"total_max_attempts": max_attempts, "mode": retry_mode}}}
    client_kwargs: dict[str, Any] = {}
    for name in ENDPOINT_ENV_VARS:
        value = env.get(name)
        if value:
            parsed = urlparse(value)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise S3ConfigError(
                    f"{name}={redact(value)!r} is not an endpoint URL; set it to the S3 server's "
                    f"address with its scheme, for example 'http://127.0.0.1:9000'."
                )
            client_kwargs["endpoint_url"] = value
            break
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs["region_name"] = region
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    return options


CREDENTIAL_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


def require_s3_credentials(url: str) -> None:
    """Refuse ``url`` (on S3) early when botocore finds no credentials at all.

    Without this, the first request fails deep inside s3fs with ``NoCredentialsError``.

    Raises:
        S3ConfigError: no credentials in the environment, the shared files or an instance role.
    """
    import botocore.exceptions
    import botocore.session

    try:
        credentials = botocore.session.Session().get_credentials()
    except botocore.exceptions.BotoCoreError as exc:  # a profile that does not exist, a broken config file
        raise S3ConfigError(f"{redact(url)!r} is on S3, but its credentials cannot be read: {exc}.") from None
    if credentials is None:
        raise S3ConfigError(
            f"{redact(url)!r} is on S3, but no S3 credentials were found. Set AWS_ACCESS_KEY_ID and "
            f"AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary credentials), or AWS_PROFILE naming "
            f"a profile of ~/.aws/credentials, or run where an instance role provides them; for a non-AWS "
            f"server also set {ENDPOINT_ENV_VARS[1]}."
        )


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
