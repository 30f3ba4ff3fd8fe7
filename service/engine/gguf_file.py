"""A GGUF file's framing checked before it is converted: a file cut short or damaged is said to
be so in a fraction of a second, instead of failing deep inside transformers' reader.

The layout (GGUF v2 and v3, little-endian): magic ``GGUF``, version (u32), tensor count (u64),
metadata count (u64); the metadata key/value pairs; one entry per tensor (name, dimensions, ggml
type, offset into the data); then, aligned to ``general.alignment`` (32 by default), the tensor
data. Only lengths are read: no vocabulary is decoded, no tensor touched.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from headatlas.service.errors import ModelError, Param

MAGIC = b"GGUF"
_FIXED = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}  # value type: bytes
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class _Cut(Exception):
    """The framing asks for bytes past the end of the file."""


class _Bad(Exception):
    """The framing holds a value no GGUF writer writes."""


class _Unsupported(Exception):
    """A GGUF version the reader does not know (v1 counted in 32 bits; a later one may change more)."""


def check_gguf(path: Path, spec: str) -> None:
    """Raise ModelError when ``path`` is not a whole GGUF file: too short, not GGUF, or ending
    before its metadata, its tensor table or its tensor data do."""
    size = path.stat().st_size
    fix = "download or copy it again, or pass a model folder"
    if size < 24:
        raise ModelError(
            Param("model", spec), f": the GGUF file {path} is truncated ({size:,} bytes, not even a header); {fix}"
        )
    with path.open("rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        if blob[:4] != MAGIC:
            raise ModelError(Param("model", spec), f": {path} is not a GGUF file (it does not start with GGUF); {fix}")
        try:
            need = _data_end(blob)
        except _Cut:
            raise ModelError(
                Param("model", spec),
                f": the GGUF file {path} is truncated or corrupt ({size:,} bytes, ending inside its header); {fix}",
            ) from None
        except _Bad as exc:
            raise ModelError(Param("model", spec), f": the GGUF file {path} is corrupt ({exc}); {fix}") from None
        except _Unsupported as exc:
            raise ModelError(
                Param("model", spec), f": {path} is {exc}: convert it again with a current llama.cpp"
            ) from None
    if need is not None and need > size:
        raise ModelError(
            Param("model", spec),
            f": the GGUF file {path} is truncated ({size:,} bytes, not the {need:,} its tensors need); {fix}",
        )


def _data_end(blob: mmap.mmap) -> int | None:
    """Where the tensor data ends (None when a tensor's ggml type is unknown here)."""
    size = len(blob)
    version, tensors, pairs = _unpack(blob, "<IQQ", 4)
    if version not in (2, 3):
        raise _Unsupported(f"GGUF version {version}; versions 2 and 3 are read")
    if tensors > size or pairs > size:  # every entry takes bytes: more entries than bytes end past the file
        raise _Cut
    pos, alignment = 24, _DEFAULT_ALIGNMENT
    for _ in range(pairs):
        key, pos = _string(blob, pos)
        (kind,) = _unpack(blob, "<I", pos)
        if key == b"general.alignment" and kind == 4:
            (alignment,) = _unpack(blob, "<I", pos + 4)
        pos = _skip_value(blob, pos + 4, kind)
    table = []
    for _ in range(tensors):
        _name, pos = _string(blob, pos)
        (dims,) = _unpack(blob, "<I", pos)
        if dims > 8:
            raise _Bad(f"a tensor of {dims} dimensions")
        shape = _unpack(blob, f"<{dims}Q", pos + 4)
        ggml_type, offset = _unpack(blob, "<IQ", pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        table.append((shape, ggml_type, offset))
    if alignment <= 0:
        raise _Bad(f"alignment {alignment}")
    start = -(-pos // alignment) * alignment
    end = start
    for shape, ggml_type, offset in table:
        nbytes = _tensor_bytes(shape, ggml_type)
        if nbytes is None:
            return None
        end = max(end, start + offset + nbytes)
    return end


def _tensor_bytes(shape: tuple[int, ...], ggml_type: int) -> int | None:
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:  # the converter's own import error says what to install
        return None
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    elements = 1
    for dim in shape:
        elements *= dim
    return elements // block * block_bytes


def _unpack(blob: mmap.mmap, fmt: str, pos: int) -> tuple:
    if pos + struct.calcsize(fmt) > len(blob):
        raise _Cut
    return struct.unpack_from(fmt, blob, pos)


def _string(blob: mmap.mmap, pos: int) -> tuple[bytes, int]:
    (length,) = _unpack(blob, "<Q", pos)
    end = pos + 8 + length
    if end > len(blob):
        raise _Cut
    return (blob[pos + 8 : end] if length <= 64 else b""), end


def _skip_value(blob: mmap.mmap, pos: int, kind: int) -> int:
    if kind in _FIXED:
        if pos + _FIXED[kind] > len(blob):
            raise _Cut
        return pos + _FIXED[kind]
    if kind == _STRING:
        return _string(blob, pos)[1]
    if kind == _ARRAY:
        element, count = _unpack(blob, "<IQ", pos)
        pos += 12
        if element in _FIXED:
            pos += count * _FIXED[element]
            if pos > len(blob):
                raise _Cut
            return pos
        if count > len(blob):
            raise _Cut
        for _ in range(count):
            pos = _skip_value(blob, pos, element)
        return pos
    raise _Bad(f"metadata value type {kind}")
