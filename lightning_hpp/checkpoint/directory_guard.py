"""A sharded checkpoint handed to a one-file loader fails with the export command to run, not a bare
``IsADirectoryError``.

Under HPPStrategy a ``ModelCheckpoint`` path (``.../last.ckpt``) is a directory of shards. Handed to
``MyModule.load_from_checkpoint(path)``, ``torch.load(path)`` or a Trainer of another strategy
(``ckpt_path=path``), it used to fail inside ``open`` with ``[Errno 21] Is a directory`` and no hint. With
lightning_hpp imported, those calls raise :class:`~lightning_hpp.errors.ShardedCheckpointError` instead,
whose message names the command that makes one file of it (``python -m lightning_hpp.checkpoint.export
<path> model.ckpt``) and the way to resume from it as it is.

How, and why so: there is no hook in ``torch.load`` or in Lightning's loading path, so :func:`install`
wraps the three one-file loaders by name — ``torch.load``, and ``pl_load`` as
``lightning.pytorch.core.saving`` (``load_from_checkpoint``) and ``lightning.fabric.plugins.io.torch_io``
(``TorchCheckpointIO``, the Trainer's and Fabric's ``ckpt_path``) imported it. The wrapper is the narrowest
that works: it calls the original with the same arguments and returns its result untouched; only when the
original raises an ``OSError`` for a path argument, and that path is a lightning_hpp checkpoint (a directory
holding ``metadata.json``, or a root holding ``step-<N>`` ones), is the error replaced, chained to the
original. Every other call and every other error is exactly as before, and the cost of a call that succeeds
is one ``try``. The new error subclasses ``IsADirectoryError`` (and ``CheckpointError``), so code catching
the old one still does. Rejected: an exception note (shown in tracebacks but absent from ``str(exc)``, which
is what logs and test runners print), a ``sys.excepthook`` (not run in notebooks, nor for caught errors),
and wrapping ``LightningModule.load_from_checkpoint`` (a descriptor of Lightning's own, and it would miss
``torch.load``). HPPStrategy's own loading of these directories does not pass through any of the three.
"""

from __future__ import annotations

import functools
import os
import shlex
from collections.abc import Callable
from typing import Any

import torch

from lightning_hpp.checkpoint.commit import METADATA_FILE
from lightning_hpp.checkpoint.discovery import step_dirs
from lightning_hpp.checkpoint.storage import filesystem
from lightning_hpp.errors import ShardedCheckpointError

_GUARDED = "__lightning_hpp_guard__"


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` (local or fsspec URL) is a lightning_hpp checkpoint directory or a root of them."""
    try:
        fs, p = filesystem(path)
        if not fs.isdir(p):
            return False
        return fs.isfile(f"{p.rstrip('/')}/{METADATA_FILE}") or bool(step_dirs(path))
    except Exception:  # noqa: BLE001 - only deciding whether to add a hint; the original error stands otherwise
        return False


def hint(path: str) -> str:
    """The message for a sharded checkpoint at ``path`` handed to a one-file loader."""
    quoted = shlex.quote(path)
    return (
        f"{path!r} is a sharded lightning_hpp checkpoint (a directory HPPStrategy wrote, one file per rank), not "
        f"one file, so `torch.load` and `load_from_checkpoint` cannot read it. Export it once to one Lightning "
        f"checkpoint, then load that:\n"
        f"    python -m lightning_hpp.checkpoint.export {quoted} model.ckpt\n"
        f"    MyModule.load_from_checkpoint('model.ckpt')\n"
        f"(add `--module package.module:MyModule` to check it against your module; `--hf --module ...` writes the "
        f"transformers model inside in `save_pretrained` format). To resume training from it as it is, pass it "
        f"as `ckpt_path` to a Trainer with `strategy=HPPStrategy(...)`."
    )


def guarded(load: Callable[..., Any], path_arg: str) -> Callable[..., Any]:
    """``load`` whose ``OSError`` on a sharded checkpoint path becomes :class:`ShardedCheckpointError`.

    Args:
        load: A loader whose first argument (or keyword ``path_arg``) is a path, URL or file object.
        path_arg: That argument's name.
    """
    if getattr(load, _GUARDED, False):
        return load

    @functools.wraps(load)
    def guard(*args: Any, **kwargs: Any) -> Any:
        try:
            return load(*args, **kwargs)
        except OSError as exc:
            where = args[0] if args else kwargs.get(path_arg)
            if isinstance(where, (str, os.PathLike)) and is_sharded_checkpoint(os.fspath(where)):
                raise ShardedCheckpointError(hint(os.fspath(where))) from exc
            raise

    setattr(guard, _GUARDED, True)
    return guard


def install() -> None:
    """Guard ``torch.load`` and Lightning's one-file loaders (idempotent)."""
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving

    torch.load = guarded(torch.load, "f")
    saving.pl_load = guarded(saving.pl_load, "path_or_url")
    torch_io.pl_load = guarded(torch_io.pl_load, "path_or_url")
