"""The identities of a model's weights and tokenizer, without loading either: what a run's key
is made of (``model.load_model_info``) and what a converted GGUF file's cache folder is named
after (``catalog``). A leaf: it imports nothing of headatlas but its errors."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from headatlas.service.errors import ModelError, Param

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".index.json", ".gguf")
SAMPLES, SAMPLE_BYTES = 16, 64 * 1024  # bytes of each weight file read for its identity (1 MiB)


def weights_fingerprint(folder: Path, spec: str = "") -> str:
    """Identity of a folder's weight files (or of one weights file, e.g. a GGUF file) without
    loading them: each file's name and size, a safetensors file's header (tensor names, dtypes,
    shapes, metadata), and SAMPLES blocks read at even offsets — a fine-tuned checkpoint has the
    same header, not the same bytes."""
    if folder.is_file():
        files = [folder]
    else:
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise ModelError(
            Param("model", spec or folder),
            f": no weight files (*.safetensors, *.bin) in {folder}; pass a complete model folder",
        )
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\t{size}\n".encode())
        with open(path, "rb") as f:
            if path.suffix == ".safetensors" and size >= 8:
                length = int.from_bytes(f.read(8), "little")
                if 0 < length <= min(size - 8, 100 << 20):
                    digest.update(f.read(length))
            step = max(1, size // SAMPLES)
            for k in range(SAMPLES):
                f.seek(min(k * step, max(0, size - SAMPLE_BYTES)))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


T = TypeVar("T")
_SOURCES_KEPT = 16  # tokenizers' files remembered per derived value (a process rarely loads more)


def _source_key(tokenizer, size: int) -> tuple | None:
    """What a tokenizer's vocabulary is read from: its class, its folder and every file there but
    weights (name, size, modification time), its size with added tokens, its added tokens and
    whether it lower-cases. Two tokenizers with one key hold the same vocabulary, unless one was
    changed in memory other than by adding tokens (headatlas never does). None where it was not
    read from a folder (a hub name, a tokenizer built in memory): it is then judged by itself."""
    folder = getattr(tokenizer, "name_or_path", None)
    if not folder:
        return None
    try:
        path = Path(folder).resolve()
        if not path.is_dir():
            return None
        files = []
        for p in sorted(path.iterdir()):
            if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES):
                st = p.stat()
                files.append((p.name, st.st_size, st.st_mtime_ns))
        added = tuple(sorted(tokenizer.get_added_vocab().items()))
    except (OSError, AttributeError, TypeError):
        return None
    lower = str(getattr(tokenizer, "do_lower_case", ""))
    return (type(tokenizer).__name__, str(path), tuple(files), size, added, lower)


def per_tokenizer(derive: Callable[[Any], T]) -> Callable[[Any], T]:
    """``derive(tokenizer)`` computed once per tokenizer object and vocabulary size, not at every
    call: what is read from a whole vocabulary (its fingerprint, its word tokens) costs a pass in
    Python over 30,000-150,000 strings, and one process (an analysis, the web app, the API, a beat
    firing schedules) asks for it of the same loaded tokenizer again and again. A token added to
    the tokenizer changes its size and so derives it again; a tokenizer that is gone takes its
    entry with it. A tokenizer loaded again from the same unchanged files (a model loaded again,
    and every ``random:`` model, which reads the default model's tokenizer) is another object with
    the same vocabulary: it takes the value derived from the first (``_source_key``)."""
    kept: weakref.WeakKeyDictionary[Any, tuple[int, T]] = weakref.WeakKeyDictionary()
    by_source: dict[tuple, T] = {}

    def cached(tokenizer) -> T:
        size = len(tokenizer)
        try:
            held = kept.get(tokenizer)
        except TypeError:  # not weakly referable, or unhashable: derived each time
            return derive(tokenizer)
        if held is not None and held[0] == size:
            return held[1]
        source = _source_key(tokenizer, size)
        value = by_source.get(source) if source is not None else None
        if value is None:
            value = derive(tokenizer)
            if source is not None:
                if len(by_source) >= _SOURCES_KEPT:
                    by_source.pop(next(iter(by_source)))
                by_source[source] = value
        kept[tokenizer] = (size, value)
        return value

    cached.__doc__ = derive.__doc__
    cached.__wrapped__ = derive  # type: ignore[attr-defined]
    return cached


@per_tokenizer
def tokenizer_fingerprint(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    digest.update(str(getattr(tokenizer, "do_lower_case", "")).encode())
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        digest.update(f"{idx}\t{token}\n".encode())
    return digest.hexdigest()[:16]
