"""Check a model spec against the analysis before anything is loaded or stored.

Reads only small files (config.json, the tokenizer's file names, a safetensors header), so that
``analyze``, ``submit`` and ``schedule add`` refuse an unusable model in milliseconds, before a
run exists: a folder without tokenizer files (every word would become [UNK]), a ``--seq-len``
beyond the model's position embeddings, weights cut short, or a model too large for memory.
A hub name cannot be checked without downloading it; it is checked after loading
(``check_loaded``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from headatlas.service.errors import ModelError, Param

if TYPE_CHECKING:
    from headatlas.service.engine.adapters import ModelAdapter

# Any one of these makes a tokenizer (fast tokenizer, WordPiece, BPE, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model", "spm.model")
WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
BYTES_PER_PARAM = 4  # weights stay float32 (half precision is autocast)
HEADROOM = 1.25  # activations, the allocator, the tokenizer
DEFAULT_VOCAB = 30522  # random: models use the default model's tokenizer
DEFAULT_POSITIONS = 512  # BertConfig's default, which random: models keep


@dataclass(frozen=True)
class ModelShape:
    """What the analysis needs to know about a model, from its configuration alone."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    positions: int  # usable token positions of one window, [CLS] and [SEP] included
    type_vocab: int = 2

    def parameters(self) -> int:
        d, i = self.hidden, self.intermediate
        embeddings = (self.vocab + self.positions + self.type_vocab) * d + 2 * d
        # per layer: Q, K, V, O (d×d + d), two layer norms, the feed-forward (d×i + i, i×d + d)
        layer = 4 * (d * d + d) + 4 * d + d * i + i + i * d + d
        return embeddings + self.layers * layer

    def weight_bytes(self) -> int:
        return self.parameters() * BYTES_PER_PARAM


def check_model_spec(spec: str, *, seq_len: int, memory: str = "available", device: str = "cpu") -> ModelShape | None:
    """Raise ModelError when ``spec`` cannot analyse windows of ``seq_len`` tokens here.

    ``memory``: "available" (this process is about to load the model: free memory now) or
    "total" (a worker elsewhere loads it: the model must at least fit in this machine's memory).
    Returns the shape read from the configuration, or None for a hub name (checked after loading).
    """
    from headatlas.service.engine.catalog import NAMED_MODELS, is_gguf
    from headatlas.service.engine.model import DEFAULT_MODEL, default_model_dir, looks_like_path, parse_random_shape

    if spec.startswith("random:"):
        random = parse_random_shape(spec)
        positions = random.positions or DEFAULT_POSITIONS
        shape = ModelShape(random.layers, random.hidden, 4 * random.hidden, DEFAULT_VOCAB, positions)
    elif spec != DEFAULT_MODEL and (spec in NAMED_MODELS or is_gguf(spec)):
        if spec not in NAMED_MODELS and Path(spec).expanduser().is_file():
            from headatlas.service.engine.gguf_file import check_gguf

            check_gguf(Path(spec).expanduser(), spec)  # its framing: a file cut short is said before any queue
        return None  # a GGUF file (converted on first load): its shape checked once loaded
    else:
        folder = default_model_dir() if spec == DEFAULT_MODEL else Path(spec).expanduser()
        if folder.exists() and not folder.is_dir():
            raise ModelError(
                Param("model", spec), ": is a file; pass the model's folder (config.json, weights, tokenizer files)"
            )
        if not folder.exists():
            if looks_like_path(spec):
                raise ModelError(
                    Param("model", spec), ": no such folder; pass an existing model folder, a hub name or random:minilm"
                )
            return None  # a hub name: checked once loaded
        shape = _folder_shape(spec, folder)
    check_seq_len(spec, shape.positions, seq_len)
    check_fits(spec, shape, memory=memory, device=device)
    return shape


def check_seq_len(spec: str, positions: int, seq_len: int) -> None:
    if seq_len > positions:
        raise ModelError(
            Param("seq_len", seq_len),
            f": model {spec} has {positions} positions; pass ",
            Param("seq_len", positions),
            " or less",
        )


def check_loaded(loaded, seq_len: int) -> None:
    """The checks that need the loaded model (a hub name): its position limit."""
    config = loaded.model.config
    check_seq_len(loaded.spec, _positions(config.to_dict()), seq_len)


def check_fits(spec: str, shape: ModelShape, *, memory: str = "available", device: str = "cpu") -> None:
    need = int(shape.weight_bytes() * HEADROOM)
    have, where = memory_bytes(memory, device)
    if have is not None and need > have:
        raise ModelError(
            Param("model", spec),
            f": {shape.parameters():,} parameters need about {_gib(need)} of memory, "
            f"{where} has {_gib(have)}; choose a smaller model (e.g. random:minilm)",
        )


