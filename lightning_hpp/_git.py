"""The code version of a git tree: its commit and one digest of its uncommitted changes.

Both the environment fingerprint (:func:`lightning_hpp.bias.fingerprint.collect_fingerprint`,
``git_commit`` / ``git_dirty_digest``) and the experiment snapshot
(:func:`lightning_hpp.hydra.snapshot.code_version`) report it from :func:`code_version`, so the two
always agree on the same tree.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

UNTRACKED_LIMIT = 16 * 2**20
"""Untracked files larger than this enter the digest by size and mtime, not by content."""


def git(args: Sequence[str], cwd: str | os.PathLike) -> bytes | None:
    """``git *args`` run in ``cwd``: its stdout, or ``None`` when git is missing or fails."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def code_version(path: str | os.PathLike) -> dict[str, Any]:
    """The git commit of the tree holding ``path`` and a digest of its uncommitted changes.

    The digest covers ``git status``, the diff of tracked files against ``HEAD`` and the content of
    untracked, not ignored files (by size and mtime above :data:`UNTRACKED_LIMIT`), so two runs with
    the same digest ran the same code. Everything is taken from the top of the tree, so any ``path``
    inside one tree gives the same answer.

    Returns:
        ``{"root", "commit", "dirty", "dirty_digest", "changed"}``; ``{"root": None, ...}`` outside git.
        ``dirty_digest`` is ``None`` for a clean tree.
    """
    root = git(["rev-parse", "--show-toplevel"], path)
    if root is None:
        return {"root": None, "commit": None, "dirty": None, "dirty_digest": None, "changed": []}
    top = Path(root.decode().strip())
    commit = (git(["rev-parse", "HEAD"], top) or b"").decode().strip() or None
    status = git(["status", "--porcelain=v1", "--untracked-files=normal"], top) or b""
    changed = [line[3:] for line in status.decode(errors="replace").splitlines() if line]
    if not status.strip():
        return {"root": str(top), "commit": commit, "dirty": False, "dirty_digest": None, "changed": []}
    h = hashlib.sha256(status)
    h.update(git(["diff", "HEAD", "--binary", "--no-ext-diff"], top) or b"")
    untracked = (git(["ls-files", "--others", "--exclude-standard", "-z"], top) or b"").split(b"\0")
    for name in sorted(filter(None, untracked)):
        file = top / name.decode(errors="replace")
        h.update(b"\0" + name + b"\0")
        try:
            size = file.stat().st_size
            h.update(file.read_bytes() if size <= UNTRACKED_LIMIT else f"{size}:{file.stat().st_mtime_ns}".encode())
        except OSError:
            h.update(b"<unreadable>")
    return {"root": str(top), "commit": commit, "dirty": True, "dirty_digest": h.hexdigest()[:16], "changed": changed}
