"""The study database: an Optuna RDB storage at an SQLAlchemy URL.

An SQLite file in the sweep directory by default (embedded, nothing to start); any SQLAlchemy URL
(``postgresql://user@host/db``, ``mysql+pymysql://...``) lets drivers on several machines share one
study. :func:`open_storage` also works around optuna 2.10 under SQLAlchemy 2: optuna stamps a new
database's schema revision (alembic) on a connection it never commits, so the next open fails its
schema check; the stamp is written here in a committed transaction first.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

from lightning_hpp.errors import SweepError

DEFAULT_DB = "study.db"


def default_url(sweep_dir: str | Path) -> str:
    """``sqlite:///<sweep_dir>/study.db`` (absolute)."""
    path = Path(sweep_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / DEFAULT_DB}"


def check_url(url: Any) -> str:
    """``url`` as a string, when SQLAlchemy can parse it.

    Raises:
        SweepError: not an SQLAlchemy URL.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(str(url))
    except ArgumentError:
        raise SweepError(
            f"`hydra.sweeper.storage={url!r}` is not an SQLAlchemy URL; use null (an SQLite file in the sweep "
            f"directory), `sqlite:////abs/path/study.db` or `postgresql://user@host/db`."
        ) from None
    return str(url)


def public_url(url: str) -> str:
    """``url`` with its password hidden (what logs and ``summary.json`` show)."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def open_storage(url: str, **kwargs: Any) -> Any:
    """An ``optuna.storages.RDBStorage`` at ``url`` whose schema revision is committed.

    Args:
        url: The SQLAlchemy URL.
        **kwargs: ``RDBStorage`` options (``heartbeat_interval``, ``grace_period``, ``failed_trial_callback``).
    """
    import optuna
    from alembic.migration import MigrationContext

    logging.getLogger("alembic").setLevel(logging.WARNING)
    if str(url).startswith("sqlite"):  # wait for another connection's write (a driver, a trial) instead of failing after 5 s
        engine_kwargs = kwargs.setdefault("engine_kwargs", {})
        engine_kwargs.setdefault("connect_args", {}).setdefault("timeout", 60)
    storage = optuna.storages.RDBStorage(url, skip_compatibility_check=True, **kwargs)
    versions = storage._version_manager
    # optuna's own stamp ran on a connection it never closed (SQLAlchemy 2 does not commit it): until that object is
    # collected, its transaction holds SQLite's write lock, and the stamp below waits for it
    gc.collect()
    with storage.engine.begin() as connection:
        context = MigrationContext.configure(connection)
        if context.get_current_revision() is None:
            context.stamp(versions._create_alembic_script(), versions.get_head_version())
    versions.check_table_schema_compatibility()
    return storage
