"""Consolidate a sharded checkpoint for inference: one Lightning ``.ckpt``, or a transformers model.

The ``.ckpt`` loads with ``MyModule.load_from_checkpoint(path)`` (strictly) or ``torch.load`` anywhere, with
no distributed setup and no HPPStrategy. It holds ``state_dict`` (the whole model under the LightningModule's
own names, a tied tensor under every one of its names: :mod:`~lightning_hpp.checkpoint.model_source`),
``hyper_parameters`` and ``hparams_name`` (when the checkpoint has them), ``pytorch-lightning_version``,
``epoch`` and ``global_step``.

With ``--hf``, DST is a directory in transformers' ``save_pretrained`` format, written from the
``PreTrainedModel`` inside the LightningModule one tensor at a time
(:mod:`~lightning_hpp.checkpoint.pretrained`); ``AutoModelForCausalLM.from_pretrained(DST)`` loads it.

Command line::

    python -m lightning_hpp.checkpoint.export SRC DST.ckpt [--module pkg.module:MyModule]
    python -m lightning_hpp.checkpoint.export SRC DST_DIR --hf --module pkg.module:MyModule
        [--hf-prefix model] [--max-shard-size 5GB]

``SRC`` is a checkpoint directory (``.../step-<N>``, a ``ModelCheckpoint`` path such as ``.../last.ckpt``)
or a root holding several, in which case the newest valid one is exported. Both may be local paths or
fsspec URLs (``s3://...``). ``--module`` names the LightningModule that was trained: it is built from the
checkpoint's hyper-parameters on the meta device (no memory), the ``.ckpt`` is checked against it and
written in its key order, and ``--hf`` finds its transformers model in it.

Entries read from the sharded checkpoint: ``model`` (required: parameter name -> tensor), and, when
present, ``position_pp<r>/tied`` (the names of tied tensors), ``hyper_parameters``, ``hparams_name``,
``epoch`` and ``global_step`` (else the step from ``metadata.json`` and epoch 0).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections import OrderedDict
from typing import Any

import fsspec
import lightning
import torch

from lightning_hpp.checkpoint.model_source import module_on_meta, open_saved_model, source_names, warn_if_ties_unknown
from lightning_hpp.checkpoint.storage import filesystem
from lightning_hpp.checkpoint.warning import CheckpointWarning
from lightning_hpp.errors import CheckpointError


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
            ``module_cls(**hyper_parameters)``, built on the meta device (every key present, none extra,
            same shapes) and written in that module's key order.
        checksums: Verify every shard's sha256 before exporting.

    Returns:
        A summary: ``src`` (the checkpoint used), ``dst``, ``step``, ``tensors`` (names written, a tied
        tensor's every name counted), ``bytes``.

    Raises:
        CheckpointError: no usable checkpoint, no ``model`` entry, a tied name whose saved tensor is
            missing, or a model that does not match ``module_cls``.
    """
    saved = open_saved_model(src_url, checksums=checksums)
    if module_cls is None:
        warn_if_ties_unknown(saved)
    names = source_names(saved, module_on_meta(module_cls, saved) if module_cls is not None else None)
    model = saved.read_all()
    state_dict = OrderedDict((name, model[src]) for name, src in names.items())  # a tied tensor: one storage

    facts = saved.facts
    ckpt: dict[str, Any] = {
        "state_dict": state_dict,
        "pytorch-lightning_version": lightning.__version__,
        "epoch": int(facts.get("epoch") or 0),
        "global_step": int(facts.get("global_step", saved.info.step)),
    }
    if facts.get("hyper_parameters") is not None:
        ckpt["hyper_parameters"] = facts["hyper_parameters"]
        if facts.get("hparams_name") is not None:
            ckpt["hparams_name"] = facts["hparams_name"]
    size = _save(ckpt, dst_path)
    return {"src": saved.url, "dst": str(dst_path), "step": saved.info.step, "tensors": len(state_dict),
            "bytes": size}


