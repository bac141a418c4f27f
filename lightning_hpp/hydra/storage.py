"""The study storage: an Optuna RDB storage at an SQLAlchemy URL, or an Optuna journal file.

* ``null`` (the default): an SQLite file in the sweep directory (embedded, nothing to start);
* any SQLAlchemy URL (``postgresql+psycopg2://user@host/db``, ``mysql+pymysql://...``): drivers on
  several machines share one study through the database;
* ``journal:///abs/path/study.log``: Optuna's ``JournalStorage`` on a file, for drivers that share a
  file system but no database server.

Heartbeats: ``RDBStorage`` records them itself; for a journal, :func:`heartbeat_journal_storage` keeps
a trial's last heartbeat as a system attribute, so a driver killed mid-trial is noticed the same way.

:func:`ask_lock` serialises "count the study, then ask it for a trial" between drivers (a PostgreSQL
advisory lock, MySQL's ``GET_LOCK``, a file lock for SQLite and journal files), so concurrent drivers
never start more than ``n_trials`` configurations.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning_hpp.errors import SweepError

log = logging.getLogger(__name__)

DEFAULT_DB = "study.db"
JOURNAL = "journal://"
_HEARTBEAT_ATTR = "lightning_hpp:heartbeat"


def default_url(sweep_dir: str | Path) -> str:
    """``sqlite:///<sweep_dir>/study.db`` (absolute)."""
    path = Path(sweep_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / DEFAULT_DB}"


def journal_path(url: str) -> Path | None:
    """The file of a ``journal:///path`` URL, or None for an SQLAlchemy URL."""
    return Path(url[len(JOURNAL) :]) if str(url).startswith(JOURNAL) else None


def check_url(url: Any) -> str:
    """``url`` as a string, when it is ``journal:///abs/path`` or an SQLAlchemy URL.

    Raises:
        SweepError: neither.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    text = str(url)
    path = journal_path(text)
    if path is not None:
        if not path.is_absolute():
            raise SweepError(
                f"`hydra.sweeper.storage={text!r}` names a relative journal file; give an absolute path, "
                f"`journal:///shared/fs/study.log` (three slashes), that every driver sees."
            )
        return text
    try:
        make_url(text)
    except ArgumentError:
        raise SweepError(
            f"`hydra.sweeper.storage={url!r}` is not an SQLAlchemy URL; use null (an SQLite file in the sweep "
            f"directory), `sqlite:////abs/path/study.db`, `postgresql+psycopg2://user@host/db` or "
            f"`journal:///abs/path/study.log` (Optuna's JournalStorage on a shared file system)."
        ) from None
    return text


def public_url(url: str) -> str:
    """``url`` with its password hidden (what logs and ``summary.json`` show)."""
    from sqlalchemy.engine import make_url

    if journal_path(url) is not None:
        return url
    return make_url(url).render_as_string(hide_password=True)


def open_storage(
    url: str,
    *,
    heartbeat_interval: int | None = None,
    grace_period: int | None = None,
    stale_trial_callback: Callable[..., None] | None = None,
) -> Any:
    """The Optuna storage at ``url``: ``RDBStorage`` for an SQLAlchemy URL, a journal file otherwise.

    Args:
        url: ``journal:///path`` or an SQLAlchemy URL.
        heartbeat_interval: Seconds between a running trial's heartbeats (None: no heartbeats).
        grace_period: Seconds without a heartbeat after which a running trial is stale (None: 2 x interval).
        stale_trial_callback: Called with each trial failed for being stale (``RetryHeartbeatStaleTrialCallback``).
    """
    import optuna

    path = journal_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = optuna.storages.journal.JournalFileBackend(
            str(path), lock_obj=optuna.storages.journal.JournalFileOpenLock(str(path))
        )
        if heartbeat_interval is None:
            return optuna.storages.JournalStorage(backend)
        return heartbeat_journal_storage(backend, heartbeat_interval, grace_period, stale_trial_callback)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    kwargs: dict[str, Any] = {}
    # wait for another connection's write (a driver, a trial) instead of failing after 5 s
    if str(url).startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    # drivers that start at once on a new database would each create Optuna's tables, and all but one
    # fail (PostgreSQL: duplicate key in pg_type): one at a time creates them, the others find them
    with _schema_lock(url):
        return optuna.storages.RDBStorage(
            url,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            heartbeat_stale_trial_callback=stale_trial_callback,
            **kwargs,
        )


@contextlib.contextmanager
def _schema_lock(url: str) -> Iterator[None]:
    """Hold the database's schema lock while Optuna creates (or finds) its tables; SQLite needs none."""
    if str(url).startswith("sqlite"):
        yield
        return
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, poolclass=NullPool)
    try:
        with _database_lock(engine, "lightning_hpp:schema"):
            yield
    finally:
        engine.dispose()