def memory_bytes(kind: str, device: str) -> tuple[int | None, str]:
    """(bytes, what they are) of the memory a model would be loaded into; None when unknown."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            index = torch.device(device).index or 0
            free, total = torch.cuda.mem_get_info(index)
            return (
                free if kind == "available" else total
            ), f"GPU {index} ({'free' if kind == 'available' else 'total'})"
    key = "MemAvailable" if kind == "available" else "MemTotal"
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith(key + ":"):
                    return int(
                        line.split()[1]
                    ) * 1024, f"this machine ({'available' if kind == 'available' else 'total'})"
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES" if kind == "available" else "SC_PHYS_PAGES")
        return pages * os.sysconf("SC_PAGE_SIZE"), "this machine"
    except (ValueError, OSError, AttributeError):
        return None, "this machine"


def check_config_numbers(spec: str, config_path: Path, config: dict, adapter: ModelAdapter) -> None:
    """The sizes in a model's config.json (the fields its family's adapter names) are positive
    whole numbers ("twelve" heads would fail deep inside the model's library)."""
    for name in adapter.config_keys.counts():
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelError(
                Param("model", spec),
                f": {config_path} has {name} = {value!r}, not a positive whole number; "
                "restore it from the model's source",
            )


def config_adapter(config: dict, spec: str) -> ModelAdapter:
    """The adapter of a config.json: its ``model_type``'s (a ModelError listing the supported
    families when none serves it); a config that names none is read as an encoder's."""
    from headatlas.service.engine.adapters import ENCODER_FAMILY, adapter_by_family, adapter_for

    return adapter_for(config, spec) if "model_type" in config else adapter_by_family(ENCODER_FAMILY)


def _folder_shape(spec: str, folder: Path) -> ModelShape:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelError(
            Param("model", spec),
            ": folder has no config.json; pass a Hugging Face model folder (config.json, weights, tokenizer files)",
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(
            Param("model", spec), f": {config_path} is not valid JSON ({exc}); restore it from the model's source"
        ) from None
    if not isinstance(config, dict):
        raise ModelError(
            Param("model", spec), f": {config_path} does not hold a JSON object; restore it from the model's source"
        )
    adapter = config_adapter(config, spec)  # an architecture without an adapter: the supported families
    check_config_numbers(spec, config_path, config, adapter)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(
            Param("model", spec),
            f": folder has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])} …); copy them from "
            "the model's source into it (without them every word would be read as unknown)",
        )
    weights = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not weights:
        raise ModelError(
            Param("model", spec),
            f": folder has no weights ({' or '.join(WEIGHT_FILES[:2])}); copy them from the model's source into it",
        )
    if weights[0].name == "model.safetensors":
        check_safetensors(spec, weights[0])
    keys = adapter.config_keys
    missing = [key for key in keys.required() if config.get(key) is None]
    if missing:
        raise ModelError(
            Param("model", spec),
            f": {config_path} lacks {', '.join(repr(k) for k in missing)}, which a {adapter.title} "
            f"config (model_type {config.get('model_type', adapter.model_types[0])!r}) holds; restore it from the "
            "model's source",
        )
    hidden = int(config[keys.hidden])
    intermediate = config.get(keys.intermediate) if keys.intermediate else None
    return ModelShape(
        layers=int(config[keys.layers]),
        hidden=hidden,
        intermediate=int(intermediate or 4 * hidden),
        vocab=int(config.get(keys.vocab) or DEFAULT_VOCAB),
        positions=_positions(config),
        type_vocab=int(config.get("type_vocab_size", 2) or 1),
    )


def _positions(config: dict) -> int:
    """Usable positions of a window (the family's adapter knows where they are stated and their
    offsets); without a model_type, as an encoder's config."""
    return config_adapter(config, "").positions(config) or DEFAULT_POSITIONS


def check_safetensors(spec: str, path: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte
    range, then the data: a file shorter than its last range was cut short."""
    size = path.stat().st_size
    problem = None
    try:
        with path.open("rb") as stream:
            head = stream.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or length > size - 8 or length > 100 << 20:
                problem = "its header is missing or cut"
            else:
                header = json.loads(stream.read(length))
                end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
                if 8 + length + end > size:
                    problem = f"{size:,} bytes where its header needs {8 + length + end:,}"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        problem = f"unreadable header ({type(exc).__name__})"
    if problem:
        raise ModelError(
            Param("model", spec), f": {path} is cut short or damaged ({problem}); download or copy the weights again"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
