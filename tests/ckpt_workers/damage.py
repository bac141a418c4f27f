"""Kinds of damage done to a local checkpoint directory, for the tests and the damage benchmark.

Each function takes the checkpoint directory (``Path``) and damages it in place; :data:`DAMAGES`
names them all. :func:`digest` fingerprints a directory, so a test can check that damaged files
were kept byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from pathlib import Path


def _shards(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("__*_*.distcp"), key=lambda p: p.stat().st_size, reverse=True)


def _flip(path: Path, offset: int, value: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[offset] = (data[offset] ^ 0x5A) if value is None else value
    path.write_bytes(bytes(data))


def flip_tensor_byte(ckpt: Path) -> None:
    """One byte flipped in the middle of the largest tensor shard (same size)."""
    shard = _shards(ckpt)[0]
    _flip(shard, shard.stat().st_size // 2)


def flip_json_entry_byte(ckpt: Path) -> None:
    """A byte of a JSON entry (the trainer's loop state, or any saved JSON) made invalid UTF-8."""
    for shard in _shards(ckpt):
        data = shard.read_bytes()
        at = data.find(b'{"')
        if at >= 0:
            _flip(shard, at + 1, 0xFF)
            return
    raise AssertionError(f"no JSON entry in the shards of {ckpt}")


def truncate_shard(ckpt: Path) -> None:
    shard = _shards(ckpt)[0]
    os.truncate(shard, shard.stat().st_size - 64)


def append_to_shard(ckpt: Path) -> None:
    shard = _shards(ckpt)[0]
    with open(shard, "ab") as f:
        f.write(b"\0" * 16)


def delete_shard(ckpt: Path) -> None:
    _shards(ckpt)[-1].unlink()


def zero_shard(ckpt: Path) -> None:
    """A shard overwritten with zeros (same size): a lost write on a network disk."""
    shard = _shards(ckpt)[0]
    shard.write_bytes(b"\0" * shard.stat().st_size)


def shard_from_older_checkpoint(ckpt: Path) -> None:
    """A shard replaced by the same shard of the previous checkpoint (same name and size)."""
    shard = _shards(ckpt)[0]
    steps = sorted(p for p in ckpt.parent.glob("step-*") if p != ckpt)
    shard.write_bytes((steps[-1] / shard.name).read_bytes())


def garbage_index(ckpt: Path) -> None:
    """``.metadata`` (the shard index) replaced by random bytes of the same size."""
    index = ckpt / ".metadata"
    index.write_bytes(random.Random(0).randbytes(index.stat().st_size))


def truncate_index(ckpt: Path) -> None:
    index = ckpt / ".metadata"
    os.truncate(index, index.stat().st_size // 2)


def delete_index(ckpt: Path) -> None:
    (ckpt / ".metadata").unlink()


def delete_metadata_json(ckpt: Path) -> None:
    """No ``metadata.json``: what a save killed before its commit leaves."""
    (ckpt / "metadata.json").unlink()


def truncate_metadata_json(ckpt: Path) -> None:
    meta = ckpt / "metadata.json"
    os.truncate(meta, meta.stat().st_size // 2)


def empty_metadata_json(ckpt: Path) -> None:
    (ckpt / "metadata.json").write_bytes(b"")


def flip_checksum_in_metadata_json(ckpt: Path) -> None:
    """One hex digit of a recorded sha256 changed: still valid JSON."""
    meta = ckpt / "metadata.json"
    doc = json.loads(meta.read_text())
    sha = doc["shards"][0]["sha256"]
    doc["shards"][0]["sha256"] = ("1" if sha[0] != "1" else "2") + sha[1:]
    meta.write_text(json.dumps(doc, indent=2, sort_keys=True))


def wrong_size_in_metadata_json(ckpt: Path) -> None:
    meta = ckpt / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["shards"][0]["size"] += 1
    meta.write_text(json.dumps(doc, indent=2, sort_keys=True))


def flip_json_entry_byte_resigned(ckpt: Path) -> None:
    """A JSON entry damaged and ``metadata.json`` rewritten to match: only loading can tell."""
    flip_json_entry_byte(ckpt)
    meta = ckpt / "metadata.json"
    doc = json.loads(meta.read_text())
    for shard in doc["shards"]:
        data = (ckpt / shard["path"]).read_bytes()
        shard["size"], shard["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    meta.write_text(json.dumps(doc, indent=2, sort_keys=True))


DAMAGES: dict[str, Callable[[Path], None]] = {
    "byte flipped in a tensor shard": flip_tensor_byte,
    "byte of a JSON entry made invalid UTF-8": flip_json_entry_byte,
    "shard truncated by 64 bytes": truncate_shard,
    "16 bytes appended to a shard": append_to_shard,
    "shard deleted": delete_shard,
    "shard overwritten with zeros": zero_shard,
    "shard swapped for the older checkpoint's": shard_from_older_checkpoint,
    ".metadata replaced by same-size garbage": garbage_index,
    ".metadata truncated to half": truncate_index,
    ".metadata deleted": delete_index,
    "metadata.json deleted": delete_metadata_json,
    "metadata.json truncated to half": truncate_metadata_json,
    "metadata.json emptied": empty_metadata_json,
    "a sha256 in metadata.json changed": flip_checksum_in_metadata_json,
    "a size in metadata.json changed": wrong_size_in_metadata_json,
    "JSON entry damaged, metadata.json re-signed to match": flip_json_entry_byte_resigned,
}


def digest(ckpt: Path) -> dict[str, str]:
    """sha256 of every file under ``ckpt``, by relative path."""
    return {
        str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(ckpt.rglob("*"))
        if p.is_file()
    }