def _save(ckpt: dict[str, Any], dst_path: str) -> int:
    """``torch.save`` straight into the destination (a local file appears whole, by rename); returns its size."""
    fs, path = filesystem(dst_path)
    local = isinstance(fs, fsspec.implementations.local.LocalFileSystem)
    if local:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    target = f"{path}.tmp-{os.getpid()}" if local else path
    try:
        with fs.open(target, "wb") as f:
            torch.save(ckpt, f)
            size = f.tell()
    except BaseException:
        if local and os.path.exists(target):
            os.remove(target)
        raise
    if local:
        os.replace(target, path)
    return size


def _import_class(spec: str) -> type:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CheckpointError(f"--module {spec!r} must look like 'package.module:ClassName'.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(f"--module {spec!r} cannot be imported ({type(exc).__name__}: {exc}); run the export "
                              f"where the LightningModule's package is importable (PYTHONPATH).") from exc


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hpp.checkpoint.export",
        description="Consolidate a sharded lightning_hpp checkpoint into one Lightning .ckpt, or (--hf) write the "
                    "transformers model inside the LightningModule in save_pretrained format.",
    )
    parser.add_argument("src", help="checkpoint directory (.../step-N, a ModelCheckpoint path) or a root of several")
    parser.add_argument("dst", help="output .ckpt path or URL; with --hf, an output directory")
    parser.add_argument("--module", help="the LightningModule that was trained, as 'package.module:Class' (built on "
                                         "the meta device from the saved hyper-parameters; required by --hf)")
    parser.add_argument("--hf", action="store_true",
                        help="write DST as transformers' save_pretrained directory (safetensors, config.json), "
                             "one tensor at a time")
    parser.add_argument("--hf-prefix", metavar="NAME",
                        help="with --hf: the attribute holding the PreTrainedModel (default: the only one)")
    parser.add_argument("--max-shard-size", default="50GB",
                        help="with --hf: split the weights into files of at most this size, with an index "
                             "(save_pretrained's max_shard_size; default 50GB)")
    parser.add_argument("--no-checksums", action="store_true", help="skip sha256 verification of the shards")
    args = parser.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        status = _run(args)
    for w in caught:
        print(f"warning: {w.message}" if issubclass(w.category, CheckpointWarning) else
              warnings.formatwarning(w.message, w.category, w.filename, w.lineno).rstrip(), file=sys.stderr)
    return status


def _run(args: argparse.Namespace) -> int:
    try:
        if not args.hf and (args.hf_prefix is not None or args.max_shard_size != "50GB"):
            raise CheckpointError("--hf-prefix and --max-shard-size apply to the --hf export only; add --hf.")
        if args.hf and not args.module:
            raise CheckpointError(
                "--hf needs --module package.module:MyModule, the LightningModule that was trained: the export "
                "builds it on the meta device to find the transformers model inside and its config."
            )
        module_cls = _import_class(args.module) if args.module else None
        if args.hf:
            from lightning_hpp.checkpoint.pretrained import export_to_pretrained

            summary = export_to_pretrained(args.src, args.dst, module_cls, prefix=args.hf_prefix,
                                           max_shard_size=_shard_size(args.max_shard_size),
                                           checksums=not args.no_checksums)
        else:
            summary = export_to_lightning_ckpt(args.src, args.dst, module_cls, checksums=not args.no_checksums)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = f"{summary['class']} at {summary['prefix']!r}, " if args.hf else ""
    print(
        f"exported {summary['src']} (step {summary['step']}, {what}{summary['tensors']} tensors) "
        f"-> {summary['dst']} ({summary['bytes'] / 2**20:.1f} MiB)"
    )
    return 0


def _shard_size(text: str) -> int | str:
    return int(text) if text.isdigit() else text


if __name__ == "__main__":
    sys.exit(main())
