"""BERT-family encoders: BERT, RoBERTa, ELECTRA, MiniLM (and RoBERTa's kin XLM-R, CamemBERT).

Post-norm blocks ``encoder.layer[i]`` (``LN(x + Attn(x))``) whose self-attention (``attention.self``) returns the context
layer (z, before W_O) and the probabilities together; W_O is ``attention.output.dense``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from headatlas.service.engine.adapters.base import ConfigKeys, ModelAdapter, RandomShape, register
from headatlas.service.engine.adapters.points import HookPoint, parse_hook_name
from headatlas.service.errors import ModelError

if TYPE_CHECKING:
    from transformers import BertConfig, PretrainedConfig, PreTrainedModel

# RoBERTa-style models count positions from padding_idx + 1: 514 embeddings give 512 positions.
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "longformer")


def _mlm_head_of(mlm: Any) -> torch.nn.Module | None:
    """The head of a ``*ForMaskedLM`` model: BERT's ``cls``, RoBERTa's ``lm_head``, ELECTRA's
    generator head."""
    if hasattr(mlm, "cls"):
        return mlm.cls
    if hasattr(mlm, "lm_head"):
        return mlm.lm_head
    if hasattr(mlm, "generator_predictions") and hasattr(mlm, "generator_lm_head"):
        return torch.nn.Sequential(mlm.generator_predictions, mlm.generator_lm_head)
    return None


@register
class BertAdapter(ModelAdapter):
    family = "bert"
    title = "BERT-family encoders: BERT, RoBERTa, ELECTRA, MiniLM"
    model_types = ("bert", "roberta", "electra", "xlm-roberta", "camembert")
    causal = False
    pre_norm = False
    config_keys = ConfigKeys()
    masked_lm_heads = True
    random_shapes = {
        # name: (layers, heads, hidden)
        "bert-base": RandomShape("bert", 12, 12, 768),
        "bert-large": RandomShape("bert", 24, 16, 1024),
        "minilm": RandomShape("bert", 6, 12, 384),
        "tiny": RandomShape("bert", 2, 4, 32),
        # the encoder of random:tiny with a random masked-LM head: the MLM objective of SPEC §9
        "tiny-mlm": RandomShape("bert", 2, 4, 32, mlm=True),
    }

    def positions(self, config: Mapping[str, Any]) -> int:
        positions = super().positions(config)
        if positions and config.get("model_type") in OFFSET_POSITIONS:
            positions -= int(config.get("pad_token_id") or 1) + 1
        return positions

    def blocks(self, model: Any) -> list[torch.nn.Module]:
        layers = getattr(getattr(model, "encoder", None), "layer", None)
        if layers is None or not len(layers) or not hasattr(layers[0], "attention"):
            raise ModelError(
                f"{type(model).__name__} is not a BERT-family encoder (expected encoder.layer[i].attention.self); "
                "load its base model (AutoModel)"
            )
        return list(layers)

    def attention(self, block: Any) -> torch.nn.Module:
        return block.attention.self

    def output_projection(self, block: Any) -> torch.nn.Module:
        return block.attention.output.dense

    def output_weight(self, block: Any) -> torch.Tensor:
        return block.attention.output.dense.weight

    def values(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        attn = block.attention.self
        batch, n_pos, _ = x.shape
        v = attn.value(x).view(batch, n_pos, attn.num_attention_heads, attn.attention_head_size)
        return v.transpose(1, 2)

    # BertEmbeddings: words + positions + token types, LayerNorm, dropout
    def embedding_output(self, model: Any) -> torch.nn.Module:
        return model.embeddings

    def attention_norm(self, block: Any) -> torch.nn.Module:
        return block.attention.output.LayerNorm

    def final_norm(self, model: Any) -> None:
        return None

    def hook_point(self, model: Any, name: str) -> HookPoint:
        # the self-attention returns the context layer (z) and the probabilities together; z is
        # taken (or replaced) there, as it leaves the module, rather than at W_O's input
        found = super().hook_point(model, name)  # the name and the layer checked
        layer, point = parse_hook_name(name)
        if point == "attn.z" and layer is not None:
            return HookPoint(name, self.attention(self.blocks(model)[layer]), "output")
        return found

    def random_config(self, shape: RandomShape, vocab_size: int) -> PretrainedConfig:
        from transformers import BertConfig

        return BertConfig(
            vocab_size=vocab_size,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            hidden_size=shape.hidden,
            intermediate_size=4 * shape.hidden,
            attn_implementation="eager",
        )

    def random_model(self, config: PretrainedConfig) -> PreTrainedModel:
        from transformers import BertModel

        return BertModel(cast("BertConfig", config), add_pooling_layer=False)

    def random_name(self, shape: RandomShape, seed: int) -> str:
        head = " with an MLM head" if shape.mlm else ""
        return f"random BERT {shape.layers}x{shape.heads}x{shape.hidden}{head} (seed {seed})"

    def random_key(self, shape: RandomShape, seed: int) -> str:
        key = f"random {(shape.layers, shape.heads, shape.hidden)} seed {seed}"  # the keys of earlier runs
        return f"{key} mlm" if shape.mlm else key

    def load_mlm_head(self, source: str) -> torch.nn.Module | None:
        """The checkpoint's masked-LM head when its config names a masked-LM architecture and its
        weights hold the head (a sentence-embedding checkpoint such as MiniLM has none)."""
        from transformers import AutoConfig, AutoModelForMaskedLM

        if not self.masked_lm(AutoConfig.from_pretrained(source)):
            return None
        mlm, info = AutoModelForMaskedLM.from_pretrained(source, output_loading_info=True)
        head = _mlm_head_of(mlm)
        prefixes = tuple(f"{name}." for name, _ in mlm.named_children() if name != mlm.base_model_prefix)
        if head is None or any(k.startswith(prefixes) for k in info.get("missing_keys", [])):
            return None  # a head the checkpoint does not hold would be random
        return head

    def random_mlm_head(self, config: PretrainedConfig, model: Any) -> torch.nn.Module | None:
        model_type = getattr(config, "model_type", "bert")
        if model_type == "bert":
            from transformers.models.bert.modeling_bert import BertOnlyMLMHead

            head: Any = BertOnlyMLMHead(config)
            head.predictions.decoder.weight = model.embeddings.word_embeddings.weight
            return head
        if model_type in OFFSET_POSITIONS[:3]:
            from transformers.models.roberta.modeling_roberta import RobertaLMHead

            head = RobertaLMHead(config)
            head.decoder.weight = model.embeddings.word_embeddings.weight
            return head
        return None
