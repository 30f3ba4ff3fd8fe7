"""DistilBERT: BERT distilled to half its layers, with its own module and config names.

Post-norm blocks ``transformer.layer[i]`` (``LN(x + Attn(x))``, the norm ``sa_layer_norm``) whose
self-attention (``attention``) projects with ``q_lin``/``k_lin``/``v_lin`` and applies W_O
(``out_lin``) inside: z is ``out_lin``'s input. Learned positions, no token types; its config
names the sizes ``n_layers``, ``n_heads``, ``dim`` and ``hidden_dim``. The masked-LM head of
``DistilBertForMaskedLM`` is ``vocab_transform``, the activation, ``vocab_layer_norm`` and
``vocab_projector`` (tied to the word embeddings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from headatlas.service.engine.adapters.base import ConfigKeys, ModelAdapter, RandomShape, register
from headatlas.service.errors import ModelError

if TYPE_CHECKING:
    from transformers import DistilBertForMaskedLM, PretrainedConfig

HEAD_PARTS = ("vocab_transform", "vocab_layer_norm", "vocab_projector")


def _head_of(mlm: DistilBertForMaskedLM) -> torch.nn.Module:
    """DistilBertForMaskedLM's forward after its encoder, as one module."""
    return torch.nn.Sequential(mlm.vocab_transform, mlm.activation, mlm.vocab_layer_norm, mlm.vocab_projector)


@register
class DistilBertAdapter(ModelAdapter):
    family = "distilbert"
    title = "DistilBERT"
    model_types = ("distilbert",)
    causal = False
    pre_norm = False
    config_keys = ConfigKeys(layers="n_layers", heads="n_heads", hidden="dim", intermediate="hidden_dim")
    masked_lm_heads = True
    random_shapes = {
        "distilbert": RandomShape("distilbert", 2, 4, 32),
        "distilbert-base": RandomShape("distilbert", 6, 12, 768),  # distilbert-base-uncased's shape
    }

    def blocks(self, model: Any) -> list[torch.nn.Module]:
        layers = getattr(getattr(model, "transformer", None), "layer", None)
        if layers is None or not len(layers):
            raise ModelError(
                f"{type(model).__name__} is not a DistilBERT base model (expected transformer.layer[i].attention); "
                "load AutoModel"
            )
        return list(layers)

    def attention(self, block: Any) -> torch.nn.Module:
        return block.attention

    def output_projection(self, block: Any) -> torch.nn.Module:
        return block.attention.out_lin

    def output_weight(self, block: Any) -> torch.Tensor:
        return block.attention.out_lin.weight

    def values(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        attn = block.attention
        batch, n_pos, _ = x.shape
        return attn.v_lin(x).view(batch, n_pos, attn.n_heads, attn.attention_head_size).transpose(1, 2)

    # Embeddings: words + positions, LayerNorm, dropout
    def embedding_output(self, model: Any) -> torch.nn.Module:
        return model.embeddings

    def attention_norm(self, block: Any) -> torch.nn.Module:
        return block.sa_layer_norm

    def final_norm(self, model: Any) -> None:
        return None

    def random_config(self, shape: RandomShape, vocab_size: int) -> PretrainedConfig:
        from transformers import DistilBertConfig

        return DistilBertConfig(
            vocab_size=vocab_size,
            n_layers=shape.layers,
            n_heads=shape.heads,
            dim=shape.hidden,
            hidden_dim=shape.intermediate or 4 * shape.hidden,
            max_position_embeddings=512,
            attn_implementation="eager",
        )

    def load_mlm_head(self, source: str) -> torch.nn.Module | None:
        """The head of a ``DistilBertForMaskedLM`` checkpoint, when its weights hold it."""
        from transformers import AutoConfig
        from transformers import DistilBertForMaskedLM as MaskedLM

        if not self.masked_lm(AutoConfig.from_pretrained(source)):
            return None
        mlm, info = MaskedLM.from_pretrained(source, output_loading_info=True)
        if any(k.startswith(HEAD_PARTS) for k in info.get("missing_keys", [])):
            return None  # a head the checkpoint does not hold would be random
        return _head_of(mlm)

    def random_mlm_head(self, config: PretrainedConfig, model: Any) -> torch.nn.Module | None:
        from transformers.activations import get_activation

        dim, vocab = int(config.dim), int(config.vocab_size)
        projector = torch.nn.Linear(dim, vocab)
        projector.weight = model.embeddings.word_embeddings.weight
        parts = (torch.nn.Linear(dim, dim), get_activation(config.activation), torch.nn.LayerNorm(dim, eps=1e-12))
        return torch.nn.Sequential(*parts, projector)
