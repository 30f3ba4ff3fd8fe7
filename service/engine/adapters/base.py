"""The model-adapter interface and its registry (SPEC §8).

An adapter holds everything about one model family, so that nothing outside
``service/engine/adapters/`` names a family's modules or its config's fields; everything
downstream asks the adapter of the model at hand (``adapter_for``). The contract (``CONTRACT``,
checked by ``register`` before a family can be used, enumerated by tests/test_adapters.py):

- structure: its blocks, each block's attention module, the per-head outputs z *before* the
  output projection, the attention probabilities, the output projection's weight (for
  ``--vectors post_wo``), the value projection, whether attention is causal;
- the block parts the mixing measures and the effects need (SPEC §6, §9): the embedding output
  (what block 0 reads), pre- or post-norm, the norm beside the attention, the final norm;
- the config: which config.json fields hold the layers, heads, width, … (``ConfigKeys``), read
  by the model check before anything is loaded, and the shape read from a loaded config;
- random configs: its named ``random:`` shapes and how a random-weights model is built;
- how a window is laid out (its special tokens);
- where each named hook point is (``hook_point``: ``embed``, ``blocks.L.resid_pre``,
  ``blocks.L.attn.z``, ``blocks.L.attn.pattern``, ``unembed``, …; see ``points.py``), by default
  from the parts above.

A family installed by a plugin must also pass the conformance checks (``conformance.py``: run on
a tiny random model of the family) before it is registered.

Adding a family is one module that subclasses ``ModelAdapter`` and is registered with
``@register``: here, or in a package of its own through the ``headatlas.families`` entry point
(docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from headatlas.service.engine.adapters.points import HookPoint, parse_hook_name
from headatlas.service.errors import AdapterIncomplete, ModelError, Param

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class Shape:
    """A model's attention shape, read from its config."""

    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key-value heads (= n_heads without grouped-query attention)
    d_head: int
    d_model: int

    @property
    def group_size(self) -> int:
        """Query heads per key-value head: head h reads key-value head ``h // group_size``."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class RandomShape:
    """A named (or given) shape of a random-weights model: ``random:NAME``."""

    family: str
    layers: int
    heads: int
    hidden: int
    kv_heads: int | None = None  # None: as many as query heads
    intermediate: int | None = None  # the MLP's width; None: the family's default for ``hidden``
    mlm: bool = False  # with a (random) masked-LM head: the objective of SPEC §9 is then a masked-LM loss
    # usable positions of a window (None: 512, BERT's); a shape that stands for a real model takes its context
    positions: int | None = None

    def describe(self) -> str:
        kv = f", {self.kv_heads} kv" if self.kv_heads not in (None, self.heads) else ""
        return f"{self.layers}x{self.heads}x{self.hidden}{kv}" + (" with an MLM head" if self.mlm else "")


def names_masked_lm(config: Any) -> bool:
    """Whether a config's ``architectures`` name a masked-LM model (``*ForMaskedLM``, BERT's
    ``*ForPreTraining``): what a checkpoint with a masked-LM head declares."""
    architectures = getattr(config, "architectures", None) or []
    return any(a.endswith(("ForMaskedLM", "ForPreTraining")) for a in architectures)


@dataclass(frozen=True)
class ConfigKeys:
    """The config.json fields of a family that hold its sizes (families name them differently:
    BERT's ``num_hidden_layers`` is GPT-2's ``n_layer`` and DistilBERT's ``n_layers``). The model
    check reads a folder's config.json through them before anything is loaded; ``shape`` reads a
    loaded config through them. None: the family has no such field."""

    layers: str = "num_hidden_layers"
    heads: str = "num_attention_heads"
    hidden: str = "hidden_size"
    intermediate: str | None = "intermediate_size"  # None or a null value: 4 × hidden
    vocab: str = "vocab_size"
    positions: str | None = "max_position_embeddings"
    kv_heads: str | None = None  # grouped-query attention's key-value heads
    head_dim: str | None = None  # where the head size is not hidden / heads

    def required(self) -> tuple[str, ...]:
        """The fields every config of the family has."""
        return (self.layers, self.heads, self.hidden)

    def counts(self) -> tuple[str, ...]:
        """Every field that, when present, must be a positive whole number."""
        named = (self.layers, self.heads, self.hidden, self.intermediate, self.vocab, self.positions, self.kv_heads)
        return tuple(n for n in (*named, self.head_dim) if n)


class ModelAdapter(ABC):
    """One model family. Adapters hold no state: every method takes the model, block or config."""

    family: ClassVar[str]  # short name, as `headatlas models` lists it
    title: ClassVar[str]  # the architectures it covers, for messages and docs
    model_types: ClassVar[tuple[str, ...]]  # config.model_type values it serves
    causal: ClassVar[bool]  # decoder (causal) or encoder (bidirectional) attention
    # the block normalises the attention's input (``x + Attn(LN(x))``: GPT-2, Llama); otherwise it
    # normalises after the residual sum (``LN(x + Attn(x))``: BERT, DistilBERT)
    pre_norm: ClassVar[bool]
    config_keys: ClassVar[ConfigKeys]  # its config.json's field names
    random_shapes: ClassVar[dict[str, RandomShape]]  # random:NAME shapes of this family (one at least)
    origin: ClassVar[str] = "headatlas"  # where it comes from: headatlas, or the plugin that registered it
    # its attention module calls transformers' attention interface (``eager_attention_forward`` or
    # the implementation the config names) with (query, key, value, mask, scaling): long windows
    # can then take attention in row blocks (``service.engine.row_attention``)
    row_attention: ClassVar[bool] = False
    # its checkpoints may ship a masked-LM head (``load_mlm_head``): one whose config names a
    # masked-LM model (``names_masked_lm``) is measured by the masked-LM loss (SPEC §9)
    masked_lm_heads: ClassVar[bool] = False

    # --- structure -------------------------------------------------------------------------------
    @abstractmethod
    def blocks(self, model: Any) -> list[torch.nn.Module]:
        """The transformer blocks of the *base* model (no language-modelling head), in order."""

    @abstractmethod
    def attention(self, block: Any) -> torch.nn.Module:
        """The block's attention module: under eager attention its forward returns
        ``(output, probs)`` with probs ``[batch, head, pos, key]``."""

    @abstractmethod
    def output_projection(self, block: Any) -> torch.nn.Module:
        """The module whose input is z ``[batch, pos, head·d_head]`` (W_O)."""

    @abstractmethod
    def output_weight(self, block: Any) -> torch.Tensor:
        """W_O as ``[d_model, head·d_head]`` (nn.Linear's layout: ``out = z @ W_O.T``)."""

    @abstractmethod
    def values(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        """The value vectors of the attention's input ``x`` ``[batch, pos, d_model]`` (after any
        pre-norm: what the attention module receives), ``[batch, kv_head, pos, d_head]``; bias
        included. Rotary embeddings do not touch values."""

    def shape(self, config: PretrainedConfig) -> Shape:
        """Layers, heads, key-value heads, head size and width from a loaded config, through
        ``config_keys`` (the fields the model check reads in config.json)."""
        keys = self.config_keys
        heads, hidden = int(getattr(config, keys.heads)), int(getattr(config, keys.hidden))
        kv = getattr(config, keys.kv_heads, None) if keys.kv_heads else None
        d_head = getattr(config, keys.head_dim, None) if keys.head_dim else None
        return Shape(int(getattr(config, keys.layers)), heads, int(kv or heads), int(d_head or hidden // heads), hidden)

    # --- block parts (the mixing measures, SPEC §6; the effects, SPEC §9) ------------------------
    @abstractmethod
    def embedding_output(self, model: Any) -> torch.nn.Module:
        """The module whose output is the embedding-layer output ``e`` ``[batch, pos, d_model]``:
        exactly what block 0 reads (token embeddings plus learned positions where the family has
        them). Gradient attribution differentiates against it."""

    @abstractmethod
    def attention_norm(self, block: Any) -> torch.nn.Module:
        """Pre-norm (``pre_norm``): the norm applied to the block input before attention;
        post-norm: the norm after the attention's residual sum. ALTI runs through it."""

    @abstractmethod
    def final_norm(self, model: Any) -> torch.nn.Module | None:
        """The norm the base model applies after its last block (pre-norm families), or None;
        the effects replay the blocks and end where the model ends."""

    def attention_input(self, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
        """The hidden states handed to ``attention(block)`` (a forward pre-hook's arguments)."""
        return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    # --- hook points (service.engine.adapters.points) --------------------------------------------
    def hook_point(self, model: Any, name: str) -> HookPoint:
        """Where the named activation ``name`` is in ``model`` (the base model), for capture and
        intervention alike. Default, from the parts above: ``embed`` is the output of
        ``embedding_output``, ``unembed`` the output of ``final_norm`` (of the last block where there
        is none); a block's ``resid_pre`` / ``resid_post`` its input / output, ``attn_in`` the
        attention module's input, ``attn.mask`` the ``attention_mask`` keyword it is called with,
        ``attn.z`` / ``attn_out`` the output projection's input / output, ``attn.pattern`` the
        second value the attention module returns. A family whose model
        computes one of them inline (not as a module's input or output) overrides this."""
        layer, point = parse_hook_name(name)
        if layer is None:
            if point == "embed":
                return HookPoint(name, self.embedding_output(model), "output")
            final = self.final_norm(model)
            return HookPoint(name, final if final is not None else self.blocks(model)[-1], "output")
        blocks = self.blocks(model)
        if not 0 <= layer < len(blocks):
            raise ValueError(f"hook point {name!r}: the model has blocks 0 to {len(blocks) - 1}")
        block = blocks[layer]
        where: dict[str, tuple[torch.nn.Module, str]] = {
            "resid_pre": (block, "input"),
            "resid_post": (block, "output"),
            "attn_in": (self.attention(block), "input"),
            "attn.mask": (self.attention(block), "attention_mask"),
            "attn.z": (self.output_projection(block), "input"),
            "attn.pattern": (self.attention(block), "output[1]"),
            "attn_out": (self.output_projection(block), "output"),
        }
        module, kind = where[point]
        return HookPoint(name, module, kind)

    def positions(self, config: Mapping[str, Any]) -> int:
        """Usable token positions of one window, from a config.json dict (0: not stated)."""
        key = self.config_keys.positions
        return int((config.get(key) if key else 0) or 0)

    # --- windows -------------------------------------------------------------------------------
    def window_specials(self, tokenizer) -> tuple[int | None, int | None]:
        """(first, last) special token ids of a window: encoders ``([CLS], [SEP])``; decoders
        ``(BOS or None, None)`` (SPEC §8)."""
        if self.causal:
            return tokenizer.bos_token_id, None
        return tokenizer.cls_token_id, tokenizer.sep_token_id

    # --- loading -------------------------------------------------------------------------------
    def load(self, source: str, **kwargs: Any) -> PreTrainedModel:
        """The base transformer from a folder or hub name, with eager attention."""
        from transformers import AutoModel

        return AutoModel.from_pretrained(source, attn_implementation="eager", **kwargs)

    @abstractmethod
    def random_config(self, shape: RandomShape, vocab_size: int) -> PretrainedConfig:
        """The config of a random-weights model of ``shape`` over a vocabulary of ``vocab_size``."""

    def from_config(self, config: PretrainedConfig) -> PreTrainedModel:
        """A freshly initialised base model (the caller seeds the generator): random shapes and
        the control model (same config, new weights)."""
        from transformers import AutoModel

        return AutoModel.from_config(config, attn_implementation="eager")

    def random_model(self, config: PretrainedConfig) -> PreTrainedModel:
        """A random-weights model of a ``random:`` shape (the caller seeds the generator)."""
        return self.from_config(config)

    def masked_lm(self, config: Any) -> bool:
        """Whether ``config`` (no weights read) is a masked-LM model whose head this family loads
        (``load_mlm_head``): its objective is then the masked-LM loss (SPEC §9)."""
        return self.masked_lm_heads and names_masked_lm(config)

    def load_mlm_head(self, source: str) -> torch.nn.Module | None:
        """The masked-LM head the checkpoint at ``source`` ships (final hidden states → logits), or
        None: a family or checkpoint without one (SPEC §9 then measures embedding drift)."""
        return None

    def random_mlm_head(self, config: PretrainedConfig, model: Any) -> torch.nn.Module | None:
        """A freshly initialised masked-LM head for ``model`` (the caller seeds the generator), its
        decoder tied to the model's input embeddings; None where the family has none."""
        return None

    def random_name(self, shape: RandomShape, seed: int) -> str:
        return f"random {self.family} {shape.describe()} (seed {seed})"

    def random_key(self, shape: RandomShape, seed: int) -> str:
        """What a random model's weights key is the hash of."""
        return f"random {self.family} {shape.describe()} seed {seed}"

    def ensure_eager(self, model: Any) -> None:
        """Switch a model that was loaded otherwise to eager attention (probs materialised)."""
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "_attn_implementation", "eager") != "eager":
            model.set_attn_implementation("eager")


ADAPTERS: dict[str, ModelAdapter] = {}  # config.model_type -> adapter
FAMILIES: dict[str, ModelAdapter] = {}  # family name -> adapter

# The contract: every class attribute and method an adapter provides (the methods without a
# default are ModelAdapter's abstract methods). ``register`` refuses a class that lacks one.
CONTRACT_ATTRIBUTES: dict[str, type | tuple[type, ...]] = {
    "family": str,
    "title": str,
    "model_types": tuple,
    "causal": bool,
    "pre_norm": bool,
    "config_keys": ConfigKeys,
    "random_shapes": dict,
}
CONTRACT_METHODS: tuple[str, ...] = tuple(
    sorted(name for name in dir(ModelAdapter) if getattr(getattr(ModelAdapter, name), "__isabstractmethod__", False))
)
CONTRACT: tuple[str, ...] = (*CONTRACT_ATTRIBUTES, *CONTRACT_METHODS)


def missing_parts(cls: type[ModelAdapter]) -> list[str]:
    """The parts of the contract ``cls`` does not provide (or provides with the wrong type)."""
    missing = [
        name
        for name, kind in CONTRACT_ATTRIBUTES.items()
        if not isinstance(getattr(cls, name, None), kind) or getattr(cls, name) in ("", (), {})
    ]
    missing += sorted(getattr(cls, "__abstractmethods__", ()))
    return missing


def check_contract(cls: type[ModelAdapter]) -> None:
    """Raise AdapterIncomplete, one line, when ``cls`` cannot serve its family: a part of the
    contract missing, a family name another adapter has, a random shape of another family, or a
    model type another family serves."""
    name = getattr(cls, "family", None) or cls.__name__
    missing = missing_parts(cls)
    if missing:
        raise AdapterIncomplete(
            f"model family {name!r} ({cls.__module__}.{cls.__qualname__}) lacks {', '.join(missing)}: "
            "an adapter provides every part of ModelAdapter (docs/architecture.md, Adding a model family)"
        )
    taken = FAMILIES.get(name)
    if taken is not None and type(taken) is not cls:  # a second adapter would replace the first silently
        owner = "headatlas's" if taken.origin == "headatlas" else f"{taken.origin}'s"
        raise AdapterIncomplete(
            f"model family {name!r} is {owner} already ({type(taken).__name__}): give "
            f"{cls.__module__}.{cls.__qualname__} another family name (and its own model types)"
        )
    for shape_name, shape in cls.random_shapes.items():
        if shape.family != cls.family:
            raise AdapterIncomplete(
                f"model family {name!r}: random:{shape_name} is declared for family {shape.family!r}"
            )
        taken = next((a for a in FAMILIES.values() if shape_name in a.random_shapes and a.family != name), None)
        if taken is not None:
            raise AdapterIncomplete(f"model family {name!r}: random:{shape_name} is already family {taken.family!r}'s")
    for model_type in cls.model_types:
        other = ADAPTERS.get(model_type)
        if other is not None and other.family != cls.family:
            raise AdapterIncomplete(
                f"model family {name!r}: model type {model_type!r} is already served by family {other.family!r} "
                f"({other.origin})"
            )


# the built-in families, whose conformance the suite checks (tests/test_hook_points.py) rather than
# every process at import: a tiny random model per family is not built each time headatlas starts
BUILTIN_MODULES = "headatlas.service.engine.adapters."


def register(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: make ``cls`` the adapter of its ``model_types``, once it provides every
    part of the contract and (a family not built in) passes the conformance checks on its tiny
    random model (``conformance.conform``): AdapterIncomplete otherwise, naming the failing check,
    and nothing is registered."""
    check_contract(cls)
    adapter = cls()
    if not cls.__module__.startswith(BUILTIN_MODULES):
        from headatlas.service.engine.adapters.conformance import conform

        conform(adapter)
    FAMILIES[cls.family] = adapter
    for model_type in cls.model_types:
        ADAPTERS[model_type] = adapter
    return cls


def _install_plugin(plugin: Any, value: Any) -> None:
    """A ``headatlas.families`` entry point names a ModelAdapter subclass; it is registered, with
    its origin, once it provides the whole contract and passes the conformance checks
    (``conformance.conform``: its tiny random model computes what its hook points say)."""
    from headatlas.service.engine.adapters.conformance import conform
    from headatlas.service.errors import PluginError

    if not (isinstance(value, type) and issubclass(value, ModelAdapter)):
        raise PluginError(f"{plugin.value} is not a ModelAdapter subclass")
    registered = FAMILIES.get(getattr(value, "family", ""))
    if registered is not None and type(registered) is value:  # registered already (a @register at import)
        if value.__module__.startswith(BUILTIN_MODULES):  # not conformed by register: checked here
            try:
                conform(registered)
            except AdapterIncomplete:
                _unregister(registered)
                raise
        type(registered).origin = plugin.origin
        return
    value.origin = plugin.origin
    register(value)  # the contract, then the conformance checks


def _unregister(adapter: ModelAdapter) -> None:
    FAMILIES.pop(adapter.family, None)
    for model_type in adapter.model_types:
        if ADAPTERS.get(model_type) is adapter:
            del ADAPTERS[model_type]


def load_plugins() -> None:
    """Register the families of installed plugins (once per process)."""
    from headatlas.service import plugins

    plugins.load(plugins.FAMILIES, _install_plugin)


def families() -> dict[str, ModelAdapter]:
    """Every family, the plugins' included: family name -> adapter."""
    load_plugins()
    return FAMILIES


def random_shapes() -> dict[str, RandomShape]:
    """Every family's named random shapes (``random:NAME``), the plugins' included."""
    return {name: shape for adapter in families().values() for name, shape in adapter.random_shapes.items()}


def random_shape(name: str) -> RandomShape | None:
    """The named shape ``random:NAME`` of any family (plugins are read only when no built-in
    family has it), or None."""
    for adapter in list(FAMILIES.values()):
        if name in adapter.random_shapes:
            return adapter.random_shapes[name]
    return random_shapes().get(name)


def supported_families() -> str:
    """One line: every family and its model types."""
    return "; ".join(f"{a.title} ({', '.join(a.model_types)})" for a in families().values())


def model_type_of(model_or_config: Any) -> str | None:
    config = getattr(model_or_config, "config", model_or_config)
    if isinstance(config, Mapping):
        value = config.get("model_type")
    else:
        value = getattr(config, "model_type", None)
    return value if isinstance(value, str) and value else None


def adapter_for(model_or_config: Any, spec: str = "") -> ModelAdapter:
    """The adapter of a model, a config, or a config.json dict, by its ``model_type``; a
    ModelError naming the supported families when there is none."""
    model_type = model_type_of(model_or_config)
    adapter = ADAPTERS.get(model_type or "")
    if adapter is None and model_type:
        load_plugins()
        adapter = ADAPTERS.get(model_type)
    if adapter is None:
        what = model_type or type(getattr(model_or_config, "config", model_or_config)).__name__
        raise ModelError(
            Param("model", spec or "?"),
            f": architecture {what!r} has no adapter; supported families: {supported_families()}",
        )
    return adapter


def adapter_by_family(family: str) -> ModelAdapter:
    adapter = FAMILIES.get(family) or families().get(family)
    if adapter is None:
        raise ModelError(f"model family {family!r} is unknown; supported families: {supported_families()}")
    return adapter


def kv_group(head: int, shape: Shape) -> int:
    """The key-value head that query head ``head`` reads (grouped-query attention, SPEC §8)."""
    return head // shape.group_size


def adapter_of_block(block: torch.nn.Module) -> ModelAdapter:
    """The adapter whose blocks look like ``block`` (for callers that hold a block, not a model)."""
    for adapter in FAMILIES.values():
        try:
            adapter.attention(block)
            adapter.output_projection(block)
        except AttributeError:
            continue
        return adapter
    raise ModelError(f"{type(block).__name__} is not a block of a supported family ({', '.join(FAMILIES)})")