def heartbeat_journal_storage(backend: Any, heartbeat_interval: int, grace_period: int | None, callback: Any) -> Any:
    """A ``JournalStorage`` with heartbeats (Optuna keeps them for ``RDBStorage`` only).

    A running trial's last heartbeat is its system attribute ``lightning_hpp:heartbeat`` (its start
    before the first one), so Optuna's ``fail_stale_trials`` and ``RetryHeartbeatStaleTrialCallback`` work on a
    journal as on a database. (A class made here: Optuna is imported only when a sweep runs.)
    """
    import optuna
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.trial import TrialState

    class HeartbeatJournalStorage(optuna.storages.JournalStorage, BaseHeartbeat):
        def record_heartbeat(self, trial_id: int) -> None:
            self.set_trial_system_attr(trial_id, _HEARTBEAT_ATTR, time.time())

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            now, stale = time.time(), []
            for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                # a retry inherits its original's system attributes: its own start counts as a heartbeat
                last = max(float(t.system_attrs.get(_HEARTBEAT_ATTR, 0.0)), t.datetime_start.timestamp())
                if now - last > (grace_period if grace_period is not None else 2 * heartbeat_interval):
                    stale.append(t._trial_id)
            return stale

        def get_heartbeat_interval(self) -> int | None:
            return heartbeat_interval

        def get_heartbeat_stale_trial_callback(self) -> Any:
            return callback

    return HeartbeatJournalStorage(backend)


@contextlib.contextmanager
def ask_lock(storage: Any, url: str, study_name: str) -> Iterator[bool]:
    """Hold the study's ask lock: one driver at a time counts the study's trials and asks for one.

    PostgreSQL: a session advisory lock; MySQL / MariaDB: ``GET_LOCK``; SQLite and journal files: an
    ``flock`` on ``<file>.ask.lock``. A lock held by a driver that dies is released with its connection
    or file descriptor. Yields True when a lock is held; False for another database (no lock: concurrent
    drivers may then start one configuration each beyond ``n_trials``).
    """
    path = journal_path(url)
    if path is None and url.startswith("sqlite"):
        from sqlalchemy.engine import make_url

        database = make_url(url).database
        path = Path(database) if database and database != ":memory:" else None
    if path is not None:
        with open(f"{path}.ask.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return
    if not hasattr(storage, "engine"):
        yield False
        return
    with _database_lock(storage.engine, f"lightning_hpp:{study_name}") as held:
        yield held


@contextlib.contextmanager
def _database_lock(engine: Any, key: str) -> Iterator[bool]:
    """A lock named ``key`` on the database: PostgreSQL's advisory lock, MySQL's ``GET_LOCK``; released
    at the end or with the connection. Yields False (no lock) on other databases."""
    dialect = engine.dialect.name
    if dialect not in ("postgresql", "mysql", "mariadb"):
        yield False
        return
    from sqlalchemy import text

    with engine.connect() as connection:
        if dialect == "postgresql":
            lock, unlock = "SELECT pg_advisory_lock(:k)", "SELECT pg_advisory_unlock(:k)"
            args = {"k": zlib.crc32(key.encode())}
        else:
            lock, unlock = "SELECT GET_LOCK(:k, 3600)", "SELECT RELEASE_LOCK(:k)"
            args = {"k": key[:64]}
        connection.execute(text(lock), args)
        connection.commit()
        try:
            yield True
        finally:
            connection.execute(text(unlock), args)
            connection.commit()
