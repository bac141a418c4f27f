"""A safetensors file written one tensor at a time, to any fsspec URL.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header length, a JSON header
(``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}``, padded with spaces
to a multiple of 8 bytes), then the tensors' raw little-endian bytes back to back. Every offset follows from
the shapes and dtypes alone, so the header is written first and each tensor's bytes are streamed after it,
read when its turn comes and dropped once written: the peak is one tensor, whatever the file's size.
``safetensors.torch.save_file`` (and ``safetensors.serialize``) take every tensor in memory at once, which is
what this module exists to avoid; its files load with ``safetensors.safe_open`` and ``from_pretrained``.

As safetensors orders them, the tensors are laid out by element size (largest first), then by name, so that
every tensor starts at a multiple of its element size after the 8-byte aligned header.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lightning_hpp.checkpoint.storage import filesystem
from lightning_hpp.errors import CheckpointError

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}
"""torch dtypes and their names in a safetensors header."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name in the file, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


def layout(entries: Iterable[Entry]) -> list[Entry]:
    """The order of the tensors' bytes: by element size, largest first, then by name."""
    return sorted(entries, key=lambda e: (-torch.empty((), dtype=e.dtype).element_size(), e.name))


def header(entries: list[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for ``entries`` laid out in that order."""
    doc: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        if e.dtype not in DTYPES:
            raise CheckpointError(f"tensor {e.name!r} has dtype {e.dtype}, which safetensors cannot store.")
        doc[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write(url: str, entries: Iterable[Entry], read: Callable[[str], torch.Tensor],
          metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file at ``url``, asking ``read(name)`` for each tensor in turn.

    Args:
        url: Local path or fsspec URL of the file.
        entries: What the file holds; each tensor ``read`` returns must have the entry's dtype and shape.
        read: The tensor of an entry, by name; called once per entry, in the file's order.
        metadata: The header's ``__metadata__`` (transformers writes ``{"format": "pt"}``).

    Returns:
        The file's size in bytes.

    Raises:
        CheckpointError: a dtype safetensors cannot store, or a tensor unlike its entry.
    """
    order = layout(entries)
    head = header(order, metadata)
    fs, path = filesystem(url)
    size = len(head)
    with fs.open(path, "wb") as f:
        f.write(head)
        for e in order:
            tensor = read(e.name)
            if tensor.dtype != e.dtype or tuple(tensor.shape) != e.shape:
                raise CheckpointError(f"tensor {e.name!r} is {tensor.dtype} {list(tensor.shape)}; its header "
                                      f"entry says {e.dtype} {list(e.shape)}.")
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(data.data)
            size += data.nbytes
            del tensor, data
    return size
