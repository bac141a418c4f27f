"""Consolidate a sharded checkpoint into one standard Lightning ``.ckpt`` for inference.

The result loads with ``MyModule.load_from_checkpoint(path)`` (or ``torch.load``) anywhere, with
no distributed setup and no HPPStrategy. It holds ``state_dict`` (the whole model under the
LightningModule's own names), ``hyper_parameters`` (when the checkpoint has them),
``pytorch-lightning_version``, ``epoch`` and ``global_step``.

Command line::

    python -m lightning_hpp.checkpoint.export SRC DST.ckpt [--module pkg.module:MyModule]

``SRC`` is a checkpoint directory (``.../step-<N>``) or a root holding several, in which case the
newest valid one is exported. Both may be local paths or fsspec URLs (``s3://...``).

Entries read from the sharded checkpoint: ``model`` (required: parameter name -> tensor), and,
when present, ``hyper_parameters``, ``epoch`` and ``global_step`` (else the step from
``metadata.json`` and epoch 0).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from collections import OrderedDict
from typing import Any

import fsspec
import lightning
import torch

from lightning_hpp.checkpoint.sharded import checkpoint_keys, load_sharded
from lightning_hpp.checkpoint.store import METADATA_FILE, filesystem, latest_valid, verify
from lightning_hpp.errors import CheckpointError

_OPTIONAL = ("hyper_parameters", "epoch", "global_step")


def _resolve_source(src_url: str) -> str:
    fs, path = filesystem(src_url)
    fs.invalidate_cache(path)
    if fs.exists(f"{path.rstrip('/')}/{METADATA_FILE}"):
        return src_url
    newest = latest_valid(src_url)
    if newest is None:
        raise CheckpointError(
            f"export source {src_url!r} is neither a committed checkpoint (no {METADATA_FILE}) "
            f"nor a directory holding a valid `step-<N>` checkpoint. Pass a checkpoint directory "
            f"such as '<root>/step-100' or its root."
        )
    return newest.url


def export_to_lightning_ckpt(
    src_url: str,
    dst_path: str,
    module_cls: type | None = None,
    *,
    checksums: bool = True,
) -> dict[str, Any]:
    """Write the model of a sharded checkpoint as one Lightning ``.ckpt``.

    Args:
        src_url: Checkpoint directory, or a root whose newest valid checkpoint is taken.
        dst_path: Output file (path or fsspec URL).
        module_cls: Optional LightningModule class: the export is checked against
            ``module_cls(**hyper_parameters)`` (every key present, none extra, same shapes) and
            written in that module's key order.
        checksums: Verify every shard's sha256 before exporting.

    Returns:
        A summary: ``src`` (the checkpoint used), ``dst``, ``step``, ``tensors``, ``bytes``.

    Raises:
        CheckpointError: no usable checkpoint, no ``model`` entry, or a model that does not match
            ``module_cls``.
    """
    ckpt_url = _resolve_source(src_url)
    info = verify(ckpt_url, checksums=checksums)
    tops = {path[0] for path in checkpoint_keys(ckpt_url)}
    if "model" not in tops:
        raise CheckpointError(
            f"{ckpt_url!r} has no 'model' entry (it holds {sorted(map(str, tops))}); export needs "
            f"the model saved under state['model'] as parameter name -> tensor."
        )
    template: dict[str, Any] = {"model": None, **{k: None for k in _OPTIONAL if k in tops}}
    state = load_sharded(ckpt_url, template)
    model = state["model"]
    if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise CheckpointError(f"{ckpt_url!r}: state['model'] is not a mapping of names to tensors.")

    hparams = state.get("hyper_parameters")
    if hparams is None:
        hparams = (info.metadata.get("extra") or {}).get("hyper_parameters")
    state_dict = OrderedDict(model)
    if module_cls is not None:
        state_dict = _check_against(module_cls, hparams, state_dict, ckpt_url)

    ckpt: dict[str, Any] = {
        "state_dict": state_dict,
        "pytorch-lightning_version": lightning.__version__,
        "epoch": int(state.get("epoch", 0)),
        "global_step": int(state.get("global_step", info.step)),
    }
    if hparams is not None:
        ckpt["hyper_parameters"] = hparams
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    data = buffer.getvalue()
    _write(dst_path, data)
    return {"src": ckpt_url, "dst": str(dst_path), "step": info.step, "tensors": len(state_dict), "bytes": len(data)}


def _check_against(
    module_cls: type, hparams: Any, state_dict: OrderedDict[str, torch.Tensor], ckpt_url: str
) -> OrderedDict[str, torch.Tensor]:
    module = module_cls(**(hparams or {}))
    expected = module.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    wrong = [
        f"{k}: {list(state_dict[k].shape)} vs {list(v.shape)}"
        for k, v in expected.items()
        if k in state_dict and state_dict[k].shape != v.shape
    ]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{ckpt_url!r} does not match {module_cls.__name__}: missing {missing[:8]}, unexpected "
            f"{unexpected[:8]}, shape mismatches {wrong[:8]}. Export with the LightningModule class "
            f"that was trained, or without `module_cls`."
        )
    return OrderedDict((k, state_dict[k]) for k in expected)


def _write(dst_path: str, data: bytes) -> None:
    fs, path = filesystem(dst_path)
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def _import_class(spec: str) -> type:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CheckpointError(f"--module {spec!r} must look like 'package.module:ClassName'.")
    return getattr(importlib.import_module(module_name), attr)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hpp.checkpoint.export",
        description="Consolidate a sharded lightning_hpp checkpoint into one Lightning .ckpt.",
    )
    parser.add_argument("src", help="checkpoint directory (.../step-N) or a root holding several")
    parser.add_argument("dst", help="output .ckpt path or URL")
    parser.add_argument("--module", help="LightningModule to check against, as 'package.module:Class'")
    parser.add_argument("--no-checksums", action="store_true", help="skip sha256 verification of the shards")
    args = parser.parse_args(argv)
    try:
        module_cls = _import_class(args.module) if args.module else None
        summary = export_to_lightning_ckpt(args.src, args.dst, module_cls, checksums=not args.no_checksums)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"exported {summary['src']} (step {summary['step']}, {summary['tensors']} tensors) "
        f"-> {summary['dst']} ({summary['bytes'] / 2**20:.1f} MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
