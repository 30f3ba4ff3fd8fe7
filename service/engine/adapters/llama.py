"""The Llama family: Llama, Mistral, Qwen2/Qwen3, SmolLM2.

Pre-norm decoder blocks ``layers[i]`` (RMSNorm), rotary position embeddings on queries and keys
(values untouched), grouped-query attention: ``num_key_value_heads`` value heads, query head h reading
value head ``h // (H / H_kv)``. z is the input of ``self_attn.o_proj``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from headatlas.service.engine.adapters.base import ConfigKeys, ModelAdapter, RandomShape, register
from headatlas.service.errors import ModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@register
class LlamaAdapter(ModelAdapter):
    family = "llama"
    title = "Llama family: Llama, Mistral, Qwen2, Qwen3, SmolLM2"
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    causal = True
    pre_norm = True
    config_keys = ConfigKeys(kv_heads="num_key_value_heads", head_dim="head_dim")
    row_attention = True  # LlamaAttention calls the attention interface
    random_shapes = {
        "llama": RandomShape("llama", 2, 4, 32, kv_heads=2),
        # SmolLM2-135M's shape (its weights: --model smollm2), for timing where the GGUF is not installed
        "smollm2": RandomShape("llama", 30, 9, 576, kv_heads=3, intermediate=1536, positions=8192),
    }

    def blocks(self, model: Any) -> list[torch.nn.Module]:
        layers = getattr(model, "layers", None)
        if layers is None or not len(layers):
            raise ModelError(
                f"{type(model).__name__} is not a Llama-family base model (expected layers[i].self_attn); "
                "load AutoModel or the causal LM's .model"
            )
        return list(layers)

    def attention(self, block: Any) -> torch.nn.Module:
        return block.self_attn

    def output_projection(self, block: Any) -> torch.nn.Module:
        return block.self_attn.o_proj

    def output_weight(self, block: Any) -> torch.Tensor:
        return block.self_attn.o_proj.weight

    def values(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        attn = block.self_attn
        batch, n_pos, _ = x.shape
        return attn.v_proj(x).view(batch, n_pos, -1, attn.head_dim).transpose(1, 2)

    # LlamaModel: embed_tokens hands its output to layers[0]; RoPE acts inside attention
    def embedding_output(self, model: Any) -> torch.nn.Module:
        return model.embed_tokens

    def attention_norm(self, block: Any) -> torch.nn.Module:
        return block.input_layernorm

    def final_norm(self, model: Any) -> torch.nn.Module:
        return model.norm

    def random_config(self, shape: RandomShape, vocab_size: int) -> PretrainedConfig:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate or 2 * shape.hidden,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads or shape.heads,
            max_position_embeddings=shape.positions or 512,  # rotary: no weights depend on it
            tie_word_embeddings=True,  # as SmolLM2's: the next-token loss (SPEC §9) needs the LM head
            attn_implementation="eager",
        )
