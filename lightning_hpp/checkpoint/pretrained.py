"""A transformers model inside a LightningModule, written from a sharded checkpoint in ``save_pretrained`` format.

``self.model = GPT2LMHeadModel(config)`` trained under HPPStrategy leaves its weights spread over the
stages' shards, under the LightningModule's names (``model.transformer.wte.weight``). This writes the
directory ``PreTrainedModel.save_pretrained`` would write for that model — ``config.json``,
``generation_config.json`` where transformers writes one, ``model.safetensors`` or, above ``max_shard_size``,
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` — so that
``AutoModelForCausalLM.from_pretrained(dir)`` (or the class's own) loads the trained weights.

* **Which model, which prefix.** The LightningModule is built on the meta device from the checkpoint's
  hyper-parameters (:func:`~lightning_hpp.checkpoint.model_source.module_on_meta`); the outermost
  ``PreTrainedModel`` in it is the one written (``prefix`` chooses when there are several), its config is the
  one the run trained with.
* **Which keys.** transformers decides them on that meta model, with the steps ``save_pretrained`` takes:
  ``_keys_to_ignore_on_save`` dropped, tied weights kept under the name transformers reloads them from
  (``remove_tied_weights_from_state_dict``), renamings reverted (``revert_weight_conversion``). A model
  whose saved weights are computed from its tensors (a conversion beyond renaming: Mixtral's fused experts
  saved expert by expert) is refused with the way round it. Each kept key is read under the name the
  checkpoint saved its tensor as (a tied weight may be saved under its other name).
* **Which files.** ``huggingface_hub.split_torch_state_dict_into_shards`` on meta tensors of the saved
  shapes and dtypes: the same files, names and index as ``save_pretrained`` with the same
  ``max_shard_size``; the config records the dtype of the saved weights, as ``save_pretrained`` records
  the model's.
* **Memory: one tensor.** Each file's header follows from the shapes alone; its tensors are then read from
  the checkpoint one by one (:meth:`~lightning_hpp.checkpoint.model_source.SavedModel.read`) and streamed
  into the file (:mod:`~lightning_hpp.checkpoint.safetensors_stream`), on a local disk or any fsspec URL.

Needs transformers >= 5 (the functions above) and huggingface_hub.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

import torch

from lightning_hpp.checkpoint import safetensors_stream
from lightning_hpp.checkpoint.model_source import SavedModel, module_on_meta, open_saved_model, source_names
from lightning_hpp.checkpoint.storage import filesystem
from lightning_hpp.errors import CheckpointError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_STALE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def export_to_pretrained(src_url: str, dst_url: str, module_cls: type, *, prefix: str | None = None,
                         max_shard_size: int | str = "50GB", checksums: bool = True) -> dict[str, Any]:
    """Write the transformers model inside ``module_cls`` from a sharded checkpoint, as ``save_pretrained`` does.

    Args:
        src_url: Checkpoint directory, or a root whose newest valid checkpoint is taken.
        dst_url: Output directory (path or fsspec URL); weight files of an earlier export there are replaced.
        module_cls: The LightningModule class that was trained; built on the meta device from the checkpoint's
            hyper-parameters.
        prefix: The ``PreTrainedModel``'s name in the LightningModule (``"model"`` for ``self.model``);
            default: the only outermost one.
        max_shard_size: ``save_pretrained``'s: above it the weights are split into files with an index.
        checksums: Verify every shard's sha256 before exporting.

    Returns:
        A summary: ``src``, ``dst``, ``step``, ``prefix``, ``class`` (the transformers class), ``tensors``,
        ``files`` (written, in order), ``bytes`` (of the weight files).

    Raises:
        CheckpointError: no ``PreTrainedModel`` in the module (or several, without ``prefix``), a weight the
            checkpoint lacks or holds in another shape, a model whose saved weights transformers computes from
            its tensors (a conversion beyond renaming), a bad ``max_shard_size``, or transformers < 5.
    """
    remove_tied, revert_conversion, split = _transformers_steps()
    saved = open_saved_model(src_url, checksums=checksums)
    module = module_on_meta(module_cls, saved)
    prefix, model = find_pretrained(module, prefix)
    keys = save_keys(model, remove_tied, revert_conversion)
    lead = f"{prefix}." if prefix else ""
    sources = source_names(saved, module, only=[lead + k for k in keys.values()])
    entries = {}
    for key, name in keys.items():
        info = saved.tensors[sources[lead + name]]
        entries[key] = safetensors_stream.Entry(key, info.dtype, info.shape)
    metas = {k: torch.empty(e.shape, dtype=e.dtype, device="meta") for k, e in entries.items()}
    try:
        plan = split(metas, filename_pattern=WEIGHTS.replace(".safetensors", "{suffix}.safetensors"),
                     max_shard_size=max_shard_size)
    except ValueError as exc:
        raise CheckpointError(f"max_shard_size={max_shard_size!r} is not a size ({exc}); give bytes or a size such "
                              f"as '5GB', as `save_pretrained` takes it.") from exc

    fs, root = filesystem(dst_url)
    fs.makedirs(root, exist_ok=True)
    written = _write_configs(model, _weights_dtype(model, saved, sources, lead), fs, root)
    total = 0
    for filename, tensor_keys in plan.filename_to_tensors.items():
        total += safetensors_stream.write(_join(dst_url, filename), [entries[k] for k in tensor_keys],
                                          lambda key: saved.read(sources[lead + keys[key]]),
                                          metadata={"format": "pt"})
        written.append(filename)
    if plan.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **plan.metadata},
                 "weight_map": plan.tensor_to_filename}
        fs.pipe_file(f"{root.rstrip('/')}/{INDEX}", (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        written.append(INDEX)
    _remove_stale(fs, root, set(written))
    return {"src": saved.url, "dst": str(dst_url), "step": saved.info.step, "prefix": prefix,
            "class": type(model).__name__, "tensors": len(entries), "files": written, "bytes": total}


def find_pretrained(module: torch.nn.Module, prefix: str | None = None) -> tuple[str, torch.nn.Module]:
    """``(prefix, model)``: the transformers ``PreTrainedModel`` inside ``module`` and its name there.

    Raises:
        CheckpointError: ``prefix`` names no ``PreTrainedModel``; none in ``module``; several outermost
            ones and no ``prefix``.
    """
    from transformers import PreTrainedModel

    what = type(module).__name__
    if prefix is not None:
        try:
            found = module.get_submodule(prefix)
        except AttributeError:
            found = None
        if not isinstance(found, PreTrainedModel):
            kind = "nothing" if found is None else f"a {type(found).__name__}"
            raise CheckpointError(
                f"`--hf-prefix {prefix}`: {what}.{prefix} is {kind}, not a transformers `PreTrainedModel`. "
                f"Pass the name of the attribute holding it ({_pretrained_names(module) or 'there is none'})."
            )
        return prefix, found
    outer = _pretrained_names(module)
    if not outer:
        raise CheckpointError(
            f"{what} holds no transformers `PreTrainedModel` (such as `self.model = "
            f"AutoModelForCausalLM.from_config(config)`), so there is nothing to write in `save_pretrained` "
            f"format. Export a Lightning .ckpt instead (without `--hf`)."
        )
    if len(outer) > 1:
        raise CheckpointError(
            f"{what} holds several transformers models: {outer}. Choose the one to write with "
            f"`--hf-prefix NAME` (`prefix=` in Python)."
        )
    return outer[0], module.get_submodule(outer[0])


def save_keys(model: torch.nn.Module, remove_tied: Any = None, revert_conversion: Any = None) -> dict[str, str]:
    """The keys ``model.save_pretrained`` writes -> the names in ``model.state_dict()`` they are read from.

    ``model`` is on the meta device; transformers' own steps decide, and each kept tensor is traced back to
    its ``state_dict`` name by identity.

    Raises:
        CheckpointError: a saved weight computed from the model's tensors (a conversion beyond renaming).
    """
    if remove_tied is None or revert_conversion is None:
        remove_tied, revert_conversion, _ = _transformers_steps()
    state = model.state_dict()
    names = {id(t): n for n, t in state.items()}
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = revert_conversion(model, remove_tied(state, model))
    keys: dict[str, str] = {}
    for key, tensor in state.items():
        name = names.get(id(tensor))
        if name is None:
            raise CheckpointError(
                f"{type(model).__name__}: transformers converts this model's weights when saving: the saved weight "
                f"{key!r} is computed from the model's tensors, not one of them as it is (a weight conversion, such as "
                f"fused MoE experts saved expert by expert), which this export does not do. Export a Lightning .ckpt "
                f"(without `--hf`), load it with `load_from_checkpoint` and call `save_pretrained` on the model."
            )
        keys[key] = name
    return keys


def _pretrained_names(module: torch.nn.Module) -> list[str]:
    from transformers import PreTrainedModel

    found = [n for n, m in module.named_modules() if isinstance(m, PreTrainedModel)]
    return [n for n in found if not any(n != o and (o == "" or n.startswith(o + ".")) for o in found)]


def _transformers_steps() -> tuple[Any, Any, Any]:
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError as exc:
        raise CheckpointError(
            f"`--hf` needs transformers >= 5 and huggingface_hub ({exc}). Install them: "
            f"`pip install 'lightning-hpp[hf]'`."
        ) from exc
    return remove_tied_weights_from_state_dict, revert_weight_conversion, split_torch_state_dict_into_shards


def _weights_dtype(model: torch.nn.Module, saved: SavedModel, sources: dict[str, str], lead: str) -> torch.dtype:
    """The dtype ``save_pretrained`` records: its model's first floating-point parameter's, as saved."""
    for name, param in model.named_parameters():
        src = sources.get(lead + name)
        if param.is_floating_point() and src is not None:
            return saved.tensors[src].dtype
    return torch.get_default_dtype()


def _write_configs(model: Any, dtype: torch.dtype, fs: Any, root: str) -> list[str]:
    """``config.json`` (with the weights' dtype and the class as ``save_pretrained`` sets them) and, for a
    model that generates, ``generation_config.json``, written by transformers itself and copied to ``root``."""
    model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    with tempfile.TemporaryDirectory(prefix="hpp-export-") as tmp:
        model.config.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        names = sorted(os.listdir(tmp))
        for name in names:
            with open(os.path.join(tmp, name), "rb") as f:
                fs.pipe_file(f"{root.rstrip('/')}/{name}", f.read())
    return names


def _remove_stale(fs: Any, root: str, written: set[str]) -> None:
    """Weight files and an index an earlier export left in ``root`` that this one did not write: transformers
    would read them (``model.safetensors`` before an index)."""
    fs.invalidate_cache(root)
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name not in written and _STALE.fullmatch(name):
            fs.rm(path)


def _join(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"
