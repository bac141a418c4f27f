"""S3 access options from the environment.

Credentials are never taken from a config, a checkpoint or a function argument: s3fs (through
botocore) reads ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, the
shared credentials file or an instance role by itself, so no secret ever passes through this
package's objects. What this module adds is the endpoint (``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``, for MinIO, Ceph, moto or any S3-protocol server), the region, and
botocore's own retry configuration: every S3 request (PUT, GET, HEAD, LIST, each part of a
multipart upload) is retried by botocore on connection errors, timeouts, 5xx answers and
throttling, in its ``standard`` or ``adaptive`` mode, up to ``max_attempts`` tries in total. The
configuration is explicit, so ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` in the environment do not
change checkpoint I/O (the count comes from :class:`~lightning_hpp.checkpoint.retry.RetryPolicy`).

Secrets (a credential's value, a secret-looking setting) are cut out of every message by
:func:`lightning_hpp.redaction.redact`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from lightning_hpp.errors import S3ConfigError
from lightning_hpp.redaction import redact
from lightning_hpp.validation import check_choice, check_int

ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Endpoint variables, most specific first (the names botocore itself understands)."""

RETRY_MODES = ("standard", "adaptive")
"""botocore retry modes that may be asked for (``legacy`` is not: it retries fewer errors)."""

DEFAULT_MAX_ATTEMPTS = 4
"""Tries in total of one S3 request, the first included (``RetryPolicy().attempts``)."""



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
