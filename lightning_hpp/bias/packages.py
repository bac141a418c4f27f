"""The installed distributions (``name==version``), as the environment fingerprint and the experiment
snapshot record them, cached across processes.

Reading every distribution's metadata (a few hundred ``METADATA`` files) takes 0.2-1.4 s on a loaded
2-core machine, and every rank does it at every fit start: a restarted job pays it again before its
first step. The list depends only on the directories of the import path, so it is cached in one file
(``$XDG_CACHE_HOME/lightning_hpp/``, default ``~/.cache/lightning_hpp/``) under a key made of the
interpreter, every ``sys.path`` entry and the modification time of each entry that holds distributions:
installing, removing or upgrading one (pip, uv, conda, an editable install) adds or removes its
``*.dist-info`` directory, which changes the time of the directory holding it, so the key changes and the
list is read again. A cache that cannot be read or
written is not an error: the list is then read from the metadata, as without a cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

CACHE_FILE = "installed-packages.json"
_METADATA = (".dist-info", ".egg-info")

_memo: dict[str, list[str]] = {}


def installed_packages() -> list[str]:
    """Every installed distribution as ``name==version`` (lower case, ``_`` as ``-``), sorted."""
    key = _path_key()
    if key not in _memo:
        _memo[key] = _cached(key)
    return list(_memo[key])


def packages_digest() -> str:
    """16 hex digits of sha256 over :func:`installed_packages`, one per line."""
    return hashlib.sha256("\n".join(installed_packages()).encode()).hexdigest()[:16]


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_hpp" / CACHE_FILE


def read_installed_packages() -> list[str]:
    """The list from the distributions' metadata, without the cache."""
    names = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") if dist.metadata is not None else None
        if name:
            names.add(f"{name.lower().replace('_', '-')}=={dist.version}")
    return sorted(names)


def _path_key() -> str:
    """The interpreter and, per ``sys.path`` entry, the modification time of the entry if it holds
    distributions (``*.dist-info`` / ``*.egg-info``, or is an archive), else ``-``: an entry that holds none,
    such as the script's directory, may change all the time without changing the list."""
    parts = [sys.executable]
    for entry in sys.path:
        path = entry or "."
        try:
            holds = os.path.isfile(path) or any(n.endswith(_METADATA) for n in os.listdir(path))
            parts.append(f"{entry}\0{os.stat(path).st_mtime_ns if holds else '-'}")
        except OSError:
            parts.append(f"{entry}\0?")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _cached(key: str) -> list[str]:
    path = cache_path()
    try:
        held = json.loads(path.read_text())
        if held.get("key") == key and isinstance(held.get("packages"), list):
            return [str(p) for p in held["packages"]]
    except (OSError, ValueError, AttributeError):
        pass
    packages = read_installed_packages()
    try:  # ranks that start together each write their own file and rename it into place
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CACHE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "packages": packages}))
        os.replace(tmp, path)
    except OSError:
        pass
    return packages
