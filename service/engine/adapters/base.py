"""The model-adapter interface and its registry (SPEC §8).

An adapter maps one model family's modules onto the vocabulary the rest of the engine speaks:
its blocks, each block's attention module, the per-head outputs z *before* the output projection,
the attention probabilities, the output projection's weight (for ``--vectors post_wo``), the value
projection, the head counts, whether attention is causal, how a window is laid out, and how a
random-weights model of the family is built. Nothing outside ``service/engine/adapters/`` names a
family's modules; everything downstream asks the adapter of the model at hand (``adapter_for``).

Adding a family is one module here that subclasses ``ModelAdapter`` and is registered with
``@register`` (docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from headatlas.service.errors import ModelError

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformers import PretrainedConfig, PreTrainedModel

# emit(z, probs): z [batch, pos, head·d_head] before the output projection, probs [batch, head, pos, key]
Emit = Callable[[torch.Tensor, torch.Tensor], None]


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

    def describe(self) -> str:
        kv = f", {self.kv_heads} kv" if self.kv_heads not in (None, self.heads) else ""
        return f"{self.layers}x{self.heads}x{self.hidden}{kv}"


class ModelAdapter(ABC):
    """One model family. Adapters hold no state: every method takes the model, block or config."""

    family: ClassVar[str]  # short name, as `headatlas models` lists it
    title: ClassVar[str]  # the architectures it covers, for messages and docs
    model_types: ClassVar[tuple[str, ...]]  # config.model_type values it serves
    causal: ClassVar[bool]  # decoder (causal) or encoder (bidirectional) attention
    random_shapes: ClassVar[dict[str, RandomShape]] = {}  # random:NAME shapes of this family

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

    @abstractmethod
    def shape(self, config: PretrainedConfig) -> Shape:
        """Layers, heads, key-value heads, head size and width from the config."""

    def attention_input(self, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
        """The hidden states handed to ``attention(block)`` (a forward pre-hook's arguments)."""
        return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    # --- capture -------------------------------------------------------------------------------
    def capture(self, block: Any, emit: Emit) -> list[RemovableHandle]:
        """Register hooks on ``block`` that call ``emit(z, probs)`` once per forward pass, as the
        attention module returns. Default: z from a forward pre-hook on the output projection (its
        input), probs from the attention module's output; the projection runs inside the attention
        module, so z is always taken first."""
        pending: list[torch.Tensor] = []

        def take_z(_module, args):
            pending.append(args[0])

        def take_probs(_module, _args, output):
            probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if probs is None:
                raise RuntimeError("attention probabilities were not returned; load the model with eager attention")
            emit(pending.pop(), probs)

        return [
            self.output_projection(block).register_forward_pre_hook(take_z),
            self.attention(block).register_forward_hook(take_probs),
        ]

    def positions(self, config: Mapping[str, Any]) -> int:
        """Usable token positions of one window, from a config.json dict (0: not stated)."""
        return int(config.get("max_position_embeddings") or config.get("n_positions") or 0)

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


def register(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: make ``cls`` the adapter of its ``model_types``."""
    adapter = cls()
    FAMILIES[cls.family] = adapter
    for model_type in cls.model_types:
        ADAPTERS[model_type] = adapter
    return cls


def supported_families() -> str:
    """One line: every family and its model types."""
    return "; ".join(f"{a.title} ({', '.join(a.model_types)})" for a in FAMILIES.values())


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
    if adapter is None:
        what = model_type or type(getattr(model_or_config, "config", model_or_config)).__name__
        raise ModelError(
            f"--model {spec or '?'}: architecture {what!r} has no adapter; supported families: {supported_families()}"
        )
    return adapter


def adapter_by_family(family: str) -> ModelAdapter:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ModelError(f"model family {family!r} is unknown; supported families: {supported_families()}") from None


def kv_group(head: int, shape: Shape) -> int:
    """The key-value head that query head ``head`` reads (grouped-query attention, SPEC §8)."""
    return head // shape.group_size
